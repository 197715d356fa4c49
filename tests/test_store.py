"""Writing and loading trees: memmap_/memmap/memmap_like/load_memmap, the files they produce,
key escaping, atomic commit and replacement, non-tensor values (SPEC §3-§5, API.md, format.md)."""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import resource
import shutil
import signal
import unicodedata
import zlib

import orjson
import pytest
import torch

import memtree
from memtree import MemoryMappedTensor, NonTensor, TensorTree
from memtree.store.primitives.checksums import default_checksum, tensor_checksum
from treeutil import flat, plain, random_tensor, raw_bytes, snapshot

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

FORMAT_DTYPE_NAMES = [
    "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
    "float16", "bfloat16", "float32", "float64", "complex32", "complex64", "complex128",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
]
DTYPE_NAMES = [n for n in FORMAT_DTYPE_NAMES if getattr(torch, n, None) is not None]

TOP_FIELDS = {"format", "version", "type", "byteorder", "batch_size", "entries", "save_id", "tree_hash"}
SAFE_NAME = re.compile(r"^[A-Za-z0-9_\-%~][A-Za-z0-9_.\-%~]*$")
STAGING = re.compile(r"memtree-(tmp|old)")


# ----------------------------------------------------------------------------- helpers


def assert_same_tree(a, b):
    fa, fb = flat(a), flat(b)
    assert set(fa) == set(fb)
    for k, va in fa.items():
        vb = fb[k]
        if isinstance(va, torch.Tensor):
            assert isinstance(vb, torch.Tensor), k
            assert va.dtype == vb.dtype, k
            assert va.shape == vb.shape, k
            assert raw_bytes(va) == raw_bytes(vb), k
        else:
            assert not isinstance(vb, torch.Tensor), k
            assert type(va) is type(vb), (k, va, vb)
            assert va == vb, k


def tensor_leaves(tree):
    return {k: v for k, v in flat(tree).items() if isinstance(v, torch.Tensor)}


def under(path, root) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def read_meta(d):
    with open(os.path.join(d, "meta.json"), "rb") as f:
        return json.loads(f.read())


def staging_leftovers(parent):
    return [n for n in os.listdir(parent) if STAGING.search(n)]


def sample_tree(seed=0, batch=4):
    g = torch.Generator().manual_seed(seed)
    t = TensorTree(
        {
            "obs": torch.randn(batch, 3, generator=g),
            "action": torch.randint(0, 10, (batch,), generator=g),
            "nested": {
                "x": torch.randn(batch, 2, 2, generator=g).to(torch.bfloat16),
                "deeper": {"mask": torch.rand(batch, generator=g) > 0.5},
            },
            "name": "hello",
        },
        batch_size=[batch],
    )
    return t


def all_dtypes_tree(batch=3):
    leaves = {name: random_tensor((batch, 2), getattr(torch, name), seed=i) for i, name in enumerate(DTYPE_NAMES)}
    return TensorTree(
        {
            "top": leaves,
            "nested": {"deeper": {n: random_tensor((batch, 0), getattr(torch, n), seed=1) for n in DTYPE_NAMES}},
            "scalar_like": random_tensor((batch,), torch.float64, seed=7),
        },
        batch_size=[batch],
    )


def parent_and_prefix(tmp_path, name="tree"):
    parent = tmp_path / "parent"
    parent.mkdir()
    return parent, parent / name


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("num_threads", [0, 4])
def test_round_trip_all_dtypes_nested(tmp_path, num_threads):
    tree = all_dtypes_tree()
    prefix = tmp_path / "t"
    out = tree.memmap(prefix, num_threads=num_threads)
    assert_same_tree(out, tree)
    back = memtree.load_memmap(prefix)
    assert back.batch_size == torch.Size([3])
    assert_same_tree(back, tree)
    back2 = TensorTree.load_memmap(str(prefix))
    assert_same_tree(back2, tree)


def test_round_trip_zero_dim_and_zero_element_leaves(tmp_path):
    tree = TensorTree(
        {n: random_tensor((), getattr(torch, n), seed=5) for n in DTYPE_NAMES}
        | {"empty": torch.empty(0), "empty2": torch.empty(2, 0, 3, dtype=torch.int16)}
    )
    assert tree.batch_size == torch.Size([])
    tree.memmap(tmp_path / "t")
    back = memtree.load_memmap(tmp_path / "t")
    assert_same_tree(back, tree)


@pytest.mark.parametrize("num_threads", [0, 4])
def test_memmap_in_place_converts_leaves_under_prefix(tmp_path, num_threads):
    tree = sample_tree()
    expected = {k: raw_bytes(v) for k, v in tensor_leaves(tree).items()}
    prefix = tmp_path / "t"
    ret = tree.memmap_(prefix, num_threads=num_threads)
    assert ret is tree
    assert tree.is_memmap()
    leaves = tensor_leaves(tree)
    assert set(leaves) == set(expected)
    for k, v in leaves.items():
        assert isinstance(v, MemoryMappedTensor), k
        assert v.filename is not None and v.filename.endswith(".memmap")
        assert under(v.filename, prefix), (k, v.filename)
        assert os.path.isfile(v.filename)
        assert raw_bytes(v) == expected[k]
    assert tree["name"] == "hello"


def test_memmap_in_place_writes_reach_files(tmp_path):
    tree = sample_tree()
    prefix = tmp_path / "t"
    tree.memmap_(prefix)
    tree["obs"][1] = 42.0
    tree[2] = 0  # fill every leaf at batch index 2
    back = memtree.load_memmap(prefix)
    assert torch.all(plain(back["obs"][1]) == 42.0)
    assert torch.all(plain(back["obs"][2]) == 0)
    assert torch.all(plain(back["nested", "x"][2]) == 0)


def test_index_assignment_of_tree_writes_through(tmp_path):
    tree = sample_tree(batch=6)
    tree.memmap_(tmp_path / "t")
    other = TensorTree(
        {
            "obs": torch.ones(2, 3),
            "action": torch.full((2,), 9),
            "nested": {"x": torch.ones(2, 2, 2, dtype=torch.bfloat16), "deeper": {"mask": torch.ones(2, dtype=torch.bool)}},
            "name": "hello",
        },
        batch_size=[2],
    )
    tree[3:5] = other
    back = memtree.load_memmap(tmp_path / "t")
    assert torch.equal(plain(back["obs"][3:5]), torch.ones(2, 3))
    assert torch.equal(plain(back["action"][3:5]), torch.full((2,), 9))


@pytest.mark.parametrize("num_threads", [0, 4])
def test_memmap_returns_new_tree_and_leaves_self_untouched(tmp_path, num_threads):
    tree = sample_tree()
    before = {k: (v, raw_bytes(v)) for k, v in tensor_leaves(tree).items()}
    prefix = tmp_path / "t"
    out = tree.memmap(prefix, num_threads=num_threads)
    assert out is not tree
    assert out.is_memmap()
    assert not tree.is_memmap()
    for k, v in tensor_leaves(tree).items():
        assert not isinstance(v, MemoryMappedTensor), k
        assert v.data_ptr() == before[k][0].data_ptr()
        assert raw_bytes(v) == before[k][1]
    for k, v in tensor_leaves(out).items():
        assert isinstance(v, MemoryMappedTensor)
        assert under(v.filename, prefix)
    # writing to the new tree does not change the old one
    out["obs"].fill_(7)
    assert raw_bytes(tree["obs"]) == before[("obs",)][1]


def test_loaded_leaves_are_memory_mapped_with_exact_filenames(tmp_path):
    tree = sample_tree()
    prefix = tmp_path / "t"
    tree.memmap(prefix)
    back = memtree.load_memmap(prefix)
    assert back.is_memmap()
    assert isinstance(back["obs"], MemoryMappedTensor)
    assert back["obs"].filename == str(prefix / "obs.memmap")
    assert back["nested", "x"].filename == str(prefix / "nested" / "x.memmap")
    assert back["nested"]["deeper"]["mask"].filename == str(prefix / "nested" / "deeper" / "mask.memmap")


def test_memmap_to_anonymous_memory_without_prefix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tree = sample_tree()
    expected = {k: raw_bytes(v) for k, v in tensor_leaves(tree).items()}
    tree.memmap_()
    assert tree.is_memmap()
    for k, v in tensor_leaves(tree).items():
        assert isinstance(v, MemoryMappedTensor)
        assert v.filename is None
        assert raw_bytes(v) == expected[k]
    assert os.listdir(tmp_path) == []
    # anonymous leaves are not "under another prefix": saving them needs no copy_existing
    tree.memmap(tmp_path / "t")
    assert_same_tree(memtree.load_memmap(tmp_path / "t"), tree)


def test_round_trip_keeps_insertion_order(tmp_path):
    keys = ["zeta", "alpha", "mid", "beta"]
    tree = TensorTree({k: torch.zeros(2) for k in keys}, batch_size=[2])
    tree["sub"] = TensorTree({"b": torch.zeros(2), "a": torch.zeros(2)}, batch_size=[2])
    tree.memmap(tmp_path / "t")
    back = memtree.load_memmap(tmp_path / "t")
    assert list(back.keys()) == keys + ["sub"]
    assert list(back["sub"].keys()) == ["b", "a"]
    assert [e["key"] for e in read_meta(tmp_path / "t")["entries"]] == keys + ["sub"]


@pytest.mark.parametrize("fsync", [False, True])
def test_round_trip_with_fsync_flag(tmp_path, fsync):
    tree = sample_tree()
    tree.memmap(tmp_path / "t", fsync=fsync)
    assert_same_tree(memtree.load_memmap(tmp_path / "t"), tree)


def test_prefix_as_str_and_path(tmp_path):
    tree = sample_tree()
    tree.memmap(str(tmp_path / "a"))
    tree.memmap(tmp_path / "b")
    assert_same_tree(memtree.load_memmap(str(tmp_path / "b")), memtree.load_memmap(tmp_path / "a"))


# ----------------------------------------------------------------------------- non-tensor leaves

NON_TENSORS = {
    "s": "héllo wörld \u2603 \U0001F600",
    "empty_s": "",
    "i": 2**63 - 1,
    "neg": -(2**63),
    "zero": 0,
    "f": 0.1,
    "f_int_valued": 1.0,
    "tiny": 5e-324,
    "big_f": 1.7976931348623157e308,
    "t": True,
    "fa": False,
    "n": None,
    "lst": [1, "a", None, [2.5, True], []],
}


def test_non_tensor_leaves_round_trip_with_types(tmp_path):
    tree = TensorTree({"x": torch.arange(3)} | dict(NON_TENSORS), batch_size=[3])
    tree["cfg"] = NonTensor({"lr": 0.1, "betas": [0.9, 0.999], "name": "adam", "nested": {"a": None}})
    tree["sub"] = TensorTree({"note": "in a sub-tree", "y": torch.zeros(3)}, batch_size=[3])
    tree.memmap(tmp_path / "t")
    back = memtree.load_memmap(tmp_path / "t")
    for k, v in NON_TENSORS.items():
        assert back[k] == v, k
        assert type(back[k]) is type(v), k
    assert back["cfg"] == {"lr": 0.1, "betas": [0.9, 0.999], "name": "adam", "nested": {"a": None}}
    assert back["sub", "note"] == "in a sub-tree"
    assert math.copysign(1.0, back["f"]) == 1.0


def test_non_tensor_leaves_are_json_entries(tmp_path):
    tree = TensorTree({"x": torch.zeros(2), "name": "hello", "n": 3}, batch_size=[2])
    tree["cfg"] = NonTensor({"lr": 0.1})
    tree.memmap(tmp_path / "t")
    entries = {e["key"]: e for e in read_meta(tmp_path / "t")["entries"]}
    assert entries["name"] == {"key": "name", "kind": "json", "value": "hello"}
    assert entries["n"] == {"key": "n", "kind": "json", "value": 3}
    assert entries["cfg"] == {"key": "cfg", "kind": "json", "value": {"lr": 0.1}}
    assert not any(f.endswith(".pickle") for f in os.listdir(tmp_path / "t"))


def test_memmap_in_place_keeps_non_tensors(tmp_path):
    tree = TensorTree({"x": torch.zeros(2), "name": "hello"}, batch_size=[2])
    tree["cfg"] = NonTensor({"lr": 0.1})
    tree.memmap_(tmp_path / "t")
    assert tree["name"] == "hello"
    assert tree["cfg"] == {"lr": 0.1}


BAD_JSON_VALUES = {
    "nan": float("nan"),
    "inf": float("inf"),
    "-inf": float("-inf"),
    "2**70": 2**70,
    "-2**70": -(2**70),
    "2**64": 2**64,
    "-2**63-1": -(2**63) - 1,
    "lone_surrogate": "\ud800",
    "lone_low_surrogate": "a\udfffb",
    "set": {1, 2},
    "object": object(),
    "bytes": b"abc",
    "nan_in_list": [1.0, float("nan")],
    "nan_in_tuple": (1.0, float("nan")),  # tuples are kept (format version 2), their contents checked
    "nontensor_nan": NonTensor({"lr": float("nan")}),
    "nontensor_int_key": NonTensor({1: "a"}),
    "nontensor_big_int": NonTensor({"a": [2**70]}),
    "nontensor_surrogate_key": NonTensor({"\udc80": 1}),
}


@pytest.mark.parametrize("name", list(BAD_JSON_VALUES), ids=list(BAD_JSON_VALUES))
def test_non_json_value_refused_before_anything_is_written(tmp_path, name):
    parent, prefix = parent_and_prefix(tmp_path)
    tree = TensorTree({"x": torch.zeros(2)}, batch_size=[2])
    tree["bad"] = BAD_JSON_VALUES[name]
    with pytest.raises(memtree.NonTensorValueError) as ei:
        tree.memmap(prefix)
    assert isinstance(ei.value, memtree.MemtreeError)
    assert "bad" in str(ei.value)
    assert os.listdir(parent) == []


def test_non_json_value_refused_by_memmap_in_place_and_tree_unchanged(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    tree = TensorTree({"x": torch.zeros(2)}, batch_size=[2])
    tree["bad"] = float("nan")
    with pytest.raises(memtree.NonTensorValueError):
        tree.memmap_(prefix)
    assert not isinstance(tree["x"], MemoryMappedTensor)
    assert os.listdir(parent) == []


def test_non_json_value_refused_does_not_touch_existing_tree(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    sample_tree().memmap(prefix)
    before = snapshot(prefix)
    tree = TensorTree({"x": torch.zeros(2)}, batch_size=[2])
    tree["bad"] = float("inf")
    with pytest.raises(memtree.NonTensorValueError):
        tree.memmap(prefix)
    assert snapshot(prefix) == before
    assert staging_leftovers(parent) == []


def test_allow_pickle_round_trip_needs_allow_pickle_on_load(tmp_path):
    tree = TensorTree({"x": torch.arange(2)}, batch_size=[2])
    tree["tup"] = (1, 2, float("inf"))
    tree["big"] = 2**70
    tree["nan"] = float("nan")
    tree["surrogate"] = "a\ud800b"
    tree["aset"] = {1, 2}
    prefix = tmp_path / "t"
    tree.memmap(prefix, allow_pickle=True)
    meta = read_meta(prefix)
    kinds = {e["key"]: e for e in meta["entries"]}
    for k in ["tup", "big", "nan", "surrogate", "aset"]:
        assert kinds[k]["kind"] == "pickle", k
        assert kinds[k]["file"].endswith(".pickle")
        assert os.path.isfile(prefix / kinds[k]["file"])
    with pytest.raises(memtree.PickleNotAllowedError) as ei:
        memtree.load_memmap(prefix, lazy=False)
    assert isinstance(ei.value, memtree.MemtreeError)
    with pytest.raises(memtree.PickleNotAllowedError):  # lazily: when the level is first used
        memtree.load_memmap(prefix)["x"]
    back = memtree.load_memmap(prefix, allow_pickle=True)
    assert back["tup"] == (1, 2, float("inf"))
    assert back["big"] == 2**70
    assert math.isnan(back["nan"])
    assert back["surrogate"] == "a\ud800b"
    assert back["aset"] == {1, 2}
    assert torch.equal(plain(back["x"]), torch.arange(2))


# ----------------------------------------------------------------------------- files on disk


def test_files_on_disk_follow_the_format(tmp_path):
    tree = TensorTree(
        {
            "obs": torch.randn(4, 3),
            "nested": {"x": torch.arange(4), "bf": torch.zeros(4, 5, dtype=torch.bfloat16)},
            "empty": torch.empty(4, 0),
            "name": "hello",
        },
        batch_size=[4],
    )
    prefix = tmp_path / "t"
    tree.memmap(prefix)
    root = read_meta(prefix)
    assert root["format"] == "memtree"
    assert root["version"] == 2 and type(root["version"]) is int
    assert root["type"] == "TensorTree"
    assert root["byteorder"] == "little"
    assert root["batch_size"] == [4]
    assert set(root) <= TOP_FIELDS
    entries = root["entries"]
    assert [e["key"] for e in entries] == ["obs", "nested", "empty", "name"]
    by_key = {e["key"]: e for e in entries}
    assert by_key["obs"]["kind"] == "tensor"
    assert by_key["obs"]["file"] == "obs.memmap"
    assert by_key["obs"]["dtype"] == "float32"
    assert by_key["obs"]["shape"] == [4, 3]
    assert by_key["nested"] == {"key": "nested", "kind": "tree", "dir": "nested"}
    assert by_key["empty"]["shape"] == [4, 0]
    assert by_key["name"] == {"key": "name", "kind": "json", "value": "hello"}
    assert os.path.getsize(prefix / "obs.memmap") == 4 * 3 * 4
    assert os.path.getsize(prefix / "empty.memmap") == 0
    assert (prefix / "empty.memmap").is_file()
    with open(prefix / "obs.memmap", "rb") as f:
        assert f.read() == raw_bytes(tree["obs"])
    sub = read_meta(prefix / "nested")
    assert sub["format"] == "memtree" and sub["version"] == 2
    assert sub["batch_size"] == [4]
    assert "save_id" not in sub
    assert set(sub) <= TOP_FIELDS
    sub_entries = {e["key"]: e for e in sub["entries"]}
    assert sub_entries["x"]["dtype"] == "int64" and sub_entries["x"]["shape"] == [4]
    assert sub_entries["bf"]["dtype"] == "bfloat16"
    assert os.path.getsize(prefix / "nested" / "x.memmap") == 4 * 8
    assert os.path.getsize(prefix / "nested" / "bf.memmap") == 4 * 5 * 2
    # nothing else on disk
    assert sorted(os.listdir(prefix)) == sorted(["meta.json", "obs.memmap", "nested", "empty.memmap"])
    assert sorted(os.listdir(prefix / "nested")) == sorted(["meta.json", "x.memmap", "bf.memmap"])


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_meta_records_each_dtype_by_torch_name(tmp_path, name):
    dtype = getattr(torch, name)
    tree = TensorTree({"v": random_tensor((2, 3), dtype)}, batch_size=[2])
    tree.memmap(tmp_path / "t")
    (entry,) = read_meta(tmp_path / "t")["entries"]
    assert entry["dtype"] == name
    assert entry["shape"] == [2, 3]
    with open(tmp_path / "t" / entry["file"], "rb") as f:
        assert f.read() == raw_bytes(tree["v"])


def _check_and_drop_checksums(meta, directory):
    for e in meta["entries"]:
        if "checksum" in e:
            algo, _, digest = e.pop("checksum").partition(":")
            with open(os.path.join(directory, e["file"]), "rb") as f:
                data = f.read()
            if algo == "crc32":
                assert int(digest, 16) == zlib.crc32(data)
            elif algo in ("xxh3", "crc32c"):
                assert f"{algo}:{digest}" == tensor_checksum(torch.frombuffer(bytearray(data), dtype=torch.uint8), algo)
            else:
                assert algo == "sha256"
                assert digest == hashlib.sha256(data).hexdigest()
    return meta


def test_golden_meta_json(tmp_path):
    tree = TensorTree(
        {
            "obs": torch.arange(12, dtype=torch.float32).reshape(4, 3),
            "nested": {"x": torch.arange(4, dtype=torch.int64)},
            "name": "hello",
        },
        batch_size=[4],
    )
    prefix = tmp_path / "t"
    tree.memmap(prefix)
    with open(prefix / "meta.json", "rb") as f:
        raw = f.read()
    assert raw == orjson.dumps(orjson.loads(raw))  # compact orjson output
    root = json.loads(raw)
    save_id = root.pop("save_id", None)
    assert save_id is None or isinstance(save_id, str)
    assert root.pop("tree_hash").startswith(default_checksum() + ":")
    _check_and_drop_checksums(root, prefix)
    assert root == {
        "format": "memtree",
        "version": 2,
        "type": "TensorTree",
        "byteorder": "little",
        "batch_size": [4],
        "entries": [
            {"key": "obs", "kind": "tensor", "file": "obs.memmap", "dtype": "float32", "shape": [4, 3]},
            {"key": "nested", "kind": "tree", "dir": "nested"},
            {"key": "name", "kind": "json", "value": "hello"},
        ],
    }
    nested = _check_and_drop_checksums(read_meta(prefix / "nested"), prefix / "nested")
    assert nested == {
        "format": "memtree",
        "version": 2,
        "type": "TensorTree",
        "byteorder": "little",
        "batch_size": [4],
        "entries": [{"key": "x", "kind": "tensor", "file": "x.memmap", "dtype": "int64", "shape": [4]}],
    }
    with open(prefix / "obs.memmap", "rb") as f:
        assert f.read() == torch.arange(12, dtype=torch.float32).numpy().tobytes()
    with open(prefix / "nested" / "x.memmap", "rb") as f:
        assert f.read() == torch.arange(4, dtype=torch.int64).numpy().tobytes()


def test_save_ids_differ_between_saves(tmp_path):
    tree = sample_tree()
    tree.memmap(tmp_path / "a")
    tree.memmap(tmp_path / "b")
    a, b = read_meta(tmp_path / "a").get("save_id"), read_meta(tmp_path / "b").get("save_id")
    if a is not None or b is not None:
        assert a != b


# ----------------------------------------------------------------------------- key escaping


def h16(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()[:16]


NFC_E = unicodedata.normalize("NFC", "é")
NFD_E = unicodedata.normalize("NFD", "é")
assert NFC_E != NFD_E

# key -> expected leaf file name (format.md, "Escaping keys into file names")
ESCAPED_LEAF_NAMES = {
    "plain_key-1.x": "plain_key-1.x.memmap",
    "a/b": "a%2Fb.memmap",
    "..": "%2E%2E.memmap",
    ".": "%2E.memmap",
    "../x": "%2E.%2Fx.memmap",
    ".hidden": "%2Ehidden.memmap",
    "trailing.": "trailing%2E.memmap",
    "a b": "a%20b.memmap",
    "a\\b": "a%5Cb.memmap",
    "C:x": "C%3Ax.memmap",
    "\x00": "%00.memmap",
    "tab\there": "tab%09here.memmap",
    "~": "%7E.memmap",
    "%41": "%2541.memmap",
    "CON": "%43ON.memmap",
    "nul": "%6Eul.memmap",
    "com1": "%63om1.memmap",
    "LPT9": "%4CPT9.memmap",
    "con.txt": "%63on.txt.memmap",
    NFC_E: "%C3%A9.memmap",
    NFD_E: "e%CC%81.memmap",
    "x": "x.memmap",
    "x.memmap": "x.memmap.memmap",
    "meta.json": "meta.json.memmap",
    "A": f"A~{h16('A')}.memmap",
    "a": f"a~{h16('a')}.memmap",
}
LONG_KEY = "k" * 300
LONG_UNICODE_KEY = "é" * 300
HOSTILE_SUBTREE_KEYS = ["meta.json", "META.JSON", "..", "/", "sub/dir", "d" * 300]


def _hostile_tree_simple():
    tree = TensorTree(batch_size=[2])
    for i, k in enumerate(ESCAPED_LEAF_NAMES):
        tree[k] = torch.full((2,), i, dtype=torch.int32)
    tree[LONG_KEY] = torch.full((2,), 1000, dtype=torch.int32)
    tree[LONG_UNICODE_KEY] = torch.full((2,), 1001, dtype=torch.int32)
    sub = TensorTree(batch_size=[2])
    for i, k in enumerate(HOSTILE_SUBTREE_KEYS):
        sub[k] = TensorTree({"..": torch.full((2,), 2000 + i, dtype=torch.int32), "v": "note"}, batch_size=[2])
    tree["subtrees"] = sub
    return tree


def _assert_all_names_safe(root):
    for dirpath, dirnames, filenames in os.walk(root):
        names = dirnames + filenames
        lowered = [n.lower() for n in names]
        assert len(set(lowered)) == len(lowered), (dirpath, names)
        for n in names:
            assert SAFE_NAME.match(n), (dirpath, n)
            assert len(n.encode()) <= 255, (dirpath, n)
            assert not os.path.islink(os.path.join(dirpath, n))


def test_hostile_keys_round_trip_and_stay_inside_prefix(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    tree = _hostile_tree_simple()
    tree.memmap(prefix)
    assert os.listdir(parent) == ["tree"]
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            if os.path.realpath(p) in (os.path.realpath(parent), os.path.realpath(prefix)):
                continue
            assert under(p, prefix), p
    _assert_all_names_safe(prefix)
    back = memtree.load_memmap(prefix)
    assert_same_tree(back, tree)
    for i, k in enumerate(ESCAPED_LEAF_NAMES):
        assert torch.equal(plain(back[k]), torch.full((2,), i, dtype=torch.int32)), repr(k)
    assert back[LONG_KEY][0].item() == 1000
    assert back[LONG_UNICODE_KEY][0].item() == 1001
    for i, k in enumerate(HOSTILE_SUBTREE_KEYS):
        assert back["subtrees", k, ".."][0].item() == 2000 + i
        assert back["subtrees", k, "v"] == "note"


def test_nfc_and_nfd_keys_are_distinct_siblings(tmp_path):
    tree = TensorTree({NFC_E: torch.zeros(1), NFD_E: torch.ones(1)}, batch_size=[1])
    tree.memmap(tmp_path / "t")
    back = memtree.load_memmap(tmp_path / "t")
    assert set(back.keys()) == {NFC_E, NFD_E}
    assert back[NFC_E].item() == 0 and back[NFD_E].item() == 1


def test_escaped_file_names_follow_format_doc(tmp_path):
    tree = _hostile_tree_simple()
    prefix = tmp_path / "t"
    tree.memmap(prefix)
    files = {e["key"]: e.get("file", e.get("dir")) for e in read_meta(prefix)["entries"]}
    for key, expected in ESCAPED_LEAF_NAMES.items():
        got = files[key]
        if "~" in expected:  # hash digits: case of the hex is not pinned by format.md
            assert got.lower() == expected.lower() and got[0] == expected[0], (key, got)
        else:
            assert got == expected, (key, got)
    for key in (LONG_KEY, LONG_UNICODE_KEY):
        got = files[key]
        assert len(got.encode()) <= 255
        assert got.endswith(".memmap")
        assert h16(key) in got.lower()
    sub_dirs = {e["key"]: e["dir"] for e in read_meta(prefix / files["subtrees"])["entries"]}
    assert sub_dirs["meta.json"].lower() == f"meta.json~{h16('meta.json')}"
    assert sub_dirs["META.JSON"].lower() == f"meta.json~{h16('META.JSON')}"
    assert sub_dirs[".."] == "%2E%2E"
    assert sub_dirs["/"] == "%2F"
    assert sub_dirs["sub/dir"] == "sub%2Fdir"
    assert len(sub_dirs["d" * 300].encode()) <= 255
    assert h16("d" * 300) in sub_dirs["d" * 300].lower()


def test_leaf_and_subtree_whose_names_collide_on_disk(tmp_path):
    # leaf "x" -> x.memmap ; sub-tree "x.memmap" -> dir x.memmap : same name, so both get hashed.
    tree = TensorTree({"x": torch.zeros(2)}, batch_size=[2])
    tree["x.memmap"] = TensorTree({"y": torch.ones(2)}, batch_size=[2])
    tree.memmap(tmp_path / "t")
    _assert_all_names_safe(tmp_path / "t")
    back = memtree.load_memmap(tmp_path / "t")
    assert torch.equal(plain(back["x"]), torch.zeros(2))
    assert torch.equal(plain(back["x.memmap", "y"]), torch.ones(2))


def test_case_only_sibling_keys_round_trip(tmp_path):
    tree = TensorTree({"A": torch.zeros(2), "a": torch.ones(2), "Ab": torch.full((2,), 2.0), "aB": torch.full((2,), 3.0)}, batch_size=[2])
    tree.memmap(tmp_path / "t")
    _assert_all_names_safe(tmp_path / "t")
    back = memtree.load_memmap(tmp_path / "t")
    assert_same_tree(back, tree)


# ----------------------------------------------------------------------------- memmap_like


def test_memmap_like_gives_zeros_with_same_structure(tmp_path):
    tree = sample_tree()
    tree["cfg"] = NonTensor({"lr": 0.1})
    before = {k: raw_bytes(v) for k, v in tensor_leaves(tree).items()}
    prefix = tmp_path / "t"
    like = tree.memmap_like(prefix)
    assert like.batch_size == tree.batch_size
    assert like.is_memmap()
    fl, ft = flat(like), flat(tree)
    assert set(fl) == set(ft)
    for k, v in ft.items():
        if isinstance(v, torch.Tensor):
            assert isinstance(fl[k], MemoryMappedTensor)
            assert fl[k].shape == v.shape and fl[k].dtype == v.dtype
            assert under(fl[k].filename, prefix)
            assert raw_bytes(fl[k]) == raw_bytes(torch.zeros_like(v))
        else:
            assert fl[k] == v
    assert like["name"] == "hello"
    assert like["cfg"] == {"lr": 0.1}
    # the source is untouched
    assert {k: raw_bytes(v) for k, v in tensor_leaves(tree).items()} == before
    # and the result is a loadable tree
    back = memtree.load_memmap(prefix)
    assert_same_tree(back, like)


@pytest.mark.parametrize("num_threads", [0, 4])
def test_memmap_like_leaves_are_writable_through_to_disk(tmp_path, num_threads):
    tree = sample_tree()
    like = tree.memmap_like(tmp_path / "t", num_threads=num_threads)
    like["obs"][0] = 3.0
    back = memtree.load_memmap(tmp_path / "t")
    assert torch.all(plain(back["obs"][0]) == 3.0)


@pytest.mark.timeout(120)
def test_memmap_like_of_expanded_million_images_is_sparse(tmp_path):
    n = 1_000_000
    need = n * 3 * 64 * 64 + n * 8
    if shutil.disk_usage(tmp_path).free < need + (1 << 30):
        pytest.skip("filesystem too small to hold the full size up front")
    obs = torch.zeros(1, 3, 64, 64, dtype=torch.uint8).expand(n, 3, 64, 64)
    label = torch.zeros(1, dtype=torch.int64).expand(n)
    tree = TensorTree({"obs": obs, "meta": {"label": label}, "name": "images"}, batch_size=[n])
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    prefix = tmp_path / "big"
    like = tree.memmap_like(prefix)
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert (rss_after - rss_before) * 1024 < 1 << 30  # nothing of the 12 GB was materialised
    assert like.batch_size == torch.Size([n])
    assert like["obs"].shape == (n, 3, 64, 64) and like["obs"].dtype == torch.uint8
    assert like["meta", "label"].shape == (n,)
    assert like["name"] == "images"
    f = like["obs"].filename
    st = os.stat(f)
    assert st.st_size == n * 3 * 64 * 64
    assert st.st_blocks * 512 < 16 << 20  # sparse
    st2 = os.stat(like["meta", "label"].filename)
    assert st2.st_size == n * 8
    assert st2.st_blocks * 512 < 16 << 20
    assert int(plain(like["obs"][n - 1]).sum()) == 0
    like["obs"][123] = 7
    assert int(plain(memtree.load_memmap(prefix)["obs"][123]).sum()) == 7 * 3 * 64 * 64


def test_memmap_like_refuses_impossible_size_before_creating_anything(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    huge = torch.zeros(1, dtype=torch.uint8).expand(10**13)
    tree = TensorTree({"huge": huge, "small": torch.zeros(10**13, 0)}, batch_size=[10**13])
    with pytest.raises(memtree.InsufficientSpaceError) as ei:
        tree.memmap_like(prefix)
    assert isinstance(ei.value, OSError)
    assert isinstance(ei.value, memtree.MemtreeError)
    assert os.listdir(parent) == []


def test_memmap_like_impossible_size_does_not_touch_existing_tree(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    sample_tree().memmap(prefix)
    before = snapshot(prefix)
    huge = TensorTree({"huge": torch.zeros(1, dtype=torch.uint8).expand(10**13)}, batch_size=[10**13])
    with pytest.raises(memtree.InsufficientSpaceError):
        huge.memmap_like(prefix)
    assert snapshot(prefix) == before
    assert os.listdir(parent) == ["tree"]


# ----------------------------------------------------------------------------- partial loading


def _partial_tree(prefix):
    tree = TensorTree(
        {
            "a": torch.arange(3.0),
            "b": {"c": torch.arange(3) * 2, "e": torch.ones(3)},
            "d": torch.zeros(3, 2),
            "z": {"w": torch.ones(3), "zz": {"q": torch.zeros(3)}},
            "note": "kept?",
        },
        batch_size=[3],
    )
    tree.memmap(prefix)
    return tree


def test_partial_load_only_selected_leaves(tmp_path):
    prefix = tmp_path / "t"
    _partial_tree(prefix)
    back = memtree.load_memmap(prefix, keys=["a", ("b", "c")])
    keys = set(flat(back))
    assert ("a",) in keys and ("b", "c") in keys
    assert ("d",) not in keys and ("b", "e") not in keys
    assert not any(k[0] == "z" for k in keys)
    assert torch.equal(plain(back["a"]), torch.arange(3.0))
    assert torch.equal(plain(back["b", "c"]), torch.arange(3) * 2)
    assert isinstance(back["a"], MemoryMappedTensor)


def test_partial_load_ignores_damage_outside_selection(tmp_path):
    prefix = tmp_path / "t"
    _partial_tree(prefix)
    with open(prefix / "z" / "meta.json", "wb") as f:
        f.write(b"{ this is not json")
    os.remove(prefix / "d.memmap")
    os.remove(prefix / "b" / "e.memmap")
    back = memtree.load_memmap(prefix, keys=["a", ("b", "c")])
    assert torch.equal(plain(back["b", "c"]), torch.arange(3) * 2)
    # the full load does notice
    with pytest.raises(memtree.MemtreeError):
        memtree.load_memmap(prefix, lazy=False)


def test_partial_load_never_opens_unrelated_meta(tmp_path):
    prefix = tmp_path / "t"
    _partial_tree(prefix)
    # replace z/meta.json with a FIFO: opening it would block the load
    os.remove(prefix / "z" / "zz" / "meta.json")
    os.mkfifo(prefix / "z" / "zz" / "meta.json")
    back = memtree.load_memmap(prefix, keys=[("b", "c")])
    assert torch.equal(plain(back["b", "c"]), torch.arange(3) * 2)


def test_partial_load_of_subtree_key(tmp_path):
    prefix = tmp_path / "t"
    _partial_tree(prefix)
    back = memtree.load_memmap(prefix, keys=["z"])
    assert set(flat(back)) == {("z", "w"), ("z", "zz", "q")}


def test_partial_load_missing_key_raises_key_error(tmp_path):
    prefix = tmp_path / "t"
    _partial_tree(prefix)
    with pytest.raises(memtree.MemtreeKeyError) as ei:
        memtree.load_memmap(prefix, keys=["a", ("b", "nope")])
    assert isinstance(ei.value, KeyError)
    with pytest.raises(memtree.MemtreeKeyError):
        memtree.load_memmap(prefix, keys=["nope"])


# ----------------------------------------------------------------------------- load options


def test_load_read_only_refuses_writes_and_files_unchanged(tmp_path):
    prefix = tmp_path / "t"
    tree = sample_tree()
    tree.memmap(prefix)
    before = snapshot(prefix)
    back = memtree.load_memmap(prefix, mode="r")
    assert_same_tree(back, tree)
    writes = [
        lambda: back["obs"].add_(1),
        lambda: back["obs"].__setitem__(0, 1.0),
        lambda: back["nested", "x"].fill_(0),
        lambda: back["obs"][1:3].zero_(),
        lambda: back.__setitem__(0, 0),
        lambda: back.__setitem__(slice(0, 2), tree[2:4]),
    ]
    for w in writes:
        with pytest.raises(memtree.ReadOnlyError):
            w()
    assert snapshot(prefix) == before
    assert float(back["obs"].sum()) == float(tree["obs"].sum())


def test_load_without_mmap_gives_plain_tensors(tmp_path):
    prefix = tmp_path / "t"
    tree = sample_tree()
    tree.memmap(prefix)
    before = snapshot(prefix)
    back = memtree.load_memmap(prefix, mmap=False)
    assert_same_tree(back, tree)
    for k, v in tensor_leaves(back).items():
        assert type(v) is torch.Tensor, k
    assert not back.is_memmap()
    back["obs"].fill_(123.0)  # ordinary memory: the file does not change
    assert snapshot(prefix) == before


def test_load_device_meta_opens_no_leaf_file(tmp_path):
    prefix = tmp_path / "t"
    tree = sample_tree()
    tree.memmap(prefix)
    for dirpath, _, filenames in os.walk(prefix):
        for f in filenames:
            if f.endswith(".memmap"):
                os.remove(os.path.join(dirpath, f))
    back = memtree.load_memmap(prefix, device="meta")
    ft, fb = tensor_leaves(tree), tensor_leaves(back)
    assert set(ft) == set(fb)
    for k, v in ft.items():
        assert fb[k].device.type == "meta", k
        assert fb[k].shape == v.shape and fb[k].dtype == v.dtype
    assert back["name"] == "hello"
    assert back.batch_size == tree.batch_size


def test_load_device_cpu(tmp_path):
    prefix = tmp_path / "t"
    tree = sample_tree()
    tree.memmap(prefix)
    back = memtree.load_memmap(prefix, device="cpu")
    assert_same_tree(back, tree)
    assert back.is_memmap()
    for v in tensor_leaves(back).values():
        assert v.device.type == "cpu"


def test_class_and_function_load_agree(tmp_path):
    prefix = tmp_path / "t"
    sample_tree().memmap(prefix)
    assert_same_tree(TensorTree.load_memmap(prefix), memtree.load_memmap(prefix))


def test_load_then_resave_round_trip(tmp_path):
    tree = sample_tree()
    tree.memmap(tmp_path / "a")
    memtree.load_memmap(tmp_path / "a").memmap(tmp_path / "b", copy_existing=True)
    assert_same_tree(memtree.load_memmap(tmp_path / "b"), tree)


# ----------------------------------------------------------------------------- copy_existing


def test_memmap_of_leaves_under_another_prefix_needs_copy_existing(tmp_path):
    parent, p2 = parent_and_prefix(tmp_path, "second")
    tree = sample_tree()
    tree.memmap_(tmp_path / "first")
    first_before = snapshot(tmp_path / "first")
    with pytest.raises(memtree.ExistingMemmapError) as ei:
        tree.memmap(p2)
    assert isinstance(ei.value, memtree.MemtreeError)
    assert os.listdir(parent) == []
    with pytest.raises(memtree.ExistingMemmapError):
        memtree.load_memmap(tmp_path / "first").memmap(p2)
    assert os.listdir(parent) == []
    assert snapshot(tmp_path / "first") == first_before


def test_copy_existing_true_copies_leaves(tmp_path):
    tree = sample_tree()
    tree.memmap_(tmp_path / "first")
    first_before = snapshot(tmp_path / "first")
    out = tree.memmap(tmp_path / "second", copy_existing=True)
    for v in tensor_leaves(out).values():
        assert under(v.filename, tmp_path / "second")
    assert_same_tree(memtree.load_memmap(tmp_path / "second"), tree)
    out["obs"].fill_(-1)  # independent copy
    assert snapshot(tmp_path / "first") == first_before


def test_memmap_in_place_copy_existing_moves_leaves(tmp_path):
    tree = sample_tree()
    tree.memmap_(tmp_path / "first")
    with pytest.raises(memtree.ExistingMemmapError):
        tree.memmap_(tmp_path / "second")
    tree.memmap_(tmp_path / "second", copy_existing=True)
    for v in tensor_leaves(tree).values():
        assert under(v.filename, tmp_path / "second")


# ----------------------------------------------------------------------------- destinations


def test_existsok_false_on_existing_tree_refuses_and_keeps_old(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    sample_tree(seed=1).memmap(prefix)
    before = snapshot(prefix)
    with pytest.raises(memtree.DestinationExistsError) as ei:
        sample_tree(seed=2).memmap(prefix, existsok=False)
    assert isinstance(ei.value, FileExistsError)
    assert snapshot(prefix) == before
    assert os.listdir(parent) == ["tree"]
    with pytest.raises(memtree.DestinationExistsError):
        sample_tree(seed=2).memmap_like(prefix, existsok=False)
    with pytest.raises(memtree.DestinationExistsError):
        sample_tree(seed=2).memmap_(prefix, existsok=False)
    assert snapshot(prefix) == before
    assert_same_tree(memtree.load_memmap(prefix), sample_tree(seed=1))


def test_existsok_false_on_new_destination_works(tmp_path):
    tree = sample_tree()
    tree.memmap(tmp_path / "t", existsok=False)
    assert_same_tree(memtree.load_memmap(tmp_path / "t"), tree)


@pytest.mark.parametrize("num_threads", [0, 4])
def test_resave_replaces_tree_and_old_mappings_keep_old_values(tmp_path, num_threads):
    parent, prefix = parent_and_prefix(tmp_path)
    old_tree, new_tree = sample_tree(seed=1), sample_tree(seed=2)
    old_tree["only_old"] = torch.ones(4)
    new_tree["only_new"] = torch.zeros(4, 2)
    old_tree.memmap(prefix)
    old_loaded = memtree.load_memmap(prefix)
    old_obs = old_loaded["obs"]
    old_bytes = raw_bytes(old_obs)
    new_tree.memmap(prefix, existsok=True, num_threads=num_threads)
    back = memtree.load_memmap(prefix)
    assert_same_tree(back, new_tree)
    assert "only_old" not in back.keys()
    assert not os.path.exists(prefix / "only_old.memmap")
    assert raw_bytes(old_obs) == old_bytes  # the old inode is still mapped
    assert raw_bytes(old_loaded["nested", "x"]) == raw_bytes(old_tree["nested", "x"])
    assert os.listdir(parent) == ["tree"]


def test_resave_in_place_default_existsok(tmp_path):
    prefix = tmp_path / "t"
    sample_tree(seed=1).memmap(prefix)
    t2 = sample_tree(seed=3)
    t2.memmap_(prefix)
    assert_same_tree(memtree.load_memmap(prefix), t2)


@pytest.mark.parametrize("existsok", [True, False])
@pytest.mark.parametrize("method", ["memmap", "memmap_", "memmap_like"])
def test_refuses_to_replace_non_empty_non_memtree_dir(tmp_path, existsok, method):
    parent, prefix = parent_and_prefix(tmp_path)
    prefix.mkdir()
    (prefix / "important.txt").write_text("do not delete")
    (prefix / "sub").mkdir()
    (prefix / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = snapshot(prefix)
    tree = sample_tree()
    with pytest.raises(memtree.DestinationExistsError):
        getattr(tree, method)(prefix, existsok=existsok)
    assert snapshot(prefix) == before
    assert os.listdir(parent) == ["tree"]
    assert not tree.is_memmap()


def test_refuses_to_replace_a_regular_file(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    prefix.write_bytes(b"a file")
    with pytest.raises(memtree.DestinationExistsError):
        sample_tree().memmap(prefix)
    assert prefix.read_bytes() == b"a file"
    assert os.listdir(parent) == ["tree"]


def test_writes_into_existing_empty_dir(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    prefix.mkdir()
    tree = sample_tree()
    tree.memmap(prefix, existsok=True)
    assert_same_tree(memtree.load_memmap(prefix), tree)
    assert os.listdir(parent) == ["tree"]


def test_no_staging_dir_left_after_success(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    sample_tree().memmap(prefix)
    sample_tree(seed=4).memmap(prefix)
    sample_tree().memmap_like(prefix)
    assert os.listdir(parent) == ["tree"]


def test_creates_missing_parent_dirs_or_refuses_cleanly(tmp_path):
    prefix = tmp_path / "a" / "b" / "c"
    tree = sample_tree()
    try:
        tree.memmap(prefix)
    except memtree.MemtreeError:
        assert not os.path.exists(tmp_path / "a" / "b" / "c")
        return
    assert_same_tree(memtree.load_memmap(prefix), tree)


# ----------------------------------------------------------------------------- writer failures


class _FileSizeLimit:
    """Make any write past `limit` bytes of a file fail with EFBIG (RLIMIT_FSIZE), in-process."""

    def __init__(self, limit):
        self.limit = limit

    def __enter__(self):
        self.old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.limit, self.old[1]))
        return self

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
        signal.signal(signal.SIGXFSZ, self.old_handler)
        return False


def _tree_with_one_big_leaf():
    t = TensorTree(
        {
            "small": torch.arange(4.0),
            "nested": {"big": torch.ones(4, 8 << 20, dtype=torch.uint8), "other": torch.zeros(4)},
            "after": torch.ones(4, 3),
        },
        batch_size=[4],
    )
    for i in range(8):
        t[f"extra{i}"] = torch.full((4,), float(i))
    return t


@pytest.mark.parametrize("num_threads", [0, 4])
def test_writer_error_reaches_caller_and_new_destination_absent(tmp_path, num_threads):
    parent, prefix = parent_and_prefix(tmp_path)
    tree = _tree_with_one_big_leaf()
    with _FileSizeLimit(4 << 20):
        with pytest.raises(OSError) as ei:
            tree.memmap(prefix, num_threads=num_threads)
    assert ei.value.errno in (errno.EFBIG, errno.ENOSPC, None) or isinstance(ei.value, memtree.MemtreeError)
    assert os.listdir(parent) == []
    assert not tree.is_memmap()


@pytest.mark.parametrize("num_threads", [0, 4])
def test_writer_error_leaves_existing_tree_unchanged(tmp_path, num_threads):
    parent, prefix = parent_and_prefix(tmp_path)
    old = sample_tree(seed=9)
    old.memmap(prefix)
    before = snapshot(prefix)
    with _FileSizeLimit(4 << 20):
        with pytest.raises(OSError):
            _tree_with_one_big_leaf().memmap(prefix, num_threads=num_threads)
    assert snapshot(prefix) == before
    assert os.listdir(parent) == ["tree"]
    assert_same_tree(memtree.load_memmap(prefix), old)


@pytest.mark.parametrize("num_threads", [0, 4])
def test_writer_error_in_memmap_in_place_keeps_tree_in_memory(tmp_path, num_threads):
    parent, prefix = parent_and_prefix(tmp_path)
    tree = _tree_with_one_big_leaf()
    with _FileSizeLimit(4 << 20):
        with pytest.raises(OSError):
            tree.memmap_(prefix, num_threads=num_threads)
    assert os.listdir(parent) == []
    assert not isinstance(tree["small"], MemoryMappedTensor)
    assert torch.equal(plain(tree["small"]), torch.arange(4.0))


def test_write_after_failure_succeeds(tmp_path):
    parent, prefix = parent_and_prefix(tmp_path)
    tree = _tree_with_one_big_leaf()
    with _FileSizeLimit(4 << 20):
        with pytest.raises(OSError):
            tree.memmap(prefix, num_threads=4)
    tree.memmap(prefix, num_threads=4)
    assert_same_tree(memtree.load_memmap(prefix), tree)
    assert os.listdir(parent) == ["tree"]


class _Opaque(torch.Tensor):  # a subclass without __tensor_flatten__: memtree cannot keep its type
    pass


def test_unstorable_subclass_refused_before_anything_is_written(tmp_path):
    # a quantized tensor is stored now (tests/test_subclass_format.py); a tensor subclass
    # without the flatten protocol is the leaf memtree refuses rather than demote
    parent, prefix = parent_and_prefix(tmp_path)
    tree = TensorTree({"ok": torch.zeros(2)}, batch_size=[2])
    tree["q"] = torch.randn(2, 3).as_subclass(_Opaque)
    with pytest.raises(memtree.SubclassError, match="_Opaque"):
        tree.memmap(prefix)
    assert os.listdir(parent) == []


def test_device_meta_never_opens_a_pickled_leaf(tmp_path):
    d = tmp_path / "t"
    memtree.TensorTree({"w": torch.ones(2), "o": memtree.NonTensor({1, 2})}).memmap(d, allow_pickle=True)
    pickled = [p for p in d.iterdir() if p.suffix == ".pickle"]
    assert len(pickled) == 1
    pickled[0].write_bytes(b"not a pickle at all")  # would fail if it were opened and unpickled
    loaded = memtree.load_memmap(d, device="meta")
    assert loaded["w"].device.type == "meta"
    assert "not loaded" in repr(loaded["o"])
