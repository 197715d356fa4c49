"""The format is a contract: committed golden directories pin versions 1 and 2 byte for byte.

If one of these tests fails, the on-disk format changed. That needs a new format version, a
docs/format.md update and a new golden directory, never a silent edit of this one.
"""

import os
from pathlib import Path

import orjson
import pytest
import torch

import memtree
from memtree.format.schema import parse_level
from memtree.store.reading.integrity import tree_hash

GOLDEN = Path(__file__).parent / "golden" / "v1"
GOLDEN_V2 = Path(__file__).parent / "golden" / "v2"


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
    doc.pop("tree_hash", None)  # a hash over the save_id too
    return doc


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_V2], ids=["v1", "v2"])
def test_golden_directory_loads_bit_exactly(golden):
    loaded = memtree.load_memmap(golden, mode="r", verify=True)
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


def test_golden_verify_reports():
    v1, v2 = memtree.verify_tree(GOLDEN), memtree.verify_tree(GOLDEN_V2)
    assert v1.ok and v1.checksummed == 0 and v1.tree_hash == "absent"
    assert v2.ok and v2.checksummed == v2.leaves == 6 and v2.tree_hash == "ok"


def test_writer_reproduces_the_v2_golden_directory_byte_for_byte(tmp_path):
    golden_tree().memmap(tmp_path / "t", checksum="crc32")
    written = files_of(tmp_path / "t")
    golden = files_of(GOLDEN_V2)
    assert sorted(written) == sorted(golden)
    for name, data in golden.items():
        if name == "meta.json":
            doc = orjson.loads(written[name])
            assert doc["save_id"] != "0" * 32  # a fresh id per save
            assert without_save_id(written[name]) == without_save_id(data)
            assert len(written[name]) == len(data)
            # the tree hash covers the save id: with the golden's id, the golden's hash
            metas = {"": parse_level(data, name)}
            metas["nested"] = parse_level(golden["nested/meta.json"], "nested")
            assert tree_hash("crc32", metas, {}) == orjson.loads(data)["tree_hash"] == "crc32:c48d774f"
            metas[""] = parse_level(written[name], name)
            assert tree_hash("crc32", metas, {}) == doc["tree_hash"]
        else:
            assert written[name] == data, name


def test_without_checksums_the_writer_writes_v1_files_as_version_2(tmp_path):
    golden_tree().memmap(tmp_path / "t", checksum=None)
    written, golden = files_of(tmp_path / "t"), files_of(GOLDEN)
    assert sorted(written) == sorted(golden)
    for name, data in golden.items():
        if name.endswith("meta.json"):
            assert {**without_save_id(data), "version": 2} == without_save_id(written[name])
        else:
            assert written[name] == data, name


def test_golden_escaped_key_file_name_is_pinned():
    assert (GOLDEN / "%2E.%2Fodd%20key.memmap").read_bytes() == bytes([1, 2])
    assert (GOLDEN / "nested" / "empty.memmap").stat().st_size == 0


def test_v2_golden_leaf_checksums_are_pinned():
    doc = orjson.loads((GOLDEN_V2 / "meta.json").read_bytes())
    assert {e["key"]: e.get("checksum") for e in doc["entries"]}["obs"] == "crc32:91e79017"
