"""safetensors: bit-exact export and lazy zero-copy import, checked against the safetensors package,
and crafted damaged headers refused with memtree errors (a fuzz of header fields: only
CheckpointFormatError escapes, and every accepted tensor reads back with its shape)."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as hst

import memtree
from memtree.interop import SafetensorsReader, open_checkpoint, save_safetensors
from memtree.interop.safetensors_file import SAFETENSORS_DTYPES, write_safetensors
from treeutil import random_tensor
from treeutil import raw_bytes as as_bytes

st = pytest.importorskip("safetensors.torch")


def every_dtype() -> dict[str, torch.Tensor]:
    out = {
        name: random_tensor((3, 5), dt, i)
        for i, (name, dt) in enumerate(SAFETENSORS_DTYPES.items())
    }
    out["scalar"] = torch.tensor(1.5)
    out["empty"] = torch.empty(0, 7, dtype=torch.float16)
    out["odd"] = random_tensor((3,), torch.int8, 99)  # odd sizes next to wider dtypes
    return out


def test_table_covers_what_safetensors_supports() -> None:
    assert {
        "F64",
        "F32",
        "F16",
        "BF16",
        "I64",
        "I32",
        "I16",
        "I8",
        "U8",
        "BOOL",
        "C64",
        "U16",
        "U32",
        "U64",
    } <= set(SAFETENSORS_DTYPES)
    assert {"F8_E4M3", "F8_E5M2", "F8_E8M0"} <= set(SAFETENSORS_DTYPES)


@pytest.mark.parametrize("mmap", [True, False])
def test_export_then_import_is_bit_exact_for_every_dtype(tmp_path: Path, mmap: bool) -> None:
    tensors = every_dtype()
    path = tmp_path / "all.safetensors"
    save_safetensors(tensors, path, metadata={"format": "pt"})
    with SafetensorsReader(path) as reader:
        assert reader.keys() == list(tensors) and reader.metadata == {"format": "pt"}
        for key, expected in tensors.items():
            got = reader.read(key, mmap=mmap)
            assert reader.spec(key) == (expected.shape, expected.dtype)
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert as_bytes(got) == as_bytes(expected), key


def test_files_memtree_writes_load_in_the_safetensors_package(tmp_path: Path) -> None:
    tensors = every_dtype()
    path = tmp_path / "m.safetensors"
    save_safetensors(tensors, path)
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(tensors)
        for key in f.keys():
            if key == "F8_E8M0":  # safetensors.torch 0.8 writes this dtype but cannot read it
                continue
            assert as_bytes(f.get_tensor(key)) == as_bytes(tensors[key]), key


def test_files_the_safetensors_package_writes_load_in_memtree(tmp_path: Path) -> None:
    tensors = {k: v for k, v in every_dtype().items() if k != "F8_E8M0"}
    path = tmp_path / "ref.safetensors"
    st.save_file(tensors, str(path), metadata={"a": "b"})
    ckpt = open_checkpoint(path)
    assert ckpt.format == "safetensors" and ckpt.metadata == {"a": "b"}
    assert set(ckpt) == set(tensors)
    for key, expected in tensors.items():
        assert ckpt.tensor_spec(key) == (expected.shape, expected.dtype)
        assert as_bytes(ckpt[key]) == as_bytes(expected), key


def test_reads_are_zero_copy_views_of_one_mapping(tmp_path: Path) -> None:
    path = tmp_path / "z.safetensors"
    save_safetensors({"a": torch.arange(8.0), "b": torch.arange(4.0)}, path)
    reader = SafetensorsReader(path)
    a, b = reader.read("a"), reader.read("b")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert a.untyped_storage().nbytes() == os.path.getsize(path)
    a.add_(1)  # copy-on-write: the file never changes through a read
    assert SafetensorsReader(path).read("a", mmap=False).tolist() == list(map(float, range(8)))


def test_tree_export_flattens_nested_keys(tmp_path: Path) -> None:
    tree = memtree.TensorTree(
        {"enc": {"0": {"w": torch.ones(2, 2)}, "b": torch.zeros(2)}, "head": torch.ones(1)}
    )
    path = tmp_path / "t.safetensors"
    memtree.save_safetensors(tree, path)
    assert sorted(st.load_file(str(path))) == ["enc.0.w", "enc.b", "head"]


def test_export_refuses_what_safetensors_cannot_hold(tmp_path: Path) -> None:
    with pytest.raises(memtree.DtypeError, match="complex128"):
        save_safetensors({"z": torch.zeros(2, dtype=torch.complex128)}, tmp_path / "z.safetensors")
    tree = memtree.TensorTree({"w": torch.ones(1), "note": "hello"})
    with pytest.raises(memtree.NonTensorValueError, match="note"):
        save_safetensors(tree, tmp_path / "n.safetensors")
    with pytest.raises(memtree.KeyCollisionError):
        save_safetensors(
            {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}}, tmp_path / "c.safetensors"
        )
    assert not list(tmp_path.iterdir())  # nothing half-written, no temporary file left


def test_existing_file_is_kept_unless_existsok(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_safetensors({"a": torch.ones(1)}, path)
    with pytest.raises(memtree.DestinationExistsError):
        save_safetensors({"a": torch.zeros(1)}, path)
    assert SafetensorsReader(path).read("a").item() == 1.0
    save_safetensors({"a": torch.zeros(1)}, path, existsok=True)
    assert SafetensorsReader(path).read("a").item() == 0.0


def test_a_failing_producer_leaves_no_file(tmp_path: Path) -> None:
    def produce(key: str) -> torch.Tensor:
        if key == "b":
            raise RuntimeError("source went away")
        return torch.ones(4)

    with pytest.raises(RuntimeError, match="went away"):
        write_safetensors(
            tmp_path / "f.safetensors",
            [("a", (4,), torch.float32), ("b", (4,), torch.float32)],
            produce,
        )
    assert not list(tmp_path.iterdir())
    with pytest.raises(memtree.CheckpointFormatError, match="header says"):
        write_safetensors(
            tmp_path / "g.safetensors", [("a", (3,), torch.float32)], lambda k: torch.ones(4)
        )
    assert not list(tmp_path.iterdir())


# -- crafted, damaged files --------------------------------------------------------------------
def craft(path: Path, header: dict | bytes, data: bytes, *, size: int | None = None) -> Path:
    blob = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob) if size is None else size) + blob + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


BAD_HEADERS = {
    "overlapping offsets": (
        {"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)},
        12,
        "overlaps",
    ),
    "out-of-range offsets": ({"a": entry("F32", [4], 0, 16)}, 8, "out of range"),
    "offsets beyond any file": ({"a": entry("U8", [2], 2**62, 2**62 + 2)}, 8, "out of range"),
    "a hole in the data": (
        {"a": entry("F32", [1], 0, 4), "b": entry("F32", [1], 8, 12)},
        12,
        "no tensor",
    ),
    "trailing bytes": ({"a": entry("F32", [1], 0, 4)}, 12, "after the last tensor"),
    "size does not match shape": ({"a": entry("F32", [3], 0, 8)}, 8, "needs 12"),
    "end before begin": ({"a": entry("U8", [0], 4, 0)}, 4, "data_offsets"),
    "unknown dtype": ({"a": entry("F128", [1], 0, 16)}, 16, "unknown dtype"),
    "negative shape": ({"a": entry("U8", [-1], 0, 0)}, 0, "shape"),
    "float offset": (
        {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0.0, 1]}},
        1,
        "data_offsets",
    ),
    "extra field": ({"a": {**entry("U8", [1], 0, 1), "x": 1}}, 1, "exactly"),
    "metadata not str": ({"__metadata__": {"a": 1}}, 0, "__metadata__"),
    "top level list": (b"[1, 2]", 0, "JSON object"),
    "not JSON": (b"{oops", 0, "JSON"),
    "duplicate keys": (
        b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, '
        b'"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
        1,
        "repeats",
    ),
    # no element, but dims torch cannot take: accepted before, then a raw TypeError on read
    "zero and 2**64-1": ({"a": entry("F32", [0, 2**64 - 1], 0, 0)}, 0, "beyond any tensor"),
    "zero and 2**63": ({"a": entry("U8", [4, 0, 2**63], 0, 0)}, 0, "beyond any tensor"),
    "zero and 2**63-1": ({"a": entry("F32", [0, 2**63 - 1], 0, 0)}, 0, "beyond any tensor"),
    "zero, strides overflow": ({"a": entry("U8", [0, 2**62, 2**62], 0, 0)}, 0, "beyond any tensor"),
    # nested deeper than a header can be: a raw RecursionError before
    "deep metadata": (b'{"__metadata__": ' + b"[" * 1000 + b"]" * 1000 + b"}", 0, "nests JSON"),
    "deep shape": ({"a": entry("U8", [[[[1]]]], 0, 1)}, 1, "nests JSON"),
    "deep entry": (b'{"a": ' + b'{"b": ' * 990 + b"1" + b"}" * 990 + b"}", 0, "nests JSON"),
    "deep and too deep for orjson": (b"[" * 5000 + b"]" * 5000, 0, "JSON"),
}


@pytest.mark.parametrize("case", list(BAD_HEADERS))
def test_damaged_header_gives_a_memtree_error(tmp_path: Path, case: str) -> None:
    header, data_len, message = BAD_HEADERS[case]
    path = craft(tmp_path / "bad.safetensors", header, b"\x00" * data_len)
    with pytest.raises(memtree.CheckpointFormatError, match=message):
        SafetensorsReader(path)
    with pytest.raises(memtree.CheckpointFormatError):
        open_checkpoint(path)


def test_overlapping_offsets_are_also_refused_by_the_package(tmp_path: Path) -> None:
    header, data_len, _ = BAD_HEADERS["overlapping offsets"]
    path = craft(tmp_path / "bad.safetensors", header, b"\x00" * data_len)
    from safetensors import SafetensorError

    with pytest.raises(SafetensorError):  # the reference loader agrees the file is invalid
        st.load_file(str(path))


def test_header_size_beyond_the_file_or_the_limit(tmp_path: Path) -> None:
    path = craft(tmp_path / "h.safetensors", {"a": entry("U8", [1], 0, 1)}, b"\x00", size=10_000)
    with pytest.raises(memtree.CheckpointFormatError, match="truncated"):
        SafetensorsReader(path)
    path = craft(tmp_path / "h.safetensors", b"{}", b"", size=2**40)
    with pytest.raises(memtree.CheckpointFormatError, match="header claims"):
        SafetensorsReader(path)
    (tmp_path / "tiny.safetensors").write_bytes(b"\x01\x00")
    with pytest.raises(memtree.CheckpointFormatError):
        open_checkpoint(tmp_path / "tiny.safetensors")


@pytest.mark.parametrize("keep", [0.2, 0.5, 0.9])
def test_truncated_file_gives_a_memtree_error(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "t.safetensors"
    save_safetensors({"a": torch.randn(64), "b": torch.randn(64)}, path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(memtree.CheckpointFormatError):
        SafetensorsReader(path)


# -- fuzz: header fields -------------------------------------------------------------------------
DIMS = [0, 0, 1, 2, 3, 2**31, 2**60, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -1]
HEADER_VALUES = hst.one_of(
    hst.integers(min_value=-2, max_value=2**65),
    hst.sampled_from(["F32", "U8", "BOOL", "F8_E8M0", "C64", "F128", "", None, True, 1.5]),
    hst.lists(hst.sampled_from(DIMS), max_size=4),
    hst.lists(hst.integers(min_value=0, max_value=64), max_size=3),
    hst.builds("@deep:{}@".format, hst.sampled_from([3, 4, 100, 300, 990, 1000, 1100])),
)


def _header(entries: dict) -> bytes:
    data = json.dumps(entries).encode()
    return re.sub(rb'"@deep:(\d+)@"', lambda m: b"[" * int(m[1]) + b"]" * int(m[1]), data)


@settings(max_examples=300, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(key="b", field="shape", value=[0, 2**64 - 1], data_len=8)
@example(key="b", field="shape", value=[4, 0, 2**63], data_len=8)
@example(key="__metadata__", field="x", value="@deep:1000@", data_len=8)
@given(
    key=hst.sampled_from(["a", "b", "__metadata__"]),
    field=hst.sampled_from(["dtype", "shape", "data_offsets", "x"]),
    value=HEADER_VALUES,
    data_len=hst.sampled_from([0, 8, 16, 24]),
)
def test_fuzz_header_fields(tmp_path: Path, key: str, field: str, value: object, data_len: int) -> None:
    """One field of a valid two-tensor header set to an edge value: the reader raises
    CheckpointFormatError or gives every tensor with its declared shape and bytes."""
    header = {"a": entry("F32", [2], 0, 8), "b": entry("U8", [0, 4], 8, 8)}
    if key == "__metadata__":
        header["__metadata__"] = {field: value}
    else:
        header[key][field] = value
    path = craft(tmp_path / "f.safetensors", _header(header), bytes(range(data_len)))
    try:
        reader = SafetensorsReader(path)
    except memtree.CheckpointFormatError:
        return
    with reader:
        for k in reader.keys():
            for mmap in (True, False):
                t = reader.read(k, mmap=mmap)
                assert t.shape == reader.spec(k)[0] and t.dtype == reader.spec(k)[1]
                assert t.reshape(-1).view(torch.uint8).numel() == reader.entry(k).end - reader.entry(k).begin
