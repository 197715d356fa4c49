"""The format is a contract: a committed golden directory pins version 3's per-chunk checksums
byte for byte (versions 1 and 2: tests/test_golden.py; tensor subclasses:
tests/test_golden_v3_subclass.py).

The golden tree was written with 64 KiB chunks (the format's smallest, so that its files stay
small; writers record 4 MiB chunks by default) and ``checksum="crc32"``. If a test here fails,
the on-disk format changed: that needs a new format version, a docs/format.md update and a new
golden directory, never a silent edit of this one.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
import torch

import memtree
import memtree.format.chunks as chunks_mod
from memtree.store.primitives.checksums import view_sums
from treeutil import files_of, without_save_id

GOLDEN = Path(__file__).parent / "golden" / "v3-chunks"
CHUNK = 64 * 1024


def golden_tree() -> memtree.TensorTree:
    big = (torch.arange(2 * CHUNK + 1000) % 251).to(torch.uint8)  # 3 chunks, each different
    deep = torch.linspace(-1, 1, 2 * 20_000).reshape(2, 20_000)  # 160,000 bytes: 3 chunks
    return memtree.TensorTree({
        "big": big,
        "small": torch.tensor([1.5, -2.0, 3.25, 0.0]),  # one chunk: a checksum
        "plain": {"x": torch.tensor([1, -2, 3], dtype=torch.int16)},  # a level of version 2
        "deep": {"w": deep, "n": 7},
    })


def test_golden_v3_chunks_directory_loads_bit_exactly_and_verifies():
    expected = golden_tree()
    for options in ({}, {"mmap": False}):
        loaded = memtree.load_memmap(GOLDEN, mode="r", verify=True, **options)
        for key, value in expected.items(include_nested=True, leaves_only=True):
            if isinstance(value, torch.Tensor):
                assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
            else:
                assert loaded[key] == value
    report = memtree.verify_tree(GOLDEN)
    assert report.ok and report.tree_hash == "ok" and report.checksummed == report.leaves == 4


def test_writer_reproduces_the_v3_chunks_golden_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(chunks_mod, "CHUNK_BYTES", CHUNK)
    golden_tree().memmap(tmp_path / "t", checksum="crc32")
    written, golden = files_of(tmp_path / "t"), files_of(GOLDEN)
    assert sorted(written) == sorted(golden)
    for name, data in golden.items():
        if name.endswith("meta.json"):
            assert without_save_id(written[name]) == without_save_id(data), name
        else:
            assert written[name] == data, name


def test_v3_chunks_golden_pins_the_entries():
    root = orjson.loads((GOLDEN / "meta.json").read_bytes())
    assert root["version"] == 3 and root["tree_hash"].startswith("crc32:")
    by_key = {e["key"]: e for e in root["entries"]}
    big = (torch.arange(2 * CHUNK + 1000) % 251).to(torch.uint8)
    assert by_key["big"]["chunks"] == {
        "algorithm": "crc32",
        "chunk_bytes": CHUNK,
        "digests": view_sums(memoryview(big.numpy()), "crc32", CHUNK).digests,
    }
    assert len(by_key["big"]["chunks"]["digests"]) == 3 * 8 and "checksum" not in by_key["big"]
    assert "chunks" not in by_key["small"] and by_key["small"]["checksum"].startswith("crc32:")
    assert orjson.loads((GOLDEN / "plain" / "meta.json").read_bytes())["version"] == 2
    deep = orjson.loads((GOLDEN / "deep" / "meta.json").read_bytes())
    assert deep["version"] == 3 and deep["entries"][0]["chunks"]["chunk_bytes"] == CHUNK


@pytest.mark.parametrize("level", ["", "deep"])
def test_v3_chunks_golden_levels_parse_alone(level):
    from memtree.format.schema import parse_level

    meta = parse_level((GOLDEN / level / "meta.json").read_bytes(), "meta.json", depth=1 if level else 0)
    leaf = next(e for e in meta.entries if e.key in ("big", "w"))
    assert leaf.chunks is not None and leaf.chunks.count == 3
