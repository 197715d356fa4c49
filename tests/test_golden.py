"""The format is a contract: a committed golden directory pins version 1 byte for byte.

If one of these tests fails, the on-disk format changed. That needs a new format version, a
docs/format.md update and a new golden directory, never a silent edit of this one.
"""

import os
from pathlib import Path

import orjson
import torch

import memtree

GOLDEN = Path(__file__).parent / "golden" / "v1"


def golden_tree() -> memtree.TensorTree:
    return memtree.TensorTree(
        {
            "obs": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
            "flag": torch.tensor([True, False]),
            "nested": {"step": torch.tensor([7, 8], dtype=torch.int64), "empty": torch.zeros(2, 0)},
            "../odd key": torch.tensor([1, 2], dtype=torch.uint8),
            "name": "golden",
            "cfg": memtree.NonTensor({"lr": 0.1, "layers": [1, 2]}),
        },
        batch_size=[2],
    )


def files_of(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            out[str(path.relative_to(root))] = path.read_bytes()
    return out


def without_save_id(data: bytes) -> dict:
    doc = orjson.loads(data)
    doc.pop("save_id", None)
    return doc


def test_golden_directory_loads_bit_exactly():
    loaded = memtree.load_memmap(GOLDEN, mode="r")
    expected = golden_tree()
    assert loaded.keys(include_nested=True) == expected.keys(include_nested=True)
    for key, value in expected.items(include_nested=True, leaves_only=True):
        got = loaded[key]
        if isinstance(value, torch.Tensor):
            assert got.dtype == value.dtype and got.shape == value.shape
            assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), key
        else:
            assert got == value, key
    assert loaded.batch_size == torch.Size([2])


def test_writer_reproduces_the_golden_directory_byte_for_byte(tmp_path):
    golden_tree().memmap(tmp_path / "t")
    written = files_of(tmp_path / "t")
    golden = files_of(GOLDEN)
    assert sorted(written) == sorted(golden)
    for name, data in golden.items():
        if name == "meta.json":
            assert orjson.loads(written[name])["save_id"] != "0" * 32  # a fresh id per save
            assert without_save_id(written[name]) == without_save_id(data)
            assert len(written[name]) == len(data)
        else:
            assert written[name] == data, name


def test_golden_escaped_key_file_name_is_pinned():
    assert (GOLDEN / "%2E.%2Fodd%20key.memmap").read_bytes() == bytes([1, 2])
    assert (GOLDEN / "nested" / "empty.memmap").stat().st_size == 0
