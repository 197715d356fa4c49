"""Loading never trusts the files: hostile or damaged directories give the documented memtree
error, change nothing on disk, and never crash, hang or SIGBUS (SPEC §5, format.md "Loading
rules", RELIABILITY §7 rows 1-19, 24, 25, 27). ``memtree.verify_tree`` agrees with every one:
what the load refuses, verify reports (but for the loader's policies: pickles, unregistered
classes), what it loads, verify passes.

The trees here are written by hand from docs/format.md, so these tests exercise the loader alone.
The hypothesis fuzzer of the loader (random damage, every load in a child process) is
test_fuzz_load.py.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import zlib
from pathlib import Path

import orjson
import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

import memtree
from memtree.format.schema import parse_level
from memtree.format.values import json_problem
from treeutil import plain, snapshot

LOAD_VARIANTS = [{}, {"mode": "r"}, {"mmap": False}]
LOAD_IDS = ["default", "mode_r", "no_mmap"]

A_BYTES = torch.arange(6, dtype=torch.float32).numpy().tobytes()  # leaf "a": float32 [2, 3]
A_CRC = f"crc32:{zlib.crc32(A_BYTES):08x}"
DTENSOR = {"mesh": [2], "placements": [{"kind": "shard", "dim": 0}]}  # a DTensor leaf's annotation
CHUNKS = {"algorithm": "crc32", "chunk_bytes": 65536, "digests": A_CRC[6:]}  # a's 24 bytes: one chunk
C_BYTES = torch.tensor([7, -8], dtype=torch.int64).numpy().tobytes()  # leaf "b/c": int64 [2]


def root_meta() -> dict:
    return {
        "format": "memtree",
        "version": 1,
        "type": "TensorTree",
        "byteorder": "little",
        "batch_size": [2],
        "entries": [
            {"key": "a", "kind": "tensor", "file": "a.memmap", "dtype": "float32", "shape": [2, 3]},
            {"key": "b", "kind": "tree", "dir": "b"},
            {"key": "s", "kind": "json", "value": "hello"},
        ],
    }


def child_meta() -> dict:
    return {
        "format": "memtree",
        "version": 1,
        "type": "TensorTree",
        "byteorder": "little",
        "batch_size": [2],
        "entries": [
            {"key": "c", "kind": "tensor", "file": "c.memmap", "dtype": "int64", "shape": [2]},
            {"key": "e", "kind": "tensor", "file": "e.memmap", "dtype": "float32", "shape": [2, 0]},
        ],
    }


def dump(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def write_tree(prefix: Path, root: dict | None = None, child: dict | None = None) -> Path:
    """A valid tree written by hand, exactly as docs/format.md describes it."""
    prefix.mkdir(parents=True)
    (prefix / "meta.json").write_bytes(dump(root_meta() if root is None else root))
    (prefix / "a.memmap").write_bytes(A_BYTES)
    (prefix / "b").mkdir()
    (prefix / "b" / "meta.json").write_bytes(dump(child_meta() if child is None else child))
    (prefix / "b" / "c.memmap").write_bytes(C_BYTES)
    (prefix / "b" / "e.memmap").write_bytes(b"")
    return prefix


@pytest.fixture
def tree_dir(tmp_path) -> Path:
    return write_tree(tmp_path / "tree")


def expect_error(prefix, exc, root=None, **kw):
    """Loading raises exc (a MemtreeError) and nothing on disk changes.

    Both ways: ``load_memmap(prefix, lazy=False, **kw)`` raises it, and so does a lazily opened
    tree, at the latest when every level is loaded (``keys(include_nested=True)``).
    """
    root = root if root is not None else Path(prefix).parent
    before = snapshot(root)
    errors = []
    for lazy in (False, True):
        with pytest.raises(exc) as ei:
            memtree.load_memmap(prefix, lazy=lazy, **kw).keys(include_nested=True)
        assert isinstance(ei.value, memtree.MemtreeError), type(ei.value)
        errors.append(ei.value)
    assert str(errors[0]) == str(errors[1])
    if not isinstance(errors[0], LOAD_POLICIES):
        assert not memtree.verify_tree(prefix).ok, f"verify passes what the load refuses: {errors[0]}"
    assert snapshot(root) == before
    return errors[0]


#: Refusals that are the loader's policy, not damage: ``verify_tree`` passes such trees (a pickle
#: loads with ``allow_pickle=True``, a ``@tensorclass`` once its module is imported).
LOAD_POLICIES = (memtree.PickleNotAllowedError, memtree.UnknownClassError)


def set_root(prefix: Path, meta) -> None:
    (prefix / "meta.json").write_bytes(meta if isinstance(meta, bytes) else dump(meta))


def set_child(prefix: Path, meta) -> None:
    (prefix / "b" / "meta.json").write_bytes(meta if isinstance(meta, bytes) else dump(meta))


# ----------------------------------------------------------------------------- the valid baseline


@pytest.mark.parametrize("kw", LOAD_VARIANTS, ids=LOAD_IDS)
def test_hand_written_tree_loads(tree_dir, kw):
    before = snapshot(tree_dir)
    t = memtree.load_memmap(tree_dir, **kw)
    assert torch.equal(plain(t["a"]), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert torch.equal(plain(t["b", "c"]), torch.tensor([7, -8]))
    assert t["b", "e"].shape == (2, 0)
    assert t["s"] == "hello"
    assert t.batch_size == torch.Size([2])
    assert memtree.verify_tree(tree_dir).ok
    assert snapshot(tree_dir) == before


# ----------------------------------------------------------------------------- row 1, 2: not a tree


def test_missing_path_is_not_a_memtree(tmp_path):
    e = expect_error(tmp_path / "nope", memtree.NotAMemtreeError)
    assert isinstance(e, FileNotFoundError)
    assert not os.path.exists(tmp_path / "nope")


def test_empty_dir_is_not_a_memtree(tmp_path):
    (tmp_path / "d").mkdir()
    e = expect_error(tmp_path / "d", memtree.NotAMemtreeError)
    assert str(tmp_path / "d") in str(e)


def test_dir_of_stray_files_is_not_a_memtree(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "x.memmap").write_bytes(b"\x00" * 8)
    (d / "data.bin").write_bytes(b"abc")
    (d / "sub").mkdir()
    (d / "sub" / "meta.json").write_bytes(dump(child_meta()))
    expect_error(d, memtree.NotAMemtreeError)


def test_regular_file_is_not_a_memtree(tmp_path):
    (tmp_path / "f").write_bytes(dump(root_meta()))
    expect_error(tmp_path / "f", memtree.NotAMemtreeError)


def test_root_meta_missing_is_not_a_memtree(tree_dir):
    os.remove(tree_dir / "meta.json")
    expect_error(tree_dir, memtree.NotAMemtreeError)


def test_staging_named_root_is_not_committed(tmp_path):
    staging = write_tree(tmp_path / ".tree.memtree-tmp-0123456789abcdef")
    e = expect_error(staging, memtree.NotCommittedError)
    assert isinstance(e, FileNotFoundError)


# ----------------------------------------------------------------------------- row 3, 5, 7: bad JSON bytes

GOOD = dump(root_meta())
BAD_META_BYTES = {
    "empty": b"",
    "whitespace": b"   \n",
    "open_brace": b"{",
    "truncated_1": GOOD[: len(GOOD) // 3],
    "truncated_2": GOOD[: len(GOOD) // 2],
    "truncated_last_byte": GOOD[:-1],
    "null": b"null",
    "list": b"[]",
    "string": b'"memtree"',
    "number": b"1",
    "garbage": b"\x00\x01\x02\x03garbage",
    "invalid_utf8": GOOD.replace(b"hello", b"hel\xfflo"),
    "utf16": json.dumps(root_meta()).encode("utf-16"),
    "bom": b"\xef\xbb\xbf" + GOOD,
    "lone_surrogate_escape": GOOD.replace(b'"hello"', b'"\\ud800"'),
    "lone_surrogate_in_key": GOOD.replace(b'"key":"s"', b'"key":"\\udc00"'),
    "nan_literal": GOOD.replace(b'"hello"', b"NaN"),
    "infinity_literal": GOOD.replace(b'"hello"', b"Infinity"),
    "huge_float": GOOD.replace(b'"hello"', b"1e400"),
    "trailing_garbage": GOOD + b" x",
    "two_objects": GOOD + GOOD,
    "comment": b"// c\n" + GOOD,
    "single_quotes": GOOD.replace(b'"', b"'"),
    "duplicate_top_key": GOOD.replace(b'"version":1', b'"version":1,"version":1'),
    "duplicate_top_key_differs": GOOD.replace(b'"version":1', b'"version":2,"version":1'),
    "duplicate_entry_field": GOOD.replace(b'"key":"a"', b'"key":"a","key":"zz"'),
    "duplicate_in_json_value": GOOD.replace(b'"value":"hello"', b'"value":{"x":1,"x":2}'),
    "deep_nesting": GOOD.replace(b'"hello"', b"[" * 5000 + b"]" * 5000),
    # nested deeper than orjson writes, not than it reads (1024): was a raw TypeError
    "deep_value_252": GOOD.replace(b'"hello"', b"[" * 252 + b"]" * 252),
    "deep_value_600": GOOD.replace(b'"hello"', b"[" * 600 + b"]" * 600),
    "deep_value_1020": GOOD.replace(b'"hello"', b"[" * 1020 + b"]" * 1020),
    "deep_object_value_400": GOOD.replace(b'"hello"', b'{"a":' * 400 + b"1" + b"}" * 400),
    "deep_field": GOOD.replace(b'"byteorder"', b'"x":' + b"[" * 700 + b"]" * 700 + b',"byteorder"'),
    "deep_in_hidden_duplicate": GOOD.replace(b'"version":1', b'"version":' + b"[" * 1000 + b"]" * 1000 + b',"version":1'),
    # repeated fields that the length of the re-dumped document did not reveal
    "duplicate_hidden_by_float": GOOD.replace(b'"kind":"json","value":"hello"', b'"kind":"json","kind":"json","value":1e15'),
    "duplicate_in_nested_value": GOOD.replace(b'"value":"hello"', b'"value":[{"x":[{"y":1,"y":1.0e0}]}]'),
    # ints beyond 64 bits: orjson reads them as floats, a value JSON would change
    "int_below_i64": GOOD.replace(b'"hello"', b"-9223372036854775809"),
    "int_beyond_u64": GOOD.replace(b'"hello"', b"18446744073709551616"),
    "shape_2_64_as_float": GOOD.replace(b'"shape":[2,3]', b'"shape":[2,18446744073709551616]'),
}


@pytest.mark.parametrize("name", list(BAD_META_BYTES), ids=list(BAD_META_BYTES))
def test_malformed_root_meta_bytes(tree_dir, name):
    set_root(tree_dir, BAD_META_BYTES[name])
    e = expect_error(tree_dir, memtree.MetaFormatError)
    assert "meta.json" in str(e)


@pytest.mark.parametrize("name", ["empty", "truncated_2", "invalid_utf8_child", "duplicate_key", "list"])
def test_malformed_child_meta_bytes(tree_dir, name):
    good = dump(child_meta())
    data = {
        "empty": b"",
        "truncated_2": good[: len(good) // 2],
        "invalid_utf8_child": good.replace(b'"c"', b'"\xc3\x28"'),
        "duplicate_key": good.replace(b'"batch_size":[2]', b'"batch_size":[2],"batch_size":[2]'),
        "list": b"[1,2]",
    }[name]
    set_child(tree_dir, data)
    e = expect_error(tree_dir, memtree.MetaFormatError)
    assert str(tree_dir / "b") in str(e)


def test_truncated_root_meta_at_every_offset(tree_dir):
    for cut in range(len(GOOD)):
        set_root(tree_dir, GOOD[:cut])
        expect_error(tree_dir, memtree.MetaFormatError)


def test_truncated_child_meta_at_every_offset(tree_dir):
    good = dump(child_meta())
    for cut in range(len(good)):
        set_child(tree_dir, good[:cut])
        expect_error(tree_dir, memtree.MetaFormatError)


# ----------------------------------------------------------------------------- row 4: size limit


@pytest.mark.timeout(20)
def test_sparse_one_gib_root_meta_is_refused_before_reading(tree_dir):
    with open(tree_dir / "meta.json", "r+b") as f:
        f.truncate(1 << 30)
    expect_error(tree_dir, memtree.LimitError)
    assert os.path.getsize(tree_dir / "meta.json") == 1 << 30


@pytest.mark.timeout(20)
def test_sparse_one_gib_child_meta_is_refused(tree_dir):
    with open(tree_dir / "b" / "meta.json", "r+b") as f:
        f.truncate(1 << 30)
    expect_error(tree_dir, memtree.LimitError)


@pytest.mark.timeout(60)
def test_meta_just_over_16_mib_is_refused(tree_dir):
    data = GOOD + b" " * ((16 << 20) + 1 - len(GOOD))
    assert len(data) == (16 << 20) + 1
    set_root(tree_dir, data)
    expect_error(tree_dir, memtree.LimitError)


# ----------------------------------------------------------------------------- row 6, 7, 27: schema


def _v3(fn):
    """:func:`_mut` of the root meta as a version 3 level (where chunks and dtensor may be)."""

    def edit(m):
        m["version"] = 3
        return fn(m)

    return _mut(edit)


def _mut(fn):
    """fn edits the meta dict in place (returns None), or returns a replacement (_replace)."""

    def apply(m):
        m = copy.deepcopy(m)
        r = fn(m)
        if isinstance(r, _Replace):
            return r.value
        return m

    return apply


class _Replace:
    def __init__(self, value):
        self.value = value


def _entry(m, key):
    return next(e for e in m["entries"] if e["key"] == key)


SCHEMA_MUTATIONS = {
    "top_level_list": _mut(lambda m: _Replace([m])),
    "top_level_string": _mut(lambda m: _Replace("memtree")),
    "top_level_null": _mut(lambda m: _Replace(None)),
    "top_level_number": _mut(lambda m: _Replace(1)),
    "extra_top_field": _mut(lambda m: m.update(extra=1)),
    "class_path_field": _mut(lambda m: m.update(_type="__main__.X")),
    "type_missing": _mut(lambda m: m.pop("type")),
    "type_class_path": _mut(lambda m: m.update(type="__main__.X")),
    "type_tensordict": _mut(lambda m: m.update(type="tensordict._td.TensorDict")),
    "type_int": _mut(lambda m: m.update(type=5)),
    "byteorder_big": _mut(lambda m: m.update(byteorder="big")),
    "byteorder_int": _mut(lambda m: m.update(byteorder=1)),
    "save_id_int": _mut(lambda m: m.update(save_id=5)),
    "batch_size_missing": _mut(lambda m: m.pop("batch_size")),
    "batch_size_str": _mut(lambda m: m.update(batch_size="2")),
    "batch_size_int": _mut(lambda m: m.update(batch_size=2)),
    "batch_size_float": _mut(lambda m: m.update(batch_size=[2.0])),
    "batch_size_bool": _mut(lambda m: m.update(batch_size=[True])),
    "batch_size_negative": _mut(lambda m: m.update(batch_size=[-2])),
    "batch_size_null": _mut(lambda m: m.update(batch_size=[None])),
    "batch_size_mismatch": _mut(lambda m: m.update(batch_size=[3])),
    "batch_size_longer_than_leaf": _mut(lambda m: m.update(batch_size=[2, 3, 1])),
    "entries_missing": _mut(lambda m: m.pop("entries")),
    "entries_dict": _mut(lambda m: m.update(entries={"a": 1})),
    "entries_null": _mut(lambda m: m.update(entries=None)),
    "entry_not_object": _mut(lambda m: m["entries"].append("a")),
    "entry_list": _mut(lambda m: m["entries"].append(["a", "tensor"])),
    "entry_key_missing": _mut(lambda m: _entry(m, "a").pop("key")),
    "entry_key_int": _mut(lambda m: _entry(m, "a").update(key=5)),
    "entry_key_null": _mut(lambda m: _entry(m, "a").update(key=None)),
    "entry_key_empty": _mut(lambda m: _entry(m, "a").update(key="")),
    "entry_key_list": _mut(lambda m: _entry(m, "a").update(key=["a"])),
    "entry_kind_missing": _mut(lambda m: _entry(m, "a").pop("kind")),
    "entry_kind_unknown": _mut(lambda m: _entry(m, "a").update(kind="module")),
    "entry_kind_class_path": _mut(lambda m: _entry(m, "a").update(kind="torch.nn.Module")),
    "entry_kind_int": _mut(lambda m: _entry(m, "a").update(kind=1)),
    "tensor_file_missing": _mut(lambda m: _entry(m, "a").pop("file")),
    "tensor_file_int": _mut(lambda m: _entry(m, "a").update(file=5)),
    "tensor_file_null": _mut(lambda m: _entry(m, "a").update(file=None)),
    "tensor_dtype_missing": _mut(lambda m: _entry(m, "a").pop("dtype")),
    "tensor_shape_missing": _mut(lambda m: _entry(m, "a").pop("shape")),
    "tensor_checksum_int": _mut(lambda m: _entry(m, "a").update(checksum=5)),
    "tensor_checksum_bad_algo": _mut(lambda m: _entry(m, "a").update(checksum="md5:00")),
    "tree_dir_missing": _mut(lambda m: _entry(m, "b").pop("dir")),
    "tree_dir_int": _mut(lambda m: _entry(m, "b").update(dir=3)),
    "json_value_missing": _mut(lambda m: _entry(m, "s").pop("value")),
    "tree_kind_on_leaf": _mut(lambda m: _entry(m, "a").update(kind="tree")),
    "duplicate_entry_keys": _mut(lambda m: m["entries"].append(dict(_entry(m, "a")))),
    "duplicate_entry_keys_other_kinds": _mut(lambda m: m["entries"].append({"key": "a", "kind": "json", "value": 1})),
    "two_entries_one_file": _mut(lambda m: m["entries"].append(dict(_entry(m, "a"), key="a2"))),
    "two_entries_one_dir": _mut(lambda m: m["entries"].append({"key": "b2", "kind": "tree", "dir": "b"})),
    "tensor_file_without_memmap_suffix": _mut(lambda m: _entry(m, "a").update(file="a.bin")),
    "tensor_file_is_meta_json": _mut(lambda m: _entry(m, "a").update(file="meta.json")),
    # version 3 fields (a DTensor leaf's annotation, per-chunk checksums)
    "dtensor_in_version_1": _mut(lambda m: _entry(m, "a").update(dtensor=DTENSOR)),
    "chunks_in_version_1": _mut(lambda m: _entry(m, "a").update(chunks=CHUNKS)),
    "v3_dtensor_partial": _v3(lambda m: _entry(m, "a").update(dtensor={"mesh": [2], "placements": [{"kind": "partial"}]})),
    "v3_dtensor_dim_beyond_shape": _v3(lambda m: _entry(m, "a").update(
        dtensor={"mesh": [2], "placements": [{"kind": "shard", "dim": 2}]})),
    "v3_dtensor_mesh_mismatch": _v3(lambda m: _entry(m, "a").update(
        dtensor={"mesh": [2, 2], "placements": [{"kind": "replicate"}]})),
    "v3_dtensor_empty_mesh": _v3(lambda m: _entry(m, "a").update(dtensor={"mesh": [], "placements": []})),
    "v3_dtensor_zero_mesh": _v3(lambda m: _entry(m, "a").update(dtensor={"mesh": [0], "placements": [{"kind": "replicate"}]})),
    "v3_dtensor_string": _v3(lambda m: _entry(m, "a").update(dtensor="S(0)")),
    "v3_dtensor_names_repeat": _v3(lambda m: _entry(m, "a").update(
        dtensor={"mesh": [1, 1], "placements": [{"kind": "replicate"}] * 2, "dim_names": ["x", "x"]})),
    "v3_dtensor_class_path": _v3(lambda m: _entry(m, "a").update(
        dtensor={"mesh": [2], "placements": [{"kind": "torch.distributed.tensor.Shard", "dim": 0}]})),
    "v3_dtensor_torch_short_form": _v3(lambda m: _entry(m, "a").update(dtensor={"mesh": [2], "placements": ["S(0)"]})),
    "v3_placement_field": _v3(lambda m: _entry(m, "a").update(placement={"mesh": [2], "placements": ["S(0)"]})),
    "v3_chunks_beside_checksum": _v3(lambda m: _entry(m, "a").update(checksum=A_CRC, chunks=CHUNKS)),
    "v3_chunks_of_one_chunk": _v3(lambda m: _entry(m, "a").update(chunks=CHUNKS)),  # records checksum instead
    "v3_chunks_unknown_algorithm": _v3(lambda m: _entry(m, "a").update(chunks={**CHUNKS, "algorithm": "md5"})),
    "v3_chunks_tiny": _v3(lambda m: _entry(m, "a").update(chunks={**CHUNKS, "chunk_bytes": 16})),
    "v3_chunks_huge": _v3(lambda m: _entry(m, "a").update(chunks={**CHUNKS, "chunk_bytes": 2**41})),
    "v3_chunks_extra_field": _v3(lambda m: _entry(m, "a").update(chunks={**CHUNKS, "sums": ["0" * 8]})),
    "v3_chunks_of_dist_draft": _v3(lambda m: _entry(m, "a").update(chunks={"bytes": 4096, "sums": [A_CRC[6:]]})),
}


@pytest.mark.parametrize("kw", [{}, {"device": "meta"}], ids=["default", "device_meta"])
@pytest.mark.parametrize("name", list(SCHEMA_MUTATIONS), ids=list(SCHEMA_MUTATIONS))
def test_schema_violation_in_root_meta(tree_dir, name, kw):
    (tree_dir / "a.bin").write_bytes(A_BYTES)
    set_root(tree_dir, SCHEMA_MUTATIONS[name](root_meta()))
    expect_error(tree_dir, memtree.MetaFormatError, **kw)


def test_version_3_fields_that_fit_load(tree_dir):
    """The control of the v3 mutations above: a valid DTensor annotation loads (valid per-chunk
    checksums load in tests/test_golden_v3_chunks.py)."""
    m = root_meta()
    m["version"] = 3
    _entry(m, "a").update(dtensor=DTENSOR, checksum=A_CRC)
    set_root(tree_dir, m)
    assert memtree.load_memmap(str(tree_dir), verify=True)["a"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_case_insensitive_duplicate_file_names(tree_dir):
    (tree_dir / "A.memmap").write_bytes(A_BYTES)
    m = root_meta()
    m["entries"].append(dict(_entry(m, "a"), key="A", file="A.memmap"))
    set_root(tree_dir, m)
    expect_error(tree_dir, memtree.MetaFormatError)


def _child_dup_entry(m):
    m["entries"].append(dict(m["entries"][0]))


def _child_entry(m):
    return m["entries"][0]


CHILD_SCHEMA_MUTATIONS = {
    "extra_top_field": _mut(lambda m: m.update(extra=1)),
    "batch_size_float": _mut(lambda m: m.update(batch_size=[2.0])),
    "type_class_path": _mut(lambda m: m.update(type="__main__.X")),
    "entry_key_int": _mut(lambda m: _child_entry(m).update(key=5)),
    "entry_kind_unknown": _mut(lambda m: _child_entry(m).update(kind="module")),
    "duplicate_entry_keys": _mut(_child_dup_entry),
    "bad_dtype": _mut(lambda m: _child_entry(m).update(dtype="object")),
    "negative_shape": _mut(lambda m: _child_entry(m).update(shape=[2, -1])),
    "save_id_int": _mut(lambda m: m.update(save_id=1)),
}


@pytest.mark.parametrize("name", list(CHILD_SCHEMA_MUTATIONS), ids=list(CHILD_SCHEMA_MUTATIONS))
def test_schema_violation_in_child_meta(tree_dir, name):
    set_child(tree_dir, CHILD_SCHEMA_MUTATIONS[name](child_meta()))
    e = expect_error(tree_dir, memtree.MetaFormatError)
    assert str(tree_dir / "b") in str(e)


def test_child_batch_size_must_extend_parent(tree_dir):
    m = child_meta()
    m["batch_size"] = [3]
    m["entries"] = [{"key": "e", "kind": "tensor", "file": "e.memmap", "dtype": "float32", "shape": [3, 0]}]
    set_child(tree_dir, m)
    expect_error(tree_dir, memtree.MetaFormatError)


def test_meta_naming_a_module_imports_nothing(tree_dir):
    assert "this" not in sys.modules
    m = root_meta()
    m["type"] = "this.Zen"
    set_root(tree_dir, m)
    expect_error(tree_dir, memtree.MetaFormatError)
    assert "this" not in sys.modules


# ----------------------------------------------------------------------------- row 8: versions


@pytest.mark.parametrize(
    "field,value",
    [("version", 4), ("version", 0), ("version", 999), ("version", -1),  # memtree reads 1 to 3
     ("format", "tensordict"), ("format", "memtree2"), ("format", "MEMTREE")],
)
def test_unknown_format_or_version(tree_dir, field, value):
    m = root_meta()
    m[field] = value
    set_root(tree_dir, m)
    e = expect_error(tree_dir, memtree.UnsupportedVersionError)
    assert str(value) in str(e)


@pytest.mark.parametrize(
    "field,value",
    [("version", None), ("version", "1"), ("version", 1.0), ("version", True), ("format", None), ("format", 1)],
)
def test_wrongly_typed_format_or_version(tree_dir, field, value):
    m = root_meta()
    m[field] = value
    set_root(tree_dir, m)
    expect_error(tree_dir, memtree.MetaFormatError)


@pytest.mark.parametrize("field", ["version", "format"])
def test_missing_format_or_version(tree_dir, field):
    m = root_meta()
    del m[field]
    set_root(tree_dir, m)
    expect_error(tree_dir, memtree.MetaFormatError)


def test_unknown_version_in_child(tree_dir):
    m = child_meta()
    m["version"] = 4
    set_child(tree_dir, m)
    expect_error(tree_dir, memtree.UnsupportedVersionError)


# ----------------------------------------------------------------------------- row 9: dtypes

BAD_DTYPES = [
    "object", "torch.float32", "<f4", "float128", "Float32", "FLOAT32", "", " float32", "float32 ",
    "float", "half", "double", "long", "int", "cfloat", "qint8", "quint8", "complex", "bits8",
    "uint1", "int4", "Tensor", "__class__", "__import__", "finfo", "float4_e2m1fn_x2",
    5, None, True, ["float32"], {"name": "float32"},
]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=[repr(d) for d in BAD_DTYPES])
def test_unknown_dtype_is_refused(tree_dir, dtype):
    m = root_meta()
    _entry(m, "a")["dtype"] = dtype
    set_root(tree_dir, m)
    expect_error(tree_dir, memtree.MetaFormatError)


def test_dtype_that_does_not_fit_the_file(tree_dir):
    m = root_meta()
    _entry(m, "a")["dtype"] = "float64"  # 48 bytes needed, file has 24
    set_root(tree_dir, m)
    expect_error(tree_dir, memtree.LeafSizeError)


# ----------------------------------------------------------------------------- row 10, 11: shapes

BAD_SHAPES = {
    "negative": [2, -3],
    "negative_pair": [2, -1, -3],
    "float": [2, 3.0],
    "float_frac": [2, 1.5],
    "bool": [2, True],
    "bools": [True, True],
    "null": [2, None],
    "string": [2, "3"],
    "nested_list": [2, [3]],
    "not_a_list": "2,3",
    "int_not_list": 6,
    "dict": {"0": 2, "1": 3},
    "null_shape": None,
    "too_many_dims": [2] + [1] * 64,
    "not_batch_prefix": [3, 2],
    "shorter_than_batch": [],
    "overflow_2_62": [2, 2**62],
    "overflow_2_63": [2, 2**63 - 1],
    "overflow_product": [2, 2**31, 2**31, 2**31],
    "overflow_u64_wrap": [2, 2**61],  # 2 * 2**61 * 4 = 2**65 wraps to 0 in 64-bit arithmetic
    "zero_and_huge": [2, 0, 2**70],
    # no element, but dims torch cannot take (not int64, or strides beyond it): were accepted,
    # then a raw TypeError at load while verify called the tree clean
    "zero_and_2_63": [2, 0, 2**63],
    "zero_and_u64_max": [2, 0, 2**64 - 1],
    "zero_and_i64_max": [2, 0, 2**63 - 1],
    "zero_strides_overflow": [2, 0, 2**62, 2**62],
    "zero_strides_overflow_bytes": [2, 0, 2**61, 4],  # float32: 2**61 * 4 * 4 bytes of stride
}


@pytest.mark.parametrize("kw", [{}, {"device": "meta"}], ids=["default", "device_meta"])
@pytest.mark.parametrize("name", list(BAD_SHAPES), ids=list(BAD_SHAPES))
def test_bad_shape_is_refused(tree_dir, name, kw):
    m = root_meta()
    _entry(m, "a")["shape"] = BAD_SHAPES[name]
    set_root(tree_dir, m)
    expect_error(tree_dir, memtree.MetaFormatError, **kw)


def test_shape_at_the_size_limit_is_a_size_error_not_a_crash(tree_dir):
    m = root_meta()
    _entry(m, "a")["shape"] = [2, 2**59]  # numel * 4 == 2**62: allowed by the schema
    set_root(tree_dir, m)
    expect_error(tree_dir, memtree.LeafSizeError)


def test_same_numel_other_shape_is_refused(tree_dir):
    m = root_meta()
    _entry(m, "a")["shape"] = [6]  # 24 bytes, but does not start with batch_size [2]
    set_root(tree_dir, m)
    expect_error(tree_dir, memtree.MetaFormatError)


# ----------------------------------------------------------------------------- row 12: missing leaves


@pytest.mark.parametrize("kw", LOAD_VARIANTS, ids=LOAD_IDS)
@pytest.mark.parametrize("leaf", ["a.memmap", "b/c.memmap", "b/e.memmap"])
def test_missing_leaf_file(tree_dir, leaf, kw):
    os.remove(tree_dir / leaf)
    e = expect_error(tree_dir, memtree.MissingLeafError, **kw)
    assert isinstance(e, FileNotFoundError)
    assert str(tree_dir / leaf) in str(e)
    assert not os.path.exists(tree_dir / leaf)


def test_missing_subtree_dir(tree_dir):
    shutil.rmtree(tree_dir / "b")
    e = expect_error(tree_dir, memtree.MemtreeError)
    assert isinstance(e, FileNotFoundError)
    assert not os.path.exists(tree_dir / "b")


def test_missing_child_meta(tree_dir):
    os.remove(tree_dir / "b" / "meta.json")
    e = expect_error(tree_dir, memtree.MemtreeError)
    assert isinstance(e, FileNotFoundError)


# ----------------------------------------------------------------------------- row 14, 15: leaf sizes


def _resize(path: Path, new_size: int) -> None:
    data = path.read_bytes()
    if new_size <= len(data):
        path.write_bytes(data[:new_size])
    else:
        path.write_bytes(data + bytes((i * 31 + 7) % 256 for i in range(new_size - len(data))))


SIZE_CASES = [
    ("a.memmap", 23), ("a.memmap", 0), ("a.memmap", 12), ("a.memmap", 25), ("a.memmap", 24 + 4096),
    ("b/c.memmap", 15), ("b/c.memmap", 17), ("b/e.memmap", 1), ("b/e.memmap", 4096),
]


@pytest.mark.parametrize("kw", LOAD_VARIANTS, ids=LOAD_IDS)
@pytest.mark.parametrize("leaf,size", SIZE_CASES, ids=[f"{l}-{s}" for l, s in SIZE_CASES])
def test_leaf_of_wrong_size_is_refused_and_unchanged(tree_dir, leaf, size, kw):
    _resize(tree_dir / leaf, size)
    before = (tree_dir / leaf).read_bytes()
    e = expect_error(tree_dir, memtree.LeafSizeError, **kw)
    assert str(tree_dir / leaf) in str(e)
    assert (tree_dir / leaf).read_bytes() == before
    assert os.path.getsize(tree_dir / leaf) == size


def test_wrong_size_leaf_refused_by_partial_load(tree_dir):
    _resize(tree_dir / "a.memmap", 20)
    expect_error(tree_dir, memtree.LeafSizeError, keys=["a"])
    t = memtree.load_memmap(tree_dir, keys=[("b", "c")])  # the damaged leaf is not opened
    assert torch.equal(plain(t["b", "c"]), torch.tensor([7, -8]))


_CHILD_SCRIPT = textwrap.dedent(
    """
    import sys, torch, memtree
    kw = eval(sys.argv[2])
    total = 0.0
    def walk(t):
        global total
        for k in t.keys():
            v = t[k]
            if isinstance(v, memtree.TensorTree):
                walk(v)
            elif isinstance(v, torch.Tensor):
                total += float(v.as_subclass(torch.Tensor).reshape(-1).view(torch.uint8).double().sum())
    try:
        tree = memtree.load_memmap(sys.argv[1], **kw)
        tree.keys(include_nested=True)  # levels load lazily: load them all before reading data
    except memtree.MemtreeError as e:
        print("ERR", type(e).__name__)
        sys.exit(1)
    walk(tree)
    print("OK", total)
    sys.exit(0)
    """
)


def _run_child(prefix, kw):
    return subprocess.run(
        [sys.executable, "-c", _CHILD_SCRIPT, str(prefix), repr(kw)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw", [{}, {"mode": "r"}], ids=["default", "mode_r"])
def test_truncated_leaf_in_subprocess_never_signals(tree_dir, kw):
    before = snapshot(tree_dir)
    _resize(tree_dir / "a.memmap", 10)
    _resize(tree_dir / "b" / "c.memmap", 0)
    damaged = snapshot(tree_dir)
    assert damaged != before
    r = _run_child(tree_dir, kw)
    assert r.returncode >= 0, f"child killed by signal {-r.returncode}: {r.stderr[-2000:]}"
    assert r.returncode == 1, r.stdout + r.stderr[-2000:]
    assert "ERR LeafSizeError" in r.stdout
    assert snapshot(tree_dir) == damaged


@pytest.mark.timeout(300)
def test_intact_tree_in_subprocess_loads_and_reads(tree_dir):
    r = _run_child(tree_dir, {})
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert r.stdout.startswith("OK")


# ----------------------------------------------------------------------------- row 16: leaf file kinds


def test_leaf_symlink_to_file_outside_prefix(tmp_path, tree_dir):
    outside = tmp_path / "outside.memmap"
    outside.write_bytes(A_BYTES)  # right size: only the link itself is wrong
    os.remove(tree_dir / "a.memmap")
    os.symlink(outside, tree_dir / "a.memmap")
    e = expect_error(tree_dir, memtree.UnsafePathError)
    assert str(tree_dir / "a.memmap") in str(e)


def test_leaf_relative_symlink_inside_prefix(tree_dir):
    (tree_dir / "other.bin").write_bytes(A_BYTES)
    os.remove(tree_dir / "a.memmap")
    os.symlink("other.bin", tree_dir / "a.memmap")
    expect_error(tree_dir, memtree.UnsafePathError)


@pytest.mark.timeout(20)
def test_leaf_symlink_to_dev_zero(tree_dir):
    os.remove(tree_dir / "a.memmap")
    os.symlink("/dev/zero", tree_dir / "a.memmap")
    expect_error(tree_dir, memtree.UnsafePathError)


def test_leaf_dangling_symlink(tree_dir):
    os.remove(tree_dir / "a.memmap")
    os.symlink(tree_dir / "nowhere", tree_dir / "a.memmap")
    expect_error(tree_dir, memtree.UnsafePathError)
    assert not os.path.exists(tree_dir / "nowhere")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kw", LOAD_VARIANTS, ids=LOAD_IDS)
def test_fifo_leaf_does_not_hang(tree_dir, kw):
    os.remove(tree_dir / "a.memmap")
    os.mkfifo(tree_dir / "a.memmap")
    expect_error(tree_dir, memtree.UnsafePathError, **kw)


@pytest.mark.timeout(20)
def test_fifo_zero_element_leaf_does_not_hang(tree_dir):
    os.remove(tree_dir / "b" / "e.memmap")
    os.mkfifo(tree_dir / "b" / "e.memmap")
    expect_error(tree_dir, memtree.UnsafePathError)


@pytest.mark.parametrize("kw", LOAD_VARIANTS, ids=LOAD_IDS)
def test_directory_where_leaf_file_should_be(tree_dir, kw):
    os.remove(tree_dir / "a.memmap")
    (tree_dir / "a.memmap").mkdir()
    expect_error(tree_dir, memtree.UnsafePathError, **kw)


def test_directory_where_zero_element_leaf_should_be(tree_dir):
    os.remove(tree_dir / "b" / "e.memmap")
    (tree_dir / "b" / "e.memmap").mkdir()
    expect_error(tree_dir, memtree.UnsafePathError)


@pytest.mark.timeout(20)
def test_socket_leaf(tree_dir, monkeypatch):
    os.remove(tree_dir / "a.memmap")
    monkeypatch.chdir(tree_dir)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind("a.memmap")
        expect_error(tree_dir, memtree.UnsafePathError)
    finally:
        s.close()


@pytest.mark.timeout(20)
def test_char_device_leaf(tree_dir):
    os.remove(tree_dir / "a.memmap")
    try:
        os.mknod(tree_dir / "a.memmap", stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
    except (PermissionError, OSError):
        pytest.skip("cannot create device nodes here")
    expect_error(tree_dir, memtree.UnsafePathError)


# ----------------------------------------------------------------------------- meta.json file kinds


def test_root_meta_is_symlink(tmp_path, tree_dir):
    real = tmp_path / "real_meta.json"
    real.write_bytes(GOOD)
    os.remove(tree_dir / "meta.json")
    os.symlink(real, tree_dir / "meta.json")
    expect_error(tree_dir, memtree.UnsafePathError)


def test_child_meta_is_symlink(tmp_path, tree_dir):
    real = tmp_path / "real_child_meta.json"
    real.write_bytes(dump(child_meta()))
    os.remove(tree_dir / "b" / "meta.json")
    os.symlink(real, tree_dir / "b" / "meta.json")
    expect_error(tree_dir, memtree.UnsafePathError)


@pytest.mark.timeout(20)
def test_root_meta_is_fifo(tree_dir):
    os.remove(tree_dir / "meta.json")
    os.mkfifo(tree_dir / "meta.json")
    expect_error(tree_dir, memtree.UnsafePathError)


@pytest.mark.timeout(20)
def test_child_meta_is_fifo(tree_dir):
    os.remove(tree_dir / "b" / "meta.json")
    os.mkfifo(tree_dir / "b" / "meta.json")
    expect_error(tree_dir, memtree.UnsafePathError)


def test_root_meta_is_directory(tree_dir):
    os.remove(tree_dir / "meta.json")
    (tree_dir / "meta.json").mkdir()
    expect_error(tree_dir, memtree.MemtreeError)


# ----------------------------------------------------------------------------- row 17: sub-directories


def test_subdir_symlink_to_tree_outside_prefix(tmp_path, tree_dir):
    outside = tmp_path / "outside_b"
    shutil.copytree(tree_dir / "b", outside)
    shutil.rmtree(tree_dir / "b")
    os.symlink(outside, tree_dir / "b")
    e = expect_error(tree_dir, memtree.UnsafePathError)
    assert str(tree_dir / "b") in str(e)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("target", ["b", "/", "."], ids=["self_loop", "root", "prefix"])
def test_subdir_symlink_loops_and_escapes(tree_dir, target):
    shutil.rmtree(tree_dir / "b")
    os.symlink(target, tree_dir / "b")
    expect_error(tree_dir, memtree.UnsafePathError)


def test_regular_file_where_subdir_should_be(tree_dir):
    shutil.rmtree(tree_dir / "b")
    (tree_dir / "b").write_bytes(dump(child_meta()))
    expect_error(tree_dir, memtree.UnsafePathError)


@pytest.mark.timeout(20)
def test_fifo_where_subdir_should_be(tree_dir):
    shutil.rmtree(tree_dir / "b")
    os.mkfifo(tree_dir / "b")
    expect_error(tree_dir, memtree.UnsafePathError)


# ----------------------------------------------------------------------------- row 18, 19: names in meta


def _traversal_file_names(tmp_path, tree_dir):
    decoy = tmp_path / "x.memmap"
    decoy.write_bytes(A_BYTES)  # right size: a loader that follows the name would "succeed"
    return [
        "../x.memmap",
        "../../x.memmap",
        str(decoy),
        "/etc/passwd",
        "/dev/zero",
        "b/c.memmap",
        "b/../a.memmap",
        "./a.memmap",
        "a.memmap/",
        "..",
        ".",
        "%2E%2E/x.memmap",
        "..\\x.memmap",
    ]


def test_leaf_file_names_that_leave_the_directory(tmp_path, tree_dir):
    (tree_dir / "b" / "a.memmap").write_bytes(A_BYTES)
    for name in _traversal_file_names(tmp_path, tree_dir):
        m = root_meta()
        _entry(m, "a")["file"] = name
        set_root(tree_dir, m)
        # mode="r": even a broken loader must not be able to extend a system file
        e = expect_error(tree_dir, (memtree.UnsafePathError, memtree.MetaFormatError), root=tmp_path, mode="r")
        if "/" in name or name in ("..", "."):
            assert isinstance(e, memtree.UnsafePathError), (name, type(e))


@pytest.mark.parametrize(
    "name",
    ["", ".hidden.memmap", " a.memmap", "a b.memmap", "a\x00.memmap", "x" * 300 + ".memmap", "a\nb.memmap",
     "\u00e9.memmap", "a*.memmap", "a:b.memmap"],
    ids=["empty", "dot_hidden", "leading_space", "space", "nul", "too_long", "newline", "non_ascii", "star", "colon"],
)
def test_leaf_file_names_that_are_not_safe(tmp_path, tree_dir, name):
    try:
        (tree_dir / name).write_bytes(A_BYTES)
    except (OSError, ValueError):
        pass
    m = root_meta()
    _entry(m, "a")["file"] = name
    set_root(tree_dir, m)
    expect_error(tree_dir, (memtree.UnsafePathError, memtree.MetaFormatError), root=tmp_path)


def test_subtree_dir_names_that_leave_the_directory(tmp_path, tree_dir):
    other = write_tree(tmp_path / "other")  # a valid tree next to the prefix
    shutil.copytree(tree_dir / "b", tmp_path / "b_copy")
    names = ["..", ".", "../other", "../other/b", str(other / "b"), "/", "b/", "b/.", "./b", "../b_copy", "", "/tmp"]
    for name in names:
        m = root_meta()
        _entry(m, "b")["dir"] = name
        set_root(tree_dir, m)
        e = expect_error(tree_dir, (memtree.UnsafePathError, memtree.MetaFormatError), root=tmp_path)
        if "/" in name or name in ("..", "."):
            assert isinstance(e, memtree.UnsafePathError), (name, type(e))


def test_child_meta_file_names_that_leave_the_directory(tmp_path, tree_dir):
    (tmp_path / "tree" / "c.memmap").write_bytes(C_BYTES)
    for name in ["../c.memmap", str(tree_dir / "c.memmap"), "../../tree/c.memmap"]:
        m = child_meta()
        m["entries"][0]["file"] = name
        set_child(tree_dir, m)
        expect_error(tree_dir, memtree.UnsafePathError, root=tmp_path)


def test_loader_uses_recorded_file_name_not_the_key(tree_dir):
    m = root_meta()
    _entry(m, "a")["key"] = "../../zzz"  # key whose escaped name would differ from the file
    set_root(tree_dir, m)
    t = memtree.load_memmap(tree_dir)
    assert torch.equal(plain(t["../../zzz"]), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert "a" not in t.keys()


def test_path_field_in_entry_is_never_followed(tmp_path, tree_dir):
    decoy = tmp_path / "decoy.memmap"
    decoy.write_bytes(b"\xff" * 24)
    m = root_meta()
    _entry(m, "a")["path"] = str(decoy)
    _entry(m, "a")["filename"] = str(decoy)
    set_root(tree_dir, m)
    before = snapshot(tmp_path)
    try:
        t = memtree.load_memmap(tree_dir)
    except memtree.MetaFormatError:
        pass
    else:
        assert torch.equal(plain(t["a"]), torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert snapshot(tmp_path) == before


# ----------------------------------------------------------------------------- row 24: stray files


def test_stray_files_and_dirs_are_ignored(tree_dir):
    (tree_dir / "x.memmap").write_bytes(b"\x01" * 100)
    (tree_dir / ".hidden").write_bytes(b"secret")
    (tree_dir / "junk").mkdir()
    (tree_dir / "junk" / "meta.json").write_bytes(b"not json at all")
    (tree_dir / "b" / "stray.memmap").write_bytes(b"\x02" * 3)
    (tree_dir / ".tree.memtree-tmp-deadbeef").mkdir()
    before = snapshot(tree_dir)
    t = memtree.load_memmap(tree_dir)
    assert set(t.keys()) == {"a", "b", "s"}
    assert set(t["b"].keys()) == {"c", "e"}
    assert snapshot(tree_dir) == before


# ----------------------------------------------------------------------------- row 25: pickle


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _plant_pickle(tree_dir, marker, file="evil.pickle", where=None):
    where = where or tree_dir
    with open(where / Path(file).name, "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    m = root_meta()
    m["entries"].append({"key": "evil", "kind": "pickle", "file": file})
    set_root(tree_dir, m)


@pytest.mark.parametrize("kw", LOAD_VARIANTS, ids=LOAD_IDS)
def test_pickle_entry_refused_without_allow_pickle(tmp_path, tree_dir, kw):
    marker = tmp_path / "PWNED"
    _plant_pickle(tree_dir, marker)
    expect_error(tree_dir, memtree.PickleNotAllowedError, root=tmp_path, **kw)
    assert not marker.exists()


def test_stray_pickle_is_never_executed(tmp_path, tree_dir):
    marker = tmp_path / "PWNED"
    with open(tree_dir / "evil.pickle", "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    with open(tree_dir / "b" / "meta.pickle", "wb") as f:
        pickle.dump(_Evil(str(marker)), f)
    memtree.load_memmap(tree_dir).keys(include_nested=True)
    memtree.load_memmap(tree_dir, allow_pickle=True).keys(include_nested=True)
    assert not marker.exists()


def test_pickle_outside_prefix_is_never_executed_even_with_allow_pickle(tmp_path, tree_dir):
    marker = tmp_path / "PWNED"
    _plant_pickle(tree_dir, marker, file="../evil.pickle", where=tmp_path)
    expect_error(tree_dir, memtree.UnsafePathError, root=tmp_path, allow_pickle=True)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["evil.memmap", "evil", "meta.json", ".evil.pickle"])
def test_pickle_entry_with_bad_file_name(tmp_path, tree_dir, name):
    marker = tmp_path / "PWNED"
    _plant_pickle(tree_dir, marker, file=name)
    expect_error(tree_dir, (memtree.MetaFormatError, memtree.UnsafePathError), root=tmp_path, allow_pickle=True)
    assert not marker.exists()


# ------------------------------------------------ format limits: field values and repeated fields
# (in-process, with verify's agreement checked; tests/test_fuzz_load.py is the loader fuzzer of
# damaged trees, in child processes)

FUZZ_NAMES = [
    "../x.memmap", "/etc/passwd", "/dev/zero", "..", ".", "", "a/b.memmap", "x" * 300, "a.memmap",
    "c.memmap", "e.memmap", "b", "meta.json", "%2E%2E.memmap", "a\x00.memmap", ".hidden.memmap",
    "../../../../../../etc/passwd", "b/c.memmap", "A.memmap", "x.memmap", "a.pickle",
]
FUZZ_DTYPES = [
    "bool", "uint8", "int64", "float32", "float64", "bfloat16", "complex32", "complex128",
    "float8_e4m3fn", "float8_e8m0fnu", "object", "torch.float32", "float", "<f4", "", "Tensor",
]
FUZZ_SCALARS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 3, -1, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, 2**64 + 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=8),
    st.sampled_from(FUZZ_NAMES + FUZZ_DTYPES + ["memtree", "TensorTree", "little", "big", "tensor", "tree", "json", "pickle"]),
)
FUZZ_DIMS = [0, 0, 1, 2, 3, 2**31, 2**60, 2**61, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
FUZZ_VALUES = st.one_of(
    FUZZ_SCALARS,
    st.lists(st.sampled_from(FUZZ_DIMS), max_size=5),  # shapes, zero-element ones with huge dims
    st.builds("@deep:{}:{}@".format, st.integers(min_value=240, max_value=1030), st.sampled_from(["list", "dict"])),
    st.lists(st.one_of(st.integers(min_value=-5, max_value=2**65), st.floats(), st.booleans(), st.none()), max_size=5),
    st.lists(st.integers(min_value=0, max_value=8), max_size=4),
    st.dictionaries(st.sampled_from(["key", "kind", "file", "dir", "dtype", "shape", "value"]), FUZZ_SCALARS, max_size=4),
)
FIELDS = ["format", "version", "type", "byteorder", "batch_size", "entries", "save_id", "extra"]


def _deep(depth: int, kind: str) -> bytes:
    """JSON text of a value nested ``depth`` levels of lists or one-field objects."""
    if kind == "list":
        return b"[" * depth + b"1" + b"]" * depth
    return b'{"k":' * depth + b"1" + b"}" * depth


_DEEP_TOKEN = re.compile(rb'"@deep:(\d+):(list|dict)@"')


def _dump_fuzzed(meta) -> bytes:
    """JSON bytes of a fuzzed meta: NaN and lone surrogates as they are, and each ``@deep:N:kind@``
    string replaced by a value nested N levels (too deep for json.dumps to write)."""
    data = json.dumps(meta, allow_nan=True).encode("utf-8", "surrogatepass")
    return _DEEP_TOKEN.sub(lambda m: _deep(int(m[1]), m[2].decode()), data)
ENTRY_FIELDS = ["key", "kind", "file", "dir", "dtype", "shape", "value", "checksum", "path"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    write_tree(base / "pristine" / "tree")
    return base


def _check_loaded_level(level, d: Path):
    """The loaded level agrees with the meta.json on disk: keys, dtypes, shapes, file sizes."""
    meta = json.loads((d / "meta.json").read_bytes())
    entries = meta["entries"]
    assert set(level.keys()) == {e["key"] for e in entries}
    for e in entries:
        v = level[e["key"]]
        if e["kind"] == "tensor":
            assert isinstance(v, torch.Tensor)
            assert type(e["shape"]) is list and all(type(x) is int and x >= 0 for x in e["shape"])
            assert type(e["dtype"]) is str
            assert list(v.shape) == e["shape"]
            assert str(v.dtype) == "torch." + e["dtype"]
            path = d / e["file"]
            assert os.path.isfile(path) and not os.path.islink(path)
            assert os.path.getsize(path) == v.numel() * v.element_size()
            fn = getattr(v, "filename", None)
            if fn is not None:
                assert os.path.samefile(fn, path)
            plain(v).reshape(-1).view(torch.uint8).sum()  # touch every byte
        elif e["kind"] == "tree":
            assert isinstance(v, memtree.TensorTree)
            _check_loaded_level(v, d / e["dir"])
        elif e["kind"] == "json":
            assert v == e["value"]


def _fuzz_load(pristine: Path, mutate, kw=None):
    work = Path(tempfile.mkdtemp(dir=pristine))
    try:
        shutil.copytree(pristine / "pristine" / "tree", work / "tree")
        (work / "x.memmap").write_bytes(A_BYTES)  # a decoy for "../x.memmap"
        mutate(work / "tree")
        kw = dict(kw or {})
        text = b"".join(p.read_bytes() for p in [work / "tree" / "meta.json", work / "tree" / "b" / "meta.json"] if p.is_file())
        if b"/etc" in text or b"/dev" in text:
            kw["mode"] = "r"  # never let a broken loader extend a system file
        before = snapshot(work)
        refusal = None
        try:
            tree = memtree.load_memmap(work / "tree", **kw)
            tree.keys(include_nested=True)  # load every lazily opened level
        except memtree.MemtreeError as e:
            event(f"refused: {type(e).__name__}")
            refusal = e
        except Exception as e:  # pragma: no cover - the failure we are looking for
            raise AssertionError(f"non-memtree exception {type(e).__name__}: {e}") from e
        else:
            event("loaded")
            _check_loaded_level(tree, work / "tree")
            del tree
        report = memtree.verify_tree(work / "tree", checksums=False)  # the load checks no checksum
        if not isinstance(refusal, LOAD_POLICIES):
            assert report.ok == (refusal is None), (refusal, report.problems)
        assert snapshot(work) == before
    finally:
        shutil.rmtree(work, ignore_errors=True)


FUZZ_SETTINGS = settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    database=None,
)


@FUZZ_SETTINGS
@given(
    which=st.sampled_from(["root", "child"]),
    target=st.one_of(
        st.tuples(st.just("top"), st.sampled_from(FIELDS), st.just(0)),
        st.tuples(st.just("entry"), st.sampled_from(ENTRY_FIELDS), st.integers(min_value=0, max_value=3)),
        st.tuples(st.just("shape_item"), st.just("shape"), st.integers(min_value=0, max_value=3)),
    ),
    action=st.sampled_from(["set", "set", "set", "delete"]),
    value=FUZZ_VALUES,
    resize=st.one_of(st.none(), st.tuples(st.sampled_from(["a.memmap", "b/c.memmap", "b/e.memmap"]), st.integers(min_value=-24, max_value=24))),
    kw=st.sampled_from(LOAD_VARIANTS),
)
@example(which="root", target=("entry", "value", 2), action="set", value=-(2**63) - 1, resize=None, kw={})
@example(which="root", target=("entry", "value", 2), action="set", value="@deep:251:list@", resize=None, kw={})
@example(which="root", target=("entry", "value", 2), action="set", value="@deep:252:dict@", resize=None, kw={})
@example(which="child", target=("shape_item", "shape", 1), action="set", value=2**64 - 1, resize=None, kw={})
@example(which="child", target=("entry", "shape", 1), action="set", value=[2, 0, 2**62, 2**62], resize=None, kw={})
@example(which="root", target=("top", "batch_size", 0), action="set", value=[2**63], resize=None, kw={})
def test_meta_field_values_at_the_limits(pristine, which, target, action, value, resize, kw):
    kind, field, index = target

    def mutate(tree):
        meta = root_meta() if which == "root" else child_meta()
        if kind == "top":
            if action == "delete":
                meta.pop(field, None)
            else:
                meta[field] = value
        else:
            entry = meta["entries"][index % len(meta["entries"])]
            if kind == "entry":
                if action == "delete":
                    entry.pop(field, None)
                else:
                    entry[field] = value
            else:
                shape = entry.get("shape")
                if isinstance(shape, list) and shape:
                    if action == "delete":
                        shape.pop(index % len(shape))
                    else:
                        shape[index % len(shape)] = value
                else:
                    entry["shape"] = [value]
        (tree / ("meta.json" if which == "root" else "b/meta.json")).write_bytes(_dump_fuzzed(meta))
        if resize is not None:
            leaf, delta = resize
            p = tree / leaf
            _resize(p, max(0, os.path.getsize(p) + delta))

    _fuzz_load(pristine, mutate, kw)


def _objects(v, path=()):
    """The path of every non-empty JSON object in ``v`` (the document, entries, values)."""
    out = [path] if isinstance(v, dict) and v else []
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        out += _objects(x, path + (k,))
    return out


def _same_length_when_redumped(data: bytes) -> bytes:
    """``data`` with its ``"@pad@"`` value made a list of floats spelled shorter than orjson writes
    them (``1e15``, 14 bytes less) and padded (``1e0015``), so that re-dumping what orjson reads
    gives exactly as many bytes: what the parser once compared to decide if fields repeat."""
    base = data.replace(b'"@pad@"', b"[]")
    try:
        diff = len(base) - len(orjson.dumps(orjson.loads(base)))
    except (orjson.JSONDecodeError, TypeError):
        return base
    n = max(1, -(-diff // 14))
    pad = b"[" + b",".join([b"1e" + b"0" * (14 * n - diff) + b"15"] + [b"1e15"] * (n - 1)) + b"]"
    return data.replace(b'"@pad@"', pad)


@FUZZ_SETTINGS
@example(which="root", pick=3, field=0, value=1e15, spelling="same_length", kw={})
@given(
    which=st.sampled_from(["root", "child"]),
    pick=st.integers(min_value=0),
    field=st.integers(min_value=0),
    value=st.one_of(FUZZ_SCALARS, st.just(1e15)),
    spelling=st.sampled_from(["json", "1e15", "spaces", "same_length", "same_length"]),
    kw=st.sampled_from(LOAD_VARIANTS),
)
def test_repeated_fields_at_any_depth(pristine, which, pick, field, value, spelling, kw):
    """One field of any object (the level, an entry, an object in a non-tensor value) written a
    second time, with any value, in spellings that change the re-dumped length either way or
    not at all: always a MetaFormatError (orjson alone keeps the last one silently)."""
    meta = root_meta() if which == "root" else child_meta()
    meta["entries"].append({"key": "cfg", "kind": "json", "value": {"lr": 1e-3, "opt": {"name": "adam"}}})
    meta["entries"].append({"key": "pad", "kind": "json", "value": "@pad@"})
    path = _objects(meta)[pick % len(_objects(meta))]
    obj = meta
    for k in path:
        obj = obj[k]
    name = list(obj)[field % len(obj)]
    marker = "@repeat@"
    obj[marker] = value  # placed last, then renamed in the bytes: the copy comes after the original
    data = json.dumps(meta, allow_nan=True).encode("utf-8", "surrogatepass")
    data = data.replace(json.dumps(marker).encode(), json.dumps(name).encode())
    if spelling == "1e15":
        data = data.replace(b"1000000000000000.0", b"1e15")
    elif spelling == "spaces":
        data = data.replace(b", ", b",   ")
    data = _same_length_when_redumped(data) if spelling == "same_length" else data.replace(b'"@pad@"', b"[]")

    def mutate(tree):
        (tree / ("meta.json" if which == "root" else "b/meta.json")).write_bytes(data)

    _fuzz_load(pristine, mutate, kw)
    plain_json = json_problem(value) is None  # else orjson may refuse the value first
    with pytest.raises(memtree.MetaFormatError, match="repeats the field" if plain_json else None):
        parse_level(data, "meta.json")
