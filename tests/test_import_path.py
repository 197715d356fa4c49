"""What a fresh process imports to get a model ready, and the classes made cheap to import.

``memtree.load_memmap(d).to_module(m)`` after ``memtree.empty_init()`` is the fresh-process
"ready" of issue 17 (``benchmarks/run.py w4``, fresh process rows): its import must not pull in what
that path never runs (writing, threaded fills, datasets, growth, conversions, checkpoints). The
guard is the list of modules, asserted in a new interpreter; the time is the benchmark's claim.

The classes of ``meta.json`` and the options are :class:`~memtree.format.record.Record`
dataclasses: their equality, hash, ``repr``, immutability and ``dataclasses`` support are those
of ``@dataclass(frozen=True)``, checked here against such a twin.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import memtree
from memtree.format.chunks import ChunkSums
from memtree.dist.placement import Layout
from memtree.format.schema import ChildMeta, JsonMeta, LeafMeta, LevelMeta, PickleMeta
from memtree.store.reading.options import ReadOptions, WriteOptions
from memtree.store.primitives.checksums import default_checksum

REPO = Path(__file__).resolve().parent.parent

#: Modules that loading a tree into a module built under empty_init never needs.
NOT_ON_THE_READY_PATH = (
    "memtree.store.primitives.fill",  # threaded preadv: reads, not mappings
    "memtree.store.writing.write",
    "memtree.store.primitives.commit",
    "memtree.store.writing.grow",
    "memtree.store.primitives.crypto",
    "memtree.store.verify",
    "memtree.store.urls.remote",
    "memtree.store.writing.linking",
    "memtree.store.primitives.lease",
    "memtree.store.reading.unshare",  # only for a leaf another tree shares (imported on first use)
    "memtree.tree.dataset",
    "memtree.tree.ops",
    "memtree.tree.parts.growth",
    "memtree.tree.records",
    "memtree.interop",
    "memtree.nn.loading",
    "memtree.nn.offloading",
    "memtree.training",
    "memtree.routing",
    "memtree.dcp",
)


def _run(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 3)))
    m.register_buffer("steps", torch.arange(4))
    return m


def test_ready_in_a_fresh_process_imports_only_its_path(tmp_path: Path) -> None:
    """A new interpreter binds a tree into an empty_init module, bit-exact, and imports none of
    :data:`NOT_ON_THE_READY_PATH`."""
    src = _model()
    memtree.TensorTree.from_module(src).memmap(str(tmp_path / "m"))
    torch.save(src.state_dict(), tmp_path / "ref.pt")
    code = (
        "import sys, torch\n"
        "from torch import nn\n"
        "import memtree\n"
        "def build():\n"
        "    m = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 3)))\n"
        "    m.register_buffer('steps', torch.arange(4))\n"
        "    return m\n"
        "with memtree.empty_init():\n"
        "    m = build()\n"
        f"memtree.load_memmap({str(tmp_path / 'm')!r}).to_module(m)\n"
        f"ref = torch.load({str(tmp_path / 'ref.pt')!r})\n"
        "sd = m.state_dict()\n"
        "same = sd.keys() == ref.keys() and all(\n"
        "    sd[k].dtype == v.dtype and torch.equal(sd[k].view(torch.uint8), v.view(torch.uint8)) for k, v in ref.items())\n"
        f"print(same, sorted(n for n in sys.modules if n.startswith({NOT_ON_THE_READY_PATH!r})))\n"
    )
    assert _run(code) == "True []"


def test_collation_is_registered_by_the_class_and_imported_on_the_first_batch() -> None:
    """``default_collate`` stacks trees in a process that only imported ``TensorTree``'s module;
    the dataset module is imported by the first batch, not before."""
    code = (
        "import sys, torch\n"
        "from torch.utils.data import default_collate\n"
        "from memtree.tree.tensortree import TensorTree\n"
        "before = 'memtree.tree.dataset' in sys.modules\n"
        "batch = default_collate([TensorTree({'x': torch.zeros(3)}), TensorTree({'x': torch.ones(3)})])\n"
        "print(before, type(batch).__name__, batch['x'].tolist(), 'memtree.tree.dataset' in sys.modules)\n"
    )
    assert _run(code) == "False TensorTree [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]] True"


# -- Record: what @dataclass(frozen=True) generates --------------------------------------------
@dataclasses.dataclass(frozen=True)
class _FrozenLeaf:  # LeafMeta's twin, as @dataclass(frozen=True) makes it
    key: str
    file: str
    dtype_name: str
    shape: tuple[int, ...]
    checksum: str | None = None
    capacity: int | None = None
    chunk_bytes: int | None = None
    int_key: bool = False
    layout: Any = None  # a DTensor's layout (format version 3)
    chunks: Any = None  # the checksums of its chunks (format version 3)
    pack: str | None = None  # a packed leaf's pack and offset (format version 3)
    offset: int | None = None


_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)
_leaves = st.tuples(
    _names,
    _names,
    st.sampled_from(["float32", "int64", "bfloat16", "bool"]),
    st.lists(st.integers(0, 5), max_size=3).map(tuple),
    st.none() | st.just("xxh3:0123456789abcdef"),
    st.none() | st.integers(0, 9),
    st.none() | st.integers(4096, 8192),
    st.booleans(),
    st.none() | st.just(Layout((2,), ("S(0)",))),
    st.none() | st.just(ChunkSums("crc32", 65536, "00000000" "00000001")),
    st.none() | st.just("~pack-0.memmap"),
    st.none() | st.integers(0, 1 << 20),
)


@settings(max_examples=150, deadline=None)
@given(a=_leaves, b=_leaves)
def test_leafmeta_behaves_as_its_frozen_dataclass_twin(a: tuple[Any, ...], b: tuple[Any, ...]) -> None:
    mine, other, twin, twin_other = LeafMeta(*a), LeafMeta(*b), _FrozenLeaf(*a), _FrozenLeaf(*b)
    assert (mine == other) == (twin == twin_other) and (mine != other) == (twin != twin_other)
    assert hash(mine) == hash(twin) and (hash(mine) == hash(LeafMeta(*a)))
    assert repr(mine) == repr(twin).replace("_FrozenLeaf(", "LeafMeta(", 1)
    assert [f.name for f in dataclasses.fields(mine)] == [f.name for f in dataclasses.fields(twin)]
    assert dataclasses.asdict(mine) == dataclasses.asdict(twin)
    assert dataclasses.replace(mine, key="k") == LeafMeta("k", *a[1:])
    assert pickle.loads(pickle.dumps(mine)) == mine and copy.deepcopy(mine) == mine


@pytest.mark.parametrize(
    "obj",
    [
        LeafMeta("w", "w.memmap", torch.float32, (2, 3)),
        ChildMeta("sub", "sub"),
        JsonMeta("n", [1, 2]),
        PickleMeta("p", "p.pkl"),
        LevelMeta((2,), (ChildMeta("sub", "sub"),)),
        ReadOptions(),
        WriteOptions(),
    ],
)
def test_records_are_frozen_and_compare_by_class(obj: Any) -> None:
    name = dataclasses.fields(obj)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError, match=repr(name)):
        setattr(obj, name, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(obj, name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        obj.anything_new = 1
    twin = dataclasses.replace(obj)
    assert twin == obj and twin is not obj and repr(twin) == repr(obj)
    assert obj != object() and obj != dataclasses.astuple(obj)


def test_record_details_kept() -> None:
    """A torch dtype is kept by name; same fields, another class: not equal (as dataclasses);
    WriteOptions' checksum defaults to the fastest installed."""
    assert LeafMeta("w", "w.memmap", torch.bfloat16, ()).dtype_name == "bfloat16"
    assert ChildMeta("a", "b") != PickleMeta("a", "b")
    assert WriteOptions().checksum == default_checksum() and WriteOptions(checksum=None).checksum is None
    assert ReadOptions(mode="r").readonly and ReadOptions(mode="r") != ReadOptions()
