"""load_memmap on directories written by tensordict's memmap: the fixed fixture, directories the
real tensordict writes at test time, and damaged or hostile ones (pickle sidecars never run)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import memtree
from memtree.format.dtypes import dtype_from_name
from memtree.interop import read_tensordict_dir
from treeutil import random_tensor, snapshot
from treeutil import raw_bytes as as_bytes

FIXTURE = Path(__file__).parent / "fixtures" / "tensordict_mmap_example"
TD_TYPE = "<class 'tensordict._td.TensorDict'>"
NTD_TYPE = "<class 'tensordict.tensorclass.NonTensorData'>"


# -- the fixed artifact --------------------------------------------------------------------------
def test_fixture_loads_with_its_quirks(tmp_path: Path) -> None:
    root = tmp_path / "td"
    shutil.copytree(FIXTURE, root)
    before = snapshot(root)
    tree = memtree.load_memmap(root, mode="r")
    assert tree.batch_size == torch.Size([2, 1]) and tree["nested"].batch_size == torch.Size([2, 1])
    assert tree["nested", "int64"].dtype == torch.int64 and tree["nested", "int64"].tolist() == [
        [1],
        [2],
    ]
    bf16 = tree["nested", "bfloat16"]
    assert bf16.dtype == torch.bfloat16 and bf16.tolist() == [[1.0], [1.0]]
    assert tree["nested", "string"] == ["a string!"]
    assert tree.is_memmap()
    with pytest.raises(memtree.ReadOnlyError):
        tree["nested", "int64"].add_(1)
    assert snapshot(root) == before  # leaf files are longer than needed: tolerated, never changed


def test_fixture_through_keys_meta_and_buffered_reads() -> None:
    meta = memtree.load_memmap(FIXTURE, device="meta")
    assert meta["nested", "int64"].device.type == "meta" and meta["nested", "int64"].shape == (2, 1)
    part = memtree.load_memmap(FIXTURE, keys=[("nested", "bfloat16")], mmap=False)
    assert part.keys(include_nested=True) == ["nested", ("nested", "bfloat16")]
    assert not isinstance(part["nested", "bfloat16"], memtree.MemoryMappedTensor)
    with pytest.raises(memtree.MemtreeKeyError):
        memtree.load_memmap(FIXTURE, keys=[("nested", "missing")])


def test_longer_leaf_files_are_tolerated_only_on_the_tensordict_path(tmp_path: Path) -> None:
    d = tmp_path / "mt"
    memtree.TensorTree({"x": torch.arange(2)}).memmap(d)
    with open(d / "x.memmap", "ab") as f:
        f.write(b"\x00")
    with pytest.raises(memtree.LeafSizeError):
        memtree.load_memmap(d, lazy=False)


# -- hand-written tensordict directories (no tensordict needed) -----------------------------------
def write_td(root: Path, meta: dict, files: dict[str, bytes] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "meta.json").write_text(json.dumps(meta))
    for name, data in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def leaf(dtype: str, shape: list[int]) -> dict:
    return {"device": "cpu", "shape": shape, "dtype": dtype, "is_nested": False}


def level(entries: dict, shape: list[int]) -> dict:
    return {**entries, "shape": shape, "device": "cpu", "_type": TD_TYPE}


def test_zero_element_leaf_without_file_and_escaped_keys(tmp_path: Path) -> None:
    root = write_td(
        tmp_path / "td",
        level({"empty": leaf("torch.float32", [2, 0]), "a/b": leaf("torch.int16", [2])}, [2]),
        {"a%2Fb.memmap": torch.tensor([5, 6], dtype=torch.int16).numpy().tobytes()},
    )
    tree = memtree.load_memmap(root)
    assert tree["empty"].shape == (2, 0) and tree["a/b"].tolist() == [5, 6]


def test_missing_or_short_leaf_files_are_damage(tmp_path: Path) -> None:
    root = write_td(tmp_path / "td", level({"x": leaf("torch.int64", [2])}, [2]))
    with pytest.raises(memtree.MissingLeafError, match="x.memmap"):
        memtree.load_memmap(root)
    (root / "x.memmap").write_bytes(b"\x00" * 15)
    with pytest.raises(memtree.LeafSizeError):
        memtree.load_memmap(root)
    (root / "x.memmap").unlink()
    (root / "x.memmap").symlink_to("/dev/zero")
    with pytest.raises(memtree.UnsafePathError):
        memtree.load_memmap(root)


def test_pickle_sidecars_are_never_executed(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    root = write_td(
        tmp_path / "td",
        level({"w": leaf("torch.float32", [1]), "obj": {"type": "NonTensorData"}}, [1]),
        {
            "w.memmap": torch.ones(1).numpy().tobytes(),
            "obj/meta.json": json.dumps(
                {"_type": NTD_TYPE, "_metadata": None, "_is_non_tensor": True}
            ).encode(),
            "obj/other.pickle": pickle.dumps(Evil()),
        },
    )
    for allow in (False, True):
        with pytest.raises(memtree.PickleNotAllowedError, match="never executes"):
            memtree.load_memmap(root, allow_pickle=allow)
    assert memtree.load_memmap(root, keys=["w"])["w"].tolist() == [1.0]
    with pytest.raises(memtree.PickleNotAllowedError):
        memtree.convert(root, tmp_path / "out")
    assert not marker.exists()


MALFORMED = {
    "not JSON": b"{not json",
    "top level list": b"[]",
    "shape is a string": level({"x": leaf("torch.int64", "2")}, [2]),
    "negative dim": level({"x": leaf("torch.int64", [-2])}, [2]),
    "float dim": level({"x": leaf("torch.int64", [2.0])}, [2]),
    "unknown dtype": level({"x": leaf("torch.float128", [2])}, [2]),
    "dtype without torch prefix": level({"x": leaf("float32", [2])}, [2]),
    "dtype not a string": level({"x": leaf(7, [2])}, [2]),
    "leaf does not match batch": level({"x": leaf("torch.int64", [3])}, [2]),
    "batch is not a list": level({"x": leaf("torch.int64", [2])}, "2"),
    "is_nested not bool": level({"x": {**leaf("torch.int64", [2]), "is_nested": "no"}}, [2]),
    "type not a string": level({"x": {"type": 3}}, [2]),
    "child type not a class": None,  # built below
    "duplicate fields": b'{"shape": [2], "shape": [3], "device": "cpu", "_type": "'
    + TD_TYPE.encode()
    + b'"}',
    "absurd size": level({"x": leaf("torch.int64", [2**40, 2**40])}, [2**40]),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_tensordict_meta_json_gives_meta_format_error(tmp_path: Path, case: str) -> None:
    root = tmp_path / "td"
    top = level({"sub": {"type": "TensorDict"}}, [2])
    write_td(root, top, {"x.memmap": b"\x00" * 16})
    bad = MALFORMED[case]
    if case == "child type not a class":
        bad = {"shape": [2], "_type": 5}
    (root / "sub").mkdir()
    (root / "sub" / "meta.json").write_bytes(
        bad if isinstance(bad, bytes) else json.dumps(bad).encode()
    )
    with pytest.raises(memtree.MetaFormatError, match=r"sub.meta\.json"):
        memtree.load_memmap(root)


def test_malformed_root_meta_json_gives_meta_format_error(tmp_path: Path) -> None:
    root = write_td(tmp_path / "td", level({"x": leaf("torch.int64", [2])}, [2]))
    (root / "meta.json").write_bytes(b'{"_type": "' + TD_TYPE.encode() + b'", "x": ')
    with pytest.raises(memtree.MetaFormatError):
        memtree.load_memmap(root)
    (root / "meta.json").write_text(json.dumps(level({"x": leaf("torch.int64", [2, "a"])}, [2])))
    with pytest.raises(memtree.MetaFormatError, match=r"\['x'\]\.shape"):
        memtree.load_memmap(root)


def test_child_batch_must_extend_the_parent_batch(tmp_path: Path) -> None:
    root = write_td(
        tmp_path / "td",
        level({"sub": {"type": "TensorDict"}}, [3]),
        {"sub/meta.json": json.dumps(level({}, [2])).encode()},
    )
    with pytest.raises(memtree.MetaFormatError, match="parent"):
        memtree.load_memmap(root)


def test_sub_directory_symlinks_are_refused(tmp_path: Path) -> None:
    outside = write_td(tmp_path / "outside", level({}, []))
    root = write_td(tmp_path / "td", level({"sub": {"type": "TensorDict"}}, []))
    (root / "sub").symlink_to(outside)
    with pytest.raises(memtree.UnsafePathError):
        memtree.load_memmap(root)


# -- directories written by the real tensordict ------------------------------------------------
TD_DTYPES = [
    dtype_from_name(n)
    for n in (
        "bool",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
    )
]


@pytest.fixture
def tensordict():
    """The real tensordict package (these tests skip without it; the ones above never need it)."""
    return pytest.importorskip("tensordict")


@pytest.fixture
def real_td(tmp_path: Path, tensordict):
    from tensordict import NonTensorData, NonTensorStack, TensorDict

    data = TensorDict(
        {
            **{f"d_{str(dt)[6:]}": random_tensor((4, 3), dt, i) for i, dt in enumerate(TD_DTYPES)},
            "nested": TensorDict(
                {"x": torch.arange(4.0), "deeper": {"y": torch.ones(4, 2, dtype=torch.bfloat16)}},
                [4],
            ),
            "empty": torch.zeros(4, 0),
            "a/b c%": torch.ones(4, dtype=torch.int8),  # a key tensordict percent-encodes
            "text": NonTensorData("hello", batch_size=[4]),
            "cfg": NonTensorData({"lr": 0.1, "layers": [1, 2]}, batch_size=[4]),
            "labels": NonTensorStack("a", "b", "c", "d"),
        },
        batch_size=[4],
    )
    root = tmp_path / "td"
    data.memmap(root)
    return root, data


def test_directories_written_by_tensordict_load_bit_exact(real_td) -> None:
    root, data = real_td
    tree = memtree.load_memmap(root)
    assert tree.batch_size == torch.Size([4]) and tree["nested"].batch_size == torch.Size([4])
    for dt in TD_DTYPES:
        key = f"d_{str(dt)[6:]}"
        assert tree[key].dtype == dt and as_bytes(tree[key]) == as_bytes(data[key]), key
    assert as_bytes(tree["nested", "deeper", "y"]) == as_bytes(data["nested", "deeper", "y"])
    assert tree["nested", "x"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert tree["empty"].shape == (4, 0) and tree["a/b c%"].tolist() == [1, 1, 1, 1]
    assert tree["text"] == "hello" and tree["cfg"] == {"lr": 0.1, "layers": [1, 2]}
    assert tree["labels"] == ["a", "b", "c", "d"]
    assert not os.path.exists(os.path.join(root, "empty.memmap"))  # tensordict's quirk, tolerated


def test_tensordict_dir_converts_to_memtree_and_back_to_tensordict(real_td, tmp_path: Path) -> None:
    from tensordict import TensorDict

    root, data = real_td
    memtree.convert(root, tmp_path / "mt")
    tree = memtree.load_memmap(tmp_path / "mt")
    assert tree["text"] == "hello"
    for key in ("d_bfloat16", "d_complex32", ("nested", "deeper", "y")):
        assert as_bytes(tree[key]) == as_bytes(data[key])
    again = TensorDict({"w": tree["d_float64"]}, batch_size=[4])
    assert torch.equal(again["w"], data["d_float64"])


def test_tensorclass_content_loads_as_a_sub_tree(tmp_path: Path, tensordict) -> None:
    from tensordict import TensorDict, tensorclass

    @tensorclass
    class Sample:
        obs: torch.Tensor
        name: str

    data = TensorDict(
        {"s": Sample(obs=torch.arange(6.0).reshape(2, 3), name="bob", batch_size=[2])}, [2]
    )
    data.memmap(tmp_path / "td")
    tree = memtree.load_memmap(tmp_path / "td")
    assert (
        tree["s", "obs"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        and tree["s", "name"] == "bob"
    )


def test_unsupported_tensordict_containers_are_refused_clearly(tmp_path: Path, tensordict) -> None:
    from tensordict import LazyStackedTensorDict, TensorDict

    stacked = LazyStackedTensorDict(
        TensorDict({"a": torch.ones(3)}, []), TensorDict({"a": torch.zeros(3)}, []), stack_dim=0
    )
    stacked.memmap(tmp_path / "lazy")
    with pytest.raises(memtree.UnsupportedVersionError, match="densify"):
        memtree.load_memmap(tmp_path / "lazy")


def test_real_pickled_non_tensor_data_is_refused(tmp_path: Path, tensordict) -> None:
    from tensordict import NonTensorData, TensorDict

    TensorDict({"o": NonTensorData(object(), batch_size=[]), "w": torch.ones(2)}, []).memmap(
        tmp_path / "td"
    )
    with pytest.raises(memtree.PickleNotAllowedError):
        memtree.load_memmap(tmp_path / "td", allow_pickle=True)
    assert read_tensordict_dir(tmp_path / "td", keys=["w"]).entries["w"].tolist() == [1.0, 1.0]


@pytest.mark.slow
def test_tensordict_is_never_imported(tmp_path: Path) -> None:
    import subprocess
    import sys

    code = (
        "import sys, memtree\n"
        f"tree = memtree.load_memmap({str(FIXTURE)!r})\n"
        f"memtree.convert({str(FIXTURE)!r}, {str(tmp_path / 'out')!r})\n"
        "assert tree['nested', 'int64'].tolist() == [[1], [2]]\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensordict'))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# -- torchrl storage dumps: only the rows torchrl wrote ----------------------------------------
@pytest.fixture
def torchrl_dump(tmp_path: Path):
    """``ReplayBuffer.dumps`` of a LazyMemmapStorage of capacity 10 holding 6 rows."""
    pytest.importorskip("torchrl")
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer

    rb = TensorDictReplayBuffer(storage=LazyMemmapStorage(10), batch_size=4)
    data = TensorDict(
        {"obs": torch.arange(12.0).view(6, 2), "act": torch.arange(6), ("next", "r"): torch.rand(6, 3)}, [6]
    )
    rb.extend(data)
    rb.dumps(tmp_path / "rb")
    return tmp_path / "rb" / "storage", data


def test_a_torchrl_dump_loads_only_the_rows_torchrl_wrote(torchrl_dump) -> None:
    root, data = torchrl_dump
    assert json.loads((root / "storage_metadata.json").read_text())["len"] == 6
    assert json.loads((root / "meta.json").read_text())["shape"] == [10]  # the capacity
    for kw in ({}, {"mmap": False}, {"mode": "r"}):
        tree = memtree.load_memmap(root, **kw)
        assert tree.batch_size == torch.Size([6]) and tree["next"].batch_size == torch.Size([6])
        for key in ("obs", "act", ("next", "r")):
            assert as_bytes(tree[key]) == as_bytes(data[key]), key
        assert tree["index"].shape == (6,)  # the buffer's own key, cut too
    assert memtree.load_memmap(root, device="meta")["obs"].shape == (6, 2)
    assert memtree.load_memmap(root, keys=[("next", "r")])["next", "r"].shape == (6, 3)
    from memtree.store.foreign.tensordict import valid_rows

    assert valid_rows(root) == 6


def test_a_full_torchrl_buffer_loads_every_row(tmp_path: Path) -> None:
    pytest.importorskip("torchrl")
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyMemmapStorage(4))
    rb.extend(TensorDict({"x": torch.arange(7.0)}, [7]))  # wrapped around: 4 valid rows
    rb.dumps(tmp_path / "rb")
    assert memtree.load_memmap(tmp_path / "rb" / "storage")["x"].tolist() == [4.0, 5.0, 6.0, 3.0]


def test_a_torchrl_storage_of_several_dims_keeps_every_row_that_may_hold_data(tmp_path: Path) -> None:
    """ndim=2: torchrl's len counts elements over two dims (12: 4 rows of 3 in a [7, 3] storage);
    the dump does not say so, and memtree keeps min(len, capacity) rows: all 7, the 4 valid
    ones first."""
    pytest.importorskip("torchrl")
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, ReplayBuffer

    rb = ReplayBuffer(storage=LazyMemmapStorage(20, ndim=2))
    rb.extend(TensorDict({"x": torch.arange(12.0).view(3, 4)}, [3, 4]))
    rb.dumps(tmp_path / "rb")
    valid = rb.storage.get(slice(None))["x"]
    assert valid.shape == (4, 3) and len(rb.storage) == 12
    tree = memtree.load_memmap(tmp_path / "rb" / "storage")
    assert tree["x"].shape == (7, 3) and torch.equal(tree["x"][:4], valid)


def _td_dir(root: Path, rows: int = 4) -> None:
    root.mkdir(parents=True, exist_ok=True)
    meta = {"x": {"device": "cpu", "shape": [rows], "dtype": "torch.int64", "is_nested": False},
            "shape": [rows], "device": "cpu", "_type": TD_TYPE}
    (root / "meta.json").write_text(json.dumps(meta))
    torch.arange(rows, dtype=torch.int64).numpy().tofile(root / "x.memmap")


@pytest.mark.parametrize(
    "content",
    ['{"len": -1}', '{"len": true}', '{"len": "2"}', '{"len": 2.0}', '{"len": 1e30}', '{"len": 2, "len": 3}',
     '{"metadata": {}}', "[2]", "not json", '{"len": ' + "[" * 5000 + "]" * 5000 + "}", ""],
)
def test_a_malformed_storage_metadata_is_refused_naming_it(tmp_path: Path, content: str) -> None:
    _td_dir(tmp_path / "s")
    (tmp_path / "s" / "storage_metadata.json").write_text(content)
    before = snapshot(tmp_path / "s")
    with pytest.raises(memtree.MetaFormatError, match="storage_metadata.json"):
        memtree.load_memmap(tmp_path / "s")
    assert not memtree.verify_tree(tmp_path / "s").ok
    assert snapshot(tmp_path / "s") == before


def test_a_storage_metadata_that_is_a_link_a_fifo_or_huge_is_refused(tmp_path: Path) -> None:
    _td_dir(tmp_path / "s")
    meta = tmp_path / "s" / "storage_metadata.json"
    (tmp_path / "elsewhere.json").write_text('{"len": 1}')
    meta.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(memtree.UnsafePathError, match="symbolic link"):
        memtree.load_memmap(tmp_path / "s")
    meta.unlink()
    os.mkfifo(meta)  # would block a plain open()
    with pytest.raises(memtree.UnsafePathError, match="not a regular file"):
        memtree.load_memmap(tmp_path / "s")
    meta.unlink()
    with open(meta, "wb") as f:
        f.truncate(1 << 30)  # sparse: refused from its size, never read
    with pytest.raises(memtree.LimitError, match="delete it"):
        memtree.load_memmap(tmp_path / "s")


def test_storage_metadata_lengths_at_the_edges(tmp_path: Path) -> None:
    _td_dir(tmp_path / "s")
    meta = tmp_path / "s" / "storage_metadata.json"
    for length, rows in ((0, []), (2, [0, 1]), (4, [0, 1, 2, 3]), (2**62, [0, 1, 2, 3])):
        meta.write_text(json.dumps({"metadata": {}, "is_pytree": False, "len": length}))
        assert memtree.load_memmap(tmp_path / "s")["x"].tolist() == rows, length
    meta.unlink()  # no file: a plain tensordict directory, every row
    assert memtree.load_memmap(tmp_path / "s")["x"].tolist() == [0, 1, 2, 3]


def test_a_non_tensor_stack_of_a_dump_is_cut_to_the_valid_rows(tmp_path: Path, tensordict) -> None:
    from tensordict import NonTensorStack, TensorDict

    TensorDict({"x": torch.arange(4), "label": NonTensorStack("a", "b", "c", "d")}, [4]).memmap(tmp_path / "s")
    (tmp_path / "s" / "storage_metadata.json").write_text('{"metadata": {}, "is_pytree": false, "len": 3}')
    tree = memtree.load_memmap(tmp_path / "s")
    assert tree["label"] == ["a", "b", "c"] and tree["x"].tolist() == [0, 1, 2]
