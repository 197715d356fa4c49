"""The format is a contract: a committed golden directory pins version 3's tensor subclass groups,
DTensor annotations and new dtypes byte for byte (versions 1 and 2: tests/test_golden.py).

If a test here fails, the on-disk format changed: that needs a new format version, a
docs/format.md update and a new golden directory, never a silent edit of this one.
"""

from __future__ import annotations

import os
from pathlib import Path

import orjson
import torch

import memtree
from memtree.format.level import Level
from memtree.format.subclass import DTensorLayout, Placement
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import write_tree
from subclassutil import Cfg, Mode, ScaledInt8, Span, Wrapped, same_subclass

GOLDEN = Path(__file__).parent / "golden" / "v3-subclass"


def golden_tree() -> memtree.TensorTree:
    ctx = {"cfg": Cfg(Mode.SYMMETRIC, (1, 4)), "span": Span(0, 4), "dtype": torch.bfloat16,
           "size": torch.Size([2, 2]), "device": torch.device("cpu"), "inf": float("inf"), "tuple": (1, [2])}
    w = ScaledInt8(torch.tensor([-128, -1, 0, 127], dtype=torch.int8), 0.5, ctx)
    return memtree.TensorTree({
        "layer": {"weight": w, "bias": torch.tensor([1.5, -2.0])},
        "nested": Wrapped(ScaledInt8(torch.tensor([1, 2], dtype=torch.int8), 0.25, None), "tag"),
        "fp4": torch.tensor([0x12, 0xF0], dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "int4": torch.tensor([7, 8], dtype=torch.uint8).view(torch.int4),
    })


def golden_level() -> Level:
    """The tree, plus a leaf annotated as a DTensor's full tensor (a mesh of 2 x 2)."""
    level = golden_tree()._to_level()
    level.entries["sharded"] = torch.arange(8, dtype=torch.int16).reshape(2, 4)
    level.layouts["sharded"] = DTensorLayout((2, 2), (Placement("shard", 0), Placement("replicate")), ("dp", "tp"))
    return level


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def without_save_id(data: bytes) -> dict:
    doc = orjson.loads(data)
    doc.pop("save_id", None)
    doc.pop("tree_hash", None)
    return doc


def test_golden_v3_directory_loads_bit_exactly_and_verifies():
    loaded = memtree.load_memmap(GOLDEN, mode="r", verify=True)
    expected = golden_tree()
    assert same_subclass(loaded["layer", "weight"], expected["layer", "weight"])
    ctx = loaded["layer", "weight"].cfg
    assert ctx["cfg"] == Cfg(Mode.SYMMETRIC, (1, 4)) and ctx["span"] == Span(0, 4) and ctx["inf"] == float("inf")
    assert ctx["size"] == torch.Size([2, 2]) and ctx["tuple"] == (1, [2]) and ctx["dtype"] is torch.bfloat16
    assert type(loaded["nested"]) is Wrapped and same_subclass(loaded["nested"], expected["nested"])
    for key in ("fp4", "int4"):
        assert loaded[key].dtype == expected[key].dtype
        assert loaded[key].view(torch.uint8).tolist() == expected[key].view(torch.uint8).tolist()
    assert loaded["sharded"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    report = memtree.verify_tree(GOLDEN)
    assert report.ok and report.tree_hash == "ok" and report.checksummed == report.leaves == 6


def test_writer_reproduces_the_v3_golden_directory(tmp_path):
    write_tree(tmp_path / "t", golden_level(), WriteOptions.of(checksum="crc32"))
    written, golden = files_of(tmp_path / "t"), files_of(GOLDEN)
    assert sorted(written) == sorted(golden)
    for name, data in golden.items():
        if name == "meta.json":
            assert without_save_id(written[name]) == without_save_id(data)
        else:
            assert written[name] == data, name


def test_v3_golden_pins_the_entries():
    root = orjson.loads((GOLDEN / "meta.json").read_bytes())
    assert root["version"] == 3
    by_key = {e["key"]: e for e in root["entries"]}
    assert by_key["nested"]["kind"] == "subclass" and by_key["nested"]["type"] == "tests.Wrapped"
    assert by_key["sharded"]["dtensor"] == {
        "mesh": [2, 2], "placements": [{"kind": "shard", "dim": 0}, {"kind": "replicate"}], "dim_names": ["dp", "tp"]
    }
    assert sorted(os.listdir(GOLDEN / "nested")) == ["inner", "meta.json"]
    assert orjson.loads((GOLDEN / "nested" / "meta.json").read_bytes())["entries"][0]["kind"] == "subclass"
