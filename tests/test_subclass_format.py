"""Tensor subclass leaves and every torch dtype (format version 3), without torchao.

A subclass is stored as a group (its inner tensors as leaves, its class's registered name and its
flatten context as tagged JSON) and rebuilt through the registry only; the DTensor annotation and
the version-3 dtypes are pinned here too. torchao's types: tests/test_subclass_torchao.py.
"""

from __future__ import annotations

import importlib
import math
import os
import pickle
from pathlib import Path

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree.format.dtypes import DTYPE_NAMES, QUANTIZED_DTYPE_NAMES, V3_DTYPE_NAMES, byte_dtype
from memtree.format.level import Level
from memtree.format.schema import LeafMeta, LevelMeta, dump_level, parse_level
from memtree.format.subclass import DTensorLayout, Placement, Subclass, SubclassMeta, check_context
from memtree.format import subclass_registry as registry
from memtree.store.writing.write import write_tree
from subclassutil import Cfg, Mode, NoProtocol, ScaledInt8, Span, Unregistered, Wrapped, same_subclass, scaled

pytestmark = [pytest.mark.filterwarnings("ignore:torch.quantize_per"),
              pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")]


def read_json(path: Path) -> dict:
    return orjson.loads(path.read_bytes())


# ---------------------------------------------------------------------------------------------
# every dtype torch has


def _torch_dtypes() -> list[torch.dtype]:
    found = {getattr(torch, n) for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)}
    return sorted(found, key=str)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` holding random bytes (every bit pattern, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(byte_dtype(t.dtype)).contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", _torch_dtypes(), ids=str)
def test_every_torch_dtype_is_stored_bit_exactly(tmp_path, dtype):
    """Enumerates torch's dtypes: a dtype torch adds fails here until memtree stores it."""
    name = str(dtype).removeprefix("torch.")
    assert name in DTYPE_NAMES or name in QUANTIZED_DTYPE_NAMES, f"memtree has no place for {dtype}"
    if name in QUANTIZED_DTYPE_NAMES:  # a quantized tensor: its bytes with its quantizer
        value = torch.quantize_per_tensor(torch.randn(3, 5), 0.25, 3 if "u" in name else 0, dtype)
    else:
        value = _random(dtype, (3, 5))
    strided = value.t() if not value.is_quantized else value
    memtree.TensorTree({"x": value, "t": strided}).memmap(tmp_path / "t")
    for mmap in (True, False):
        loaded = memtree.load_memmap(tmp_path / "t", mmap=mmap)
        for key, expected in (("x", value), ("t", strided)):
            got = loaded[key]
            assert got.dtype == dtype and got.shape == expected.shape
            if expected.is_quantized:
                assert torch.equal(got.int_repr(), expected.int_repr()) and got.q_scale() == expected.q_scale()
            else:
                assert torch.equal(_bytes(got), _bytes(expected)), key


def saved_both_ways(root: Path, state: dict) -> list[dict]:
    """``state`` saved by a Checkpointer blocking (step 1) and async (step 2), both restored."""
    ckpt = memtree.Checkpointer(root)
    ckpt.save(1, state)
    ckpt.save(2, state, blocking=False)
    ckpt.wait()
    return [ckpt.restore(step) for step in (1, 2)]


def test_every_leaf_dtype_goes_through_the_checkpointer_blocking_and_async(tmp_path):
    state = {str(d): _random(d, (3, 4), seed=i).t() for i, d in enumerate(_torch_dtypes()) if str(d)[6:] in DTYPE_NAMES}
    for got in saved_both_ways(tmp_path / "ck", state):
        assert all(torch.equal(_bytes(got[k]), _bytes(v)) and got[k].dtype == v.dtype for k, v in state.items())


def test_version_3_dtypes_make_a_version_3_level_and_nothing_else_does(tmp_path):
    memtree.TensorTree({"a": torch.zeros(2), "b": {"c": _random(torch.int4, (2,))}}).memmap(tmp_path / "t")
    assert read_json(tmp_path / "t" / "meta.json")["version"] == 2
    assert read_json(tmp_path / "t" / "b" / "meta.json")["version"] == 3
    assert {n for n in DTYPE_NAMES[DTYPE_NAMES.index("float4_e2m1fn_x2"):]} == V3_DTYPE_NAMES


def test_a_version_2_level_naming_a_version_3_dtype_is_refused():
    meta = LevelMeta((), (LeafMeta("x", "x.memmap", "float4_e2m1fn_x2", (2,)),))
    doc = orjson.loads(dump_level(meta))
    assert doc["version"] == 3
    with pytest.raises(memtree.MetaFormatError, match="only a version 3 tree has"):
        parse_level(orjson.dumps({**doc, "version": 2}), "meta.json")


# ---------------------------------------------------------------------------------------------
# a subclass round trip


def test_subclass_round_trips_with_its_type_context_and_inner_bytes(tmp_path):
    w = scaled()
    nested = Wrapped(scaled(4, 0.25, seed=1, cfg=None), "outer")
    memtree.TensorTree({"w": w, "mod": {"n": nested}, "plain": torch.ones(2)}).memmap(tmp_path / "t")
    loaded = memtree.load_memmap(tmp_path / "t")
    got = loaded["w"]
    assert type(got) is ScaledInt8 and same_subclass(got, w) and got.scale == 0.5
    ctx = got.cfg
    assert ctx["cfg"] == Cfg(Mode.ASYMMETRIC, (1, 6)) and type(ctx["cfg"].block) is tuple
    assert ctx["span"] == Span(0, 6) and type(ctx["span"]) is Span
    assert ctx["dtype"] is torch.bfloat16 and ctx["size"] == torch.Size([1, 6]) and type(ctx["size"]) is torch.Size
    assert ctx["device"] == torch.device("cpu") and math.isnan(ctx["nan"]) and ctx["none"] is None
    assert ctx["tuple"] == (1, [2, (3,)]) and type(ctx["tuple"][1]) is list
    n = loaded["mod", "n"]
    assert type(n) is Wrapped and n.tag == "outer" and same_subclass(n, nested)
    assert torch.equal(got * 1, w.dequantize())  # it computes as the original does


def test_inner_tensors_are_the_mapped_files(tmp_path):
    memtree.TensorTree({"w": scaled()}).memmap(tmp_path / "t")
    qdata = memtree.load_memmap(tmp_path / "t")["w"].qdata
    assert isinstance(qdata, memtree.MemoryMappedTensor)
    assert qdata.filename == str(tmp_path / "t" / "w" / "qdata.memmap")


def test_the_group_on_disk_is_as_docs_format_says(tmp_path):
    memtree.TensorTree({"w": scaled(cfg={"k": (1, 2)})}, batch_size=[6]).memmap(tmp_path / "t", checksum="crc32")
    root = read_json(tmp_path / "t" / "meta.json")
    assert root["version"] == 3
    (entry,) = root["entries"]
    assert entry == {
        "key": "w", "kind": "subclass", "dir": "w", "type": "tests.ScaledInt8", "dtype": "float32",
        "shape": [6], "stride": [1],
        "context": {"kind": "dict", "items": {"scale": 0.5, "cfg": {"kind": "dict", "items": {"k": {"kind": "tuple", "items": [1, 2]}}}}},
    }
    group = read_json(tmp_path / "t" / "w" / "meta.json")
    assert group["batch_size"] == [] and group["type"] == "TensorTree" and group["version"] == 2
    assert [(e["key"], e["kind"], e["dtype"], e["shape"]) for e in group["entries"]] == [("qdata", "tensor", "int8", [6])]
    assert sorted(os.listdir(tmp_path / "t" / "w")) == ["meta.json", "qdata.memmap"]


def test_a_level_without_subclasses_is_written_as_before(tmp_path):
    memtree.TensorTree({"w": torch.ones(2)}).memmap(tmp_path / "t")
    assert read_json(tmp_path / "t" / "meta.json")["version"] == 2


def test_in_place_memmap_and_shared_memory_keep_the_subclass(tmp_path):
    tree = memtree.TensorTree({"w": scaled()})
    tree.memmap_(tmp_path / "t")
    assert type(tree["w"]) is ScaledInt8 and isinstance(tree["w"].qdata, memtree.MemoryMappedTensor)
    shared = memtree.TensorTree({"w": scaled()}).memmap()
    assert type(shared["w"]) is ScaledInt8 and same_subclass(shared["w"], scaled())


def test_meta_device_and_read_loads_rebuild_the_subclass(tmp_path):
    memtree.TensorTree({"w": scaled()}).memmap(tmp_path / "t")
    meta = memtree.load_memmap(tmp_path / "t", device="meta")["w"]
    assert type(meta) is ScaledInt8 and meta.qdata.is_meta and meta.shape == (6,)
    read = memtree.load_memmap(tmp_path / "t", mmap=False, lazy=False)["w"]
    assert type(read) is ScaledInt8 and same_subclass(read, scaled())


def test_bytes_written_and_read_are_the_inner_tensors_bytes(tmp_path):
    big = ScaledInt8(torch.randint(-128, 128, (1 << 20,), dtype=torch.int8), 0.5)
    memtree.TensorTree({"w": big}).memmap(tmp_path / "t")
    written = sum(p.stat().st_size for p in (tmp_path / "t").rglob("*") if p.is_file())
    assert written <= 1.01 * big.qdata.nbytes
    with open("/proc/self/io") as f:
        before = int(next(line for line in f if line.startswith("rchar")).split()[1])
    loaded = memtree.load_memmap(tmp_path / "t", mmap=False, lazy=False)["w"]
    with open("/proc/self/io") as f:
        read = int(next(line for line in f if line.startswith("rchar")).split()[1]) - before
    assert same_subclass(loaded, big) and read <= 1.01 * big.qdata.nbytes


# ---------------------------------------------------------------------------------------------
# never silently demoted


def test_a_subclass_without_the_flatten_protocol_is_refused_where_tensordict_demotes_it(tmp_path):
    value = torch.arange(4.0).as_subclass(NoProtocol)
    with pytest.raises(memtree.SubclassError, match=r"'x' is a subclassutil.NoProtocol.*__tensor_flatten__"):
        memtree.TensorTree({"x": value}).memmap(tmp_path / "t")
    assert not (tmp_path / "t").exists()
    tensordict = pytest.importorskip("tensordict")
    demoted = tensordict.TensorDict({"x": value}, []).memmap(tmp_path / "td")["x"]
    assert type(demoted) is not NoProtocol  # what memtree refuses to do


def test_a_tensordict_memory_mapped_tensor_is_stored_as_its_values(tmp_path):
    tensordict = pytest.importorskip("tensordict")
    value = tensordict.MemoryMappedTensor.from_tensor(torch.arange(6.0).reshape(2, 3))
    memtree.TensorTree({"x": value, "y": {"z": value[1]}}).memmap(tmp_path / "t")
    back = memtree.load_memmap(tmp_path / "t")
    assert torch.equal(back["x"], torch.arange(6.0).reshape(2, 3))
    assert torch.equal(back["y", "z"], torch.tensor([3.0, 4.0, 5.0]))
    assert "subclass" not in (tmp_path / "t" / "meta.json").read_text()


def test_an_unregistered_class_is_refused_naming_the_key_and_the_fix(tmp_path):
    value = Unregistered(torch.zeros(2, dtype=torch.int8), 1.0)
    with pytest.raises(memtree.SubclassError, match=r"leaf \('a', 'b'\).*register_subclass\(Unregistered\)"):
        memtree.TensorTree({"a": {"b": value}}).memmap(tmp_path / "t")
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize(
    "ctx, what",
    [
        (object(), "a builtins.object"),
        ({1: "int key"}, "a dict with the key 1"),
        ({"t": torch.ones(1)}, "a tensor"),
        (2**70, "beyond 64 bits"),
        (lambda: 0, "function"),
    ],
    ids=["object", "int-key", "tensor", "big-int", "function"],
)
def test_a_context_json_cannot_hold_is_refused(tmp_path, ctx, what):
    with pytest.raises(memtree.SubclassError, match=what):
        memtree.TensorTree({"w": scaled(cfg=ctx)}).memmap(tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_register_subclass_refuses_what_it_cannot_rebuild():
    with pytest.raises(memtree.SubclassError, match="no __tensor_flatten__"):
        memtree.register_subclass(NoProtocol)
    with pytest.raises(memtree.SubclassError, match="is none of these"):
        memtree.register_subclass(int)
    with pytest.raises(memtree.SubclassError, match="memtree's own"):
        memtree.register_subclass(Unregistered, name="torchao.Int8Tensor")
    with pytest.raises(memtree.SubclassError, match="not one memtree can record"):
        memtree.register_subclass(Unregistered, name="__main__.X")
    with pytest.raises(memtree.SubclassError, match="already registered"):
        memtree.register_subclass(Unregistered, name="tests.ScaledInt8")


# ---------------------------------------------------------------------------------------------
# loading: only registered names, never an import of a name read from a file, never pickle


def _edit_entry(path: Path, **fields) -> None:
    doc = read_json(path)
    doc["entries"][0].update(fields)
    path.write_bytes(orjson.dumps(doc))


def test_a_name_nobody_registered_is_refused_or_loaded_as_its_inner_tensors(tmp_path, monkeypatch):
    memtree.TensorTree({"w": scaled()}).memmap(tmp_path / "t", checksum=None)
    _edit_entry(tmp_path / "t" / "meta.json", type="os.system")
    imported = []
    real = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name, *a: imported.append(name) or real(name, *a))
    with pytest.raises(memtree.SubclassError, match=r"'os.system', which no register_subclass registered"):
        memtree.load_memmap(tmp_path / "t")["w"]
    inner = memtree.load_memmap(tmp_path / "t", unknown_classes="tree")["w"]
    assert isinstance(inner, memtree.TensorTree) and torch.equal(inner["qdata"], scaled().qdata)
    assert imported == []  # a name read from a file is never imported


def test_a_context_naming_an_unregistered_class_is_refused(tmp_path):
    memtree.TensorTree({"w": scaled(cfg=Mode.SYMMETRIC)}).memmap(tmp_path / "t", checksum=None)
    path = tmp_path / "t" / "meta.json"
    doc = read_json(path)
    doc["entries"][0]["context"]["items"]["cfg"]["type"] = "subprocess.Popen"
    path.write_bytes(orjson.dumps(doc))
    with pytest.raises(memtree.SubclassError, match="subprocess.Popen"):
        memtree.load_memmap(tmp_path / "t")["w"]


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"shape": [7]}, r"rebuilt as a ScaledInt8 float32\[6\].*records a tests.ScaledInt8 float32\[7\]"),
        ({"dtype": "float16"}, "records a tests.ScaledInt8 float16"),
        ({"type": "tests.Wrapped"}, "could not be rebuilt"),
        ({"type": "tests.Mode"}, "names no tensor subclass"),
    ],
    ids=["shape", "dtype", "other-class", "not-a-tensor"],
)
def test_a_group_that_does_not_rebuild_as_recorded_is_refused(tmp_path, edit, message):
    memtree.TensorTree({"w": scaled()}).memmap(tmp_path / "t", checksum=None)
    _edit_entry(tmp_path / "t" / "meta.json", **edit)
    with pytest.raises(memtree.SubclassError, match=message):
        memtree.load_memmap(tmp_path / "t")["w"]


def test_loading_subclasses_never_runs_pickle(tmp_path, monkeypatch):
    model = torch.nn.Linear(6, 2)
    model.weight = torch.nn.Parameter(ScaledInt8(torch.ones(2, 6, dtype=torch.int8), 0.5), requires_grad=False)
    memtree.TensorTree.from_module(model).memmap(tmp_path / "t")
    memtree.Checkpointer(tmp_path / "ck").save(1, {"w": scaled()})

    def refuse(*args, **kwargs):
        raise AssertionError("pickle ran")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    assert same_subclass(memtree.load_memmap(tmp_path / "t")["weight"], model.weight.detach())
    target = torch.nn.Linear(6, 2)
    target.weight = torch.nn.Parameter(ScaledInt8(torch.zeros(2, 6, dtype=torch.int8), 0.5), requires_grad=False)
    memtree.load_into_module(target, tmp_path / "t")
    assert torch.equal(target.weight.qdata, torch.ones(2, 6, dtype=torch.int8))
    assert same_subclass(memtree.Checkpointer(tmp_path / "ck").restore()["w"], scaled())


# ---------------------------------------------------------------------------------------------
# the schema: hostile entries and groups


def _subclass_meta(**fields) -> bytes:
    entry = {"key": "w", "kind": "subclass", "dir": "w", "type": "tests.ScaledInt8", "dtype": "float32",
             "shape": [6], "stride": [1], "context": None, **fields}
    return orjson.dumps({"format": "memtree", "version": 3, "type": "TensorTree", "byteorder": "little",
                         "batch_size": [], "entries": [entry]})


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"type": "__main__.X"}, "registered class name"),
        ({"type": "a b"}, "registered class name"),
        ({"dtype": "object"}, "names no dtype"),
        ({"stride": [1, 1]}, "has 2 dims, the shape 1"),
        ({"shape": [-1]}, "must be an int"),
        ({"dir": "../x"}, "single safe directory name"),
        ({"context": {"kind": "eval", "code": "x"}}, "must be a tagged node"),
        ({"context": {"kind": "dtype", "name": "object"}}, "names no dtype"),
        ({"context": {"kind": "dtype", "name": "float32", "x": 1}}, "must be a tagged node"),
        ({"context": [{"kind": "enum", "type": "tests.Mode", "name": "a b"}]}, "must be an identifier"),
        ({"context": {"kind": "object", "type": "tests.Cfg", "fields": {"a-b": 1}}}, "identifier keys"),
        ({"context": {"kind": "device", "name": "cuda:0; rm"}}, "names no device"),
        ({"context": {"kind": "float", "value": "1e999"}}, "must be one of"),
        ({"context": {"kind": "size", "dims": [-1]}}, "dims must be"),
        ({"context": {"kind": "tuple", "items": {"a": 1}}}, "items must be an array"),
    ],
)
def test_hostile_subclass_entries_are_refused(fields, problem):
    with pytest.raises((memtree.MetaFormatError, memtree.UnsafePathError), match=problem):
        parse_level(_subclass_meta(**fields), "meta.json")


def test_a_subclass_entry_needs_version_3():
    doc = orjson.loads(_subclass_meta())
    with pytest.raises(memtree.MetaFormatError, match="only a version 3 tree has"):
        parse_level(orjson.dumps({**doc, "version": 2}), "meta.json")


def test_a_subclass_entry_round_trips_through_dump_and_parse():
    entry = SubclassMeta("w", "w", Subclass("tests.ScaledInt8", "qint8", (2, 3), (3, 1), [{"kind": "tuple", "items": []}]))
    layout = DTensorLayout((2, 2), (Placement("shard", 0), Placement("strided_shard", 1, 2)), ("dp", "tp"))
    meta = LevelMeta((2,), (entry, LeafMeta("x", "x.memmap", "float32", (2, 4), layout=layout)))
    assert parse_level(dump_level(meta), "meta.json") == meta


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda g: g.update(batch_size=[6]), "batch_size \\[\\] and type"),
        (lambda g: g.update(entries=[]), "lists no inner tensor"),
        (lambda g: g["entries"].append({"key": "v", "kind": "json", "value": 1}), "is not an inner tensor"),
        (lambda g: g["entries"][0].update(key="not an attribute"), "not an attribute name"),
        (lambda g: g["entries"][0].update(capacity=10), "is not an inner tensor"),
    ],
    ids=["batch", "empty", "json", "key", "growable"],
)
def test_a_group_breaking_its_rules_is_refused_by_load_and_by_verify(tmp_path, edit, problem):
    memtree.TensorTree({"w": scaled()}).memmap(tmp_path / "t", checksum=None)
    path = tmp_path / "t" / "w" / "meta.json"
    group = read_json(path)
    edit(group)
    path.write_bytes(orjson.dumps(group))
    with pytest.raises(memtree.MetaFormatError, match=problem):
        memtree.load_memmap(tmp_path / "t")["w"]
    report = memtree.verify_tree(tmp_path / "t")
    assert not report.ok and any("subclass group" in p.message for p in report.problems)


@pytest.mark.parametrize(
    "layout, problem",
    [
        ({"mesh": [], "placements": []}, "positive ints"),
        ({"mesh": [2], "placements": []}, "one placement per mesh dim"),
        ({"mesh": [2], "placements": [{"kind": "partial"}]}, "must be a placement"),
        ({"mesh": [2], "placements": [{"kind": "shard", "dim": 5}]}, "a dim of the tensor"),
        ({"mesh": [2], "placements": [{"kind": "shard"}]}, "must be a placement"),
        ({"mesh": [2], "placements": [{"kind": "replicate"}], "dim_names": ["a", "a"]}, "distinct identifiers"),
        ({"mesh": [2], "placements": [{"kind": "replicate"}], "x": 1}, "must be an object"),
    ],
)
def test_hostile_dtensor_annotations_are_refused(layout, problem):
    doc = {"format": "memtree", "version": 3, "type": "TensorTree", "byteorder": "little", "batch_size": [],
           "entries": [{"key": "x", "kind": "tensor", "file": "x.memmap", "dtype": "float32", "shape": [4], "dtensor": layout}]}
    with pytest.raises(memtree.MetaFormatError, match=problem):
        parse_level(orjson.dumps(doc), "meta.json")


def test_check_context_walks_deep_contexts_without_recursion():
    deep: object = 1
    for _ in range(5000):
        deep = {"kind": "tuple", "items": [deep]}
    assert check_context(deep, "context") is None


# ---------------------------------------------------------------------------------------------
# everywhere a tensor leaf works


def test_keys_selects_a_subclass_leaf_and_refuses_keys_inside_it(tmp_path):
    memtree.TensorTree({"a": {"w": scaled()}, "b": torch.ones(2)}).memmap(tmp_path / "t")
    part = memtree.load_memmap(tmp_path / "t", keys=[("a", "w")])
    assert list(part.keys(include_nested=True)) == ["a", ("a", "w")] and type(part["a", "w"]) is ScaledInt8
    with pytest.raises(memtree.MemtreeKeyError, match="tensor subclass leaf"):
        memtree.load_memmap(tmp_path / "t", keys=[("a", "w", "qdata")])


def test_verify_checks_the_inner_files_and_load_refuses_a_damaged_one(tmp_path):
    memtree.TensorTree({"w": scaled(), "x": torch.ones(3)}).memmap(tmp_path / "t")
    report = memtree.verify_tree(tmp_path / "t")
    assert report.ok and report.checksummed == report.leaves == 2 and report.tree_hash == "ok"
    inner = tmp_path / "t" / "w" / "qdata.memmap"
    data = bytearray(inner.read_bytes())
    data[0] ^= 1
    inner.write_bytes(bytes(data))
    assert not memtree.verify_tree(tmp_path / "t").ok
    with pytest.raises(memtree.IntegrityError, match="qdata"):
        memtree.load_memmap(tmp_path / "t", verify=True)["w"]


def test_the_tree_hash_covers_the_context(tmp_path):
    memtree.TensorTree({"w": scaled()}).memmap(tmp_path / "t")
    _edit_entry(tmp_path / "t" / "meta.json", context={"kind": "dict", "items": {"scale": 4.0, "cfg": None}})
    with pytest.raises(memtree.IntegrityError):
        memtree.load_memmap(tmp_path / "t", verify=True)


def test_info_shows_the_class_and_its_inner_tensors(tmp_path):
    from memtree.cli.info import describe, render_text

    memtree.TensorTree({"m": {"w": scaled()}}).memmap(tmp_path / "t")
    info = describe(str(tmp_path / "t"))
    assert info["version"] == 3  # the root is version 2: the tree needs a reader of version 3
    kinds = [(e["key"], e["kind"], e.get("type"), e.get("dtype")) for e in info["entries"]]
    assert kinds[1:] == [(["m", "w"], "subclass", "tests.ScaledInt8", "float32"), (["m", "w", "qdata"], "tensor", None, "int8")]
    text = render_text(info)
    assert "tests.ScaledInt8" in text and "1 inner tensor" in text and "qdata" in text


def test_diff_tells_a_changed_context_and_a_changed_inner_tensor(tmp_path):
    from memtree.cli.diff import diff_trees

    memtree.TensorTree({"w": scaled()}).memmap(tmp_path / "a")
    memtree.TensorTree({"w": scaled(scale=0.25)}).memmap(tmp_path / "b")
    memtree.TensorTree({"w": scaled(seed=3)}).memmap(tmp_path / "c")
    assert diff_trees(str(tmp_path / "a"), str(tmp_path / "a")).identical
    assert [(c["key"], c["what"]) for c in diff_trees(str(tmp_path / "a"), str(tmp_path / "b")).changed] == [(["w"], ["context"])]
    assert [(c["key"], c["what"]) for c in diff_trees(str(tmp_path / "a"), str(tmp_path / "c")).changed] == [(["w", "qdata"], ["data"])]


@pytest.mark.parametrize("names", [False, True], ids=["plain-names", "sealed-names"])
def test_encrypted_trees_keep_subclasses(tmp_path, names):
    pytest.importorskip("cryptography")
    key = memtree.EncryptionKey.generate()
    memtree.TensorTree({"a": {"w": scaled()}}).memmap(tmp_path / "t", encryption=key, encrypt_names=names)
    got = memtree.load_memmap(tmp_path / "t", encryption=key)["a", "w"]
    assert type(got) is ScaledInt8 and same_subclass(got, scaled())


def test_remote_trees_keep_subclasses(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    url = f"memory://memtree-tests/subclass-{os.getpid()}"
    try:
        memtree.remote.upload(memtree.TensorTree({"a": {"w": scaled()}}), url)
        for cache in ("none", str(tmp_path / "cache")):
            got = memtree.load_memmap(url, cache_dir=None if cache == "none" else cache)["a", "w"]
            assert type(got) is ScaledInt8 and same_subclass(got, scaled())
    finally:
        fsspec.filesystem("memory").rm(url, recursive=True)


def test_incremental_saves_link_unchanged_inner_files(tmp_path):
    from memtree.store.reading.options import WriteOptions

    tree = memtree.TensorTree({"w": scaled(), "x": torch.ones(4)})
    tree.memmap(tmp_path / "1")
    tree["x"] = torch.zeros(4)
    write_tree(tmp_path / "2", tree, WriteOptions.of(link_from=tmp_path / "1"))
    assert (tmp_path / "2" / "w" / "qdata.memmap").stat().st_ino == (tmp_path / "1" / "w" / "qdata.memmap").stat().st_ino
    assert same_subclass(memtree.load_memmap(tmp_path / "2")["w"], scaled())


def test_a_tree_holding_a_subclass_cannot_grow(tmp_path):
    tree = memtree.TensorTree({"w": ScaledInt8(torch.zeros(3, dtype=torch.int8), 1.0), "x": torch.zeros(3)}, batch_size=[3])
    grown = tree.memmap(tmp_path / "t")
    with pytest.raises(memtree.NotGrowableError, match="tensor subclass"):
        grown.extend_(memtree.TensorTree({"w": ScaledInt8(torch.zeros(1, dtype=torch.int8), 1.0), "x": torch.zeros(1)}, batch_size=[1]))


def test_tensordict_and_safetensors_exports_refuse_what_they_cannot_hold(tmp_path):
    tree = memtree.TensorTree({"m": {"w": scaled()}})
    with pytest.raises(memtree.SubclassError, match="tensordict's layout"):
        memtree.save_tensordict(tree, tmp_path / "td")
    with pytest.raises(memtree.SubclassError, match="torchao's safetensors convention cannot hold"):
        memtree.save_safetensors(tree, tmp_path / "x.safetensors")
    assert not (tmp_path / "td").exists() and not (tmp_path / "x.safetensors").exists()


def test_quantized_tensors_round_trip_per_tensor_and_per_channel(tmp_path):
    per_tensor = torch.quantize_per_tensor(torch.randn(4, 6), 0.1, 3, torch.quint8)
    per_channel = torch.quantize_per_channel(torch.randn(4, 6), torch.rand(4) + 0.1, torch.arange(4), 0, torch.qint8)
    packed = torch.quantize_per_tensor(torch.randn(4, 6), 0.2, 1, torch.quint4x2)
    memtree.TensorTree({"t": per_tensor, "c": per_channel, "p": packed}).memmap(tmp_path / "t")
    loaded = memtree.load_memmap(tmp_path / "t")
    for key, q in (("t", per_tensor), ("c", per_channel), ("p", packed)):
        got = loaded[key]
        assert got.dtype == q.dtype and got.qscheme() == q.qscheme() and torch.equal(got.dequantize(), q.dequantize())
    assert torch.equal(loaded["c"].q_per_channel_scales(), per_channel.q_per_channel_scales())


# ---------------------------------------------------------------------------------------------
# modules and checkpoints


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def _saved_module(path: Path) -> torch.nn.Module:
    """A ScaledInt8 module, saved at ``path``."""
    src = _module(0)
    memtree.TensorTree.from_module(src).memmap(path)
    return src


def _module(seed: int) -> torch.nn.Module:
    m = _mlp()
    for i, lin in ((0, m[0]), (2, m[2])):
        g = torch.Generator().manual_seed(seed * 10 + i)
        q = torch.randint(-128, 128, lin.weight.shape, dtype=torch.int8, generator=g)
        lin.weight = torch.nn.Parameter(ScaledInt8(q, 0.01 * (i + 1)), requires_grad=False)
    return m


def test_load_into_module_fills_a_subclass_module_in_place(tmp_path):
    src = _saved_module(tmp_path / "m")
    target = _module(1)
    weight, qdata = target[0].weight, target[0].weight.qdata
    assert memtree.load_into_module(target, tmp_path / "m") == memtree.LoadResult([], [])
    assert target[0].weight is weight and target[0].weight.qdata is qdata  # filled, not replaced
    x = torch.randn(3, 6)
    assert torch.equal(target(x), src(x))


def test_load_into_module_refuses_a_source_of_another_layout_and_changes_nothing(tmp_path):
    src = _module(0)
    src[0].weight = torch.nn.Parameter(ScaledInt8(src[0].weight.qdata, 9.0), requires_grad=False)
    memtree.TensorTree.from_module(src).memmap(tmp_path / "m")
    target = _module(1)
    before = [t.clone() for _, t in registry.inner_tensors(target[2].weight)]
    with pytest.raises(memtree.ShapeMismatchError, match="'0.weight'.*contexts differ"):
        memtree.load_into_module(target, tmp_path / "m")
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, registry.inner_tensors(target[2].weight)))
    memtree.TensorTree.from_module(_mlp()).memmap(tmp_path / "p")
    with pytest.raises(memtree.ShapeMismatchError, match="load into a module quantized the same way"):
        memtree.load_into_module(_module(1), tmp_path / "p")


def test_an_empty_init_module_gets_the_subclass_bound(tmp_path):
    src = _saved_module(tmp_path / "m")
    with memtree.empty_init():
        target = _mlp()
    memtree.load_into_module(target, tmp_path / "m")
    assert type(target[0].weight) is ScaledInt8 and isinstance(target[0].weight, torch.nn.Parameter)
    x = torch.randn(3, 6)
    assert torch.equal(target(x), src(x))
    bound = _module(2)
    memtree.load_memmap(tmp_path / "m").to_module(bound)
    assert torch.equal(bound(x), src(x))


def test_checkpointer_keeps_subclass_state_sync_and_async(tmp_path):
    state = {"opt": {"state": {0: {"exp_avg": scaled(), "step": torch.tensor(3.0)}}}, "w": Wrapped(scaled(seed=2), "t")}
    for out in saved_both_ways(tmp_path / "ck", state):
        assert same_subclass(out["opt"]["state"][0]["exp_avg"], scaled()) and type(out["w"]) is Wrapped
        assert out["w"].tag == "t" and same_subclass(out["w"], state["w"])


def test_offload_binds_a_subclass_over_its_files(tmp_path):
    src = _saved_module(tmp_path / "m")
    with memtree.empty_init():
        target = _mlp()
    memtree.offload(target, tmp_path / "m")
    assert type(target[0].weight) is ScaledInt8 and type(target[0].bias).__name__ == "OffloadedTensor"
    assert target[0].weight.qdata.filename == str(tmp_path / "m" / "0" / "weight" / "qdata.memmap")
    x = torch.randn(3, 6)
    assert torch.equal(target(x), src(x))


# ---------------------------------------------------------------------------------------------
# faults and fuzzing: a tree holding subclasses commits whole or not at all; hostile contexts
# only ever raise memtree's errors


def _write_with_fault(prefix: str, tree: memtree.TensorTree, fault: str) -> None:
    from memtree.store.primitives import faults

    os.environ[faults.ENV] = fault
    faults.reload()
    tree.memmap(prefix)


@pytest.mark.parametrize("fault", ["after_leaf:1", "after_leaf:2", "before_meta:1", "before_meta:2", "before_root_meta"])
def test_a_writer_killed_mid_way_leaves_the_old_tree_or_the_new_one(tmp_path, fault):
    import multiprocessing as mp

    old = memtree.TensorTree({"a": {"w": scaled(seed=1)}, "n": Wrapped(scaled(4, seed=2), "old"), "x": torch.ones(3)})
    new = memtree.TensorTree({"a": {"w": scaled(seed=3)}, "n": Wrapped(scaled(4, seed=4), "new"), "x": torch.zeros(3)})
    prefix = str(tmp_path / "t")
    old.memmap(prefix)
    p = mp.get_context("fork").Process(target=_write_with_fault, args=(prefix, new, fault))
    p.start()
    p.join(120)
    assert p.exitcode == 137
    loaded = memtree.load_memmap(prefix, verify=True)
    want = old if loaded["n"].tag == "old" else new
    assert same_subclass(loaded["a", "w"], want["a", "w"]) and same_subclass(loaded["n"], want["n"])
    assert torch.equal(loaded["x"], want["x"])


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8) | st.sampled_from(["tuple", "dict", "dtype", "size", "device", "float", "enum", "object",
                                             "kind", "items", "name", "type", "fields", "tests.Mode", "tests.Cfg",
                                             "float32", "qint8", "cpu", "nan", "SYMMETRIC"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["kind", "items", "name", "type", "fields", "dims", "value", "scale", "cfg", "x"]), inner, max_size=4
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(context=_JSON)
def test_any_context_on_disk_loads_or_raises_a_memtree_error(tmp_path, context):
    prefix = tmp_path / "t"
    if not prefix.exists():
        memtree.TensorTree({"w": scaled()}).memmap(prefix, checksum=None)
    _edit_entry(prefix / "meta.json", context=context)
    try:
        got = memtree.load_memmap(prefix)["w"]
    except memtree.MemtreeError:
        return
    assert type(got) is ScaledInt8
