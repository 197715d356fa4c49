"""Checksums on by default, the root's ``tree_hash``, and what in-place writes do to them."""

from __future__ import annotations

import dataclasses
import os
import random
import time

import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memtree
from memtree import IntegrityError, MemtreeError, TensorTree, verify_tree
from memtree.errors import MetaFormatError
from memtree.format.schema import VERSION, LevelMeta, dump_level, parse_level
from memtree.store.primitives import checksums
from memtree.store.primitives.checksums import available_checksums, default_checksum, tensor_checksum
from memtree.store.reading.integrity import tree_hash
from treeutil import raw_bytes


def _meta(path) -> dict:
    return orjson.loads((path / "meta.json").read_bytes())


def _flip(path, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(bit // 8)
        byte = f.read(1)[0]
        f.seek(bit // 8)
        f.write(bytes([byte ^ (1 << (bit % 8))]))


# -- algorithms ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algorithm, digest",
    [
        ("crc32", "352441c2"),
        ("crc32c", "364b3fb7"),
        ("xxh3", "78af5f94892f3950"),
        ("sha256", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
    ],
)
def test_known_answers(algorithm, digest):
    if algorithm not in available_checksums():
        pytest.skip(f"{algorithm} is not installed")
    assert tensor_checksum(torch.frombuffer(bytearray(b"abc"), dtype=torch.uint8), algorithm) == f"{algorithm}:{digest}"


def test_default_is_the_fastest_installed(monkeypatch):
    assert default_checksum() == next(a for a in ("xxh3", "crc32c", "crc32") if a in available_checksums())
    monkeypatch.setattr(checksums, "_FACTORIES", {k: v for k, v in checksums._FACTORIES.items() if k != "xxh3"})
    assert default_checksum() == ("crc32c" if "crc32c" in checksums._FACTORIES else "crc32")
    monkeypatch.setattr(checksums, "_FACTORIES", {k: v for k, v in checksums._FACTORIES.items() if k != "crc32c"})
    assert default_checksum() == "crc32"
    with pytest.raises(memtree.InvalidArgumentError, match="fast-checksums"):
        TensorTree({"a": torch.ones(2)}).memmap("/nonexistent/never", checksum="xxh3")


@pytest.mark.parametrize("algorithm", ["crc32", "sha256", "crc32c", "xxh3"])
def test_every_algorithm_round_trips_and_verifies(tmp_path, algorithm):
    if algorithm not in available_checksums():
        pytest.skip(f"{algorithm} is not installed")
    tree = TensorTree({"a": torch.randn(1000), "b": {"c": torch.arange(7)}, "v": "x"})
    tree.memmap(tmp_path / "t", checksum=algorithm, num_threads=2)
    meta = _meta(tmp_path / "t")
    assert meta["version"] == VERSION == 2 and meta["tree_hash"].startswith(algorithm + ":")
    assert meta["entries"][0]["checksum"] == tensor_checksum(tree["a"], algorithm)
    report = verify_tree(tmp_path / "t")
    assert report.ok and report.checksummed == 2 and report.tree_hash == "ok"
    memtree.load_memmap(tmp_path / "t", verify=True, mmap=False)


def test_checksums_are_on_by_default_and_can_be_turned_off(tmp_path):
    tree = TensorTree({"a": torch.ones(3), "b": {"c": torch.zeros(2)}})
    tree.memmap(tmp_path / "on")
    assert _meta(tmp_path / "on")["entries"][0]["checksum"].startswith(default_checksum() + ":")
    assert _meta(tmp_path / "on")["tree_hash"].startswith(default_checksum() + ":")
    tree.memmap(tmp_path / "off", checksum=None)
    meta = _meta(tmp_path / "off")
    assert "tree_hash" not in meta and "checksum" not in meta["entries"][0]
    report = verify_tree(tmp_path / "off")
    assert report.ok and report.checksummed == 0 and report.tree_hash == "absent"
    tree.memmap_like(tmp_path / "like")
    assert "tree_hash" not in _meta(tmp_path / "like")
    assert "checksum" not in _meta(tmp_path / "like" / "b")["entries"][0]


def test_the_tree_hash_covers_keys_dtypes_shapes_values_and_pickles(tmp_path):
    base = {"a": torch.zeros(4), "b": {"c": torch.zeros(2, dtype=torch.int32)}, "v": {"lr": 0.1}}
    variants = [
        base,
        {**base, "a": torch.zeros(4).view(2, 2)},  # same bytes, another shape
        {**base, "a": torch.zeros(4, dtype=torch.int32)},  # same bytes, another dtype
        {"a2": base["a"], "b": base["b"], "v": base["v"]},  # another key
        {**base, "v": {"lr": 0.2}},  # another value
        {**base, "b": {"c": torch.ones(2, dtype=torch.int32)}},  # another leaf's bytes
    ]
    hashes = set()
    for i, v in enumerate(variants):
        TensorTree(v).memmap(tmp_path / str(i), checksum="sha256")
        metas = {}
        for rel in ("", "b", "v"):
            metas[rel] = parse_level((tmp_path / str(i) / rel / "meta.json").read_bytes(), rel)
        metas[""] = dataclasses.replace(metas[""], save_id="0" * 32)  # the same save id
        hashes.add(tree_hash("sha256", metas, {}))
    assert len(hashes) == len(variants)
    # a pickled value's bytes are covered too
    TensorTree({"p": memtree.NonTensor({1, 2})}).memmap(tmp_path / "p", allow_pickle=True)
    assert verify_tree(tmp_path / "p").tree_hash == "ok"
    memtree.load_memmap(tmp_path / "p", verify=True, allow_pickle=True)
    _flip(next((tmp_path / "p").glob("*.pickle")), 3)
    report = verify_tree(tmp_path / "p")
    assert [p.kind for p in report.problems] == ["tree-hash"] and report.tree_hash == "mismatch"
    with pytest.raises(IntegrityError, match="tree_hash"):
        memtree.load_memmap(tmp_path / "p", verify=True, allow_pickle=True)


def test_schema_accepts_tree_hash_only_at_a_version_2_root():
    root = dump_level(LevelMeta((), (), tree_hash="crc32:00000000"))
    assert parse_level(root, "m").tree_hash == "crc32:00000000"
    with pytest.raises(MetaFormatError, match="tree_hash"):
        parse_level(root, "m", depth=1)
    with pytest.raises(MetaFormatError, match="tree_hash"):
        parse_level(root.replace(b'"version":2', b'"version":1'), "m")
    for bad in ("crc32:0000000", "md5:00000000", "crc32:0000000G", 5, None):
        doc = {**orjson.loads(root), "tree_hash": bad}
        with pytest.raises(MetaFormatError, match="tree_hash"):
            parse_level(orjson.dumps(doc), "m")
    # version 1 files keep loading
    v1 = root.replace(b'"version":2', b'"version":1').replace(b',"tree_hash":"crc32:00000000"', b"")
    assert parse_level(v1, "m") == LevelMeta((), ())


# -- 1,000 single-bit flips ------------------------------------------------------------------------


def _many_small_leaves(path, algorithm):
    g = torch.Generator().manual_seed(0)
    tree = TensorTree({
        f"l{i}": torch.randint(0, 256, (16 + i,), dtype=torch.uint8, generator=g) for i in range(12)
    } | {"sub": {f"m{i}": torch.randn(3 + i, generator=g) for i in range(4)}, "cfg": {"lr": 0.5}})
    tree.memmap(path, checksum=algorithm)
    leaves = sorted(p for p in path.rglob("*.memmap"))
    return leaves


@pytest.mark.parametrize("algorithm", ["default", "crc32"])
def test_every_single_bit_flip_in_a_leaf_is_detected(tmp_path, algorithm):
    algorithm = default_checksum() if algorithm == "default" else algorithm
    flips = 1000 if algorithm == default_checksum() else 200
    leaves = _many_small_leaves(tmp_path / "t", algorithm)
    rng = random.Random(1234)
    for _ in range(flips):
        leaf = rng.choice(leaves)
        bit = rng.randrange(leaf.stat().st_size * 8)
        st = leaf.stat()
        _flip(leaf, bit)
        os.utime(leaf, ns=(st.st_atime_ns, st.st_mtime_ns))  # damage, not a write: no new mtime
        report = verify_tree(tmp_path / "t")
        assert [p.kind for p in report.problems] == ["checksum"], (leaf, bit)
        with pytest.raises(IntegrityError, match="is damaged"):
            memtree.load_memmap(tmp_path / "t", verify=True, mode="r")
        _flip(leaf, bit)
        os.utime(leaf, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert verify_tree(tmp_path / "t").ok


def test_every_single_bit_flip_in_a_meta_json_is_detected(tmp_path):
    _many_small_leaves(tmp_path / "t", default_checksum())
    metas = [tmp_path / "t" / "meta.json", tmp_path / "t" / "sub" / "meta.json"]
    rng = random.Random(99)
    for _ in range(300):
        meta = rng.choice(metas)
        bit = rng.randrange(meta.stat().st_size * 8)
        _flip(meta, bit)
        assert not verify_tree(tmp_path / "t").ok, (meta, bit)
        with pytest.raises(MemtreeError):
            memtree.load_memmap(tmp_path / "t", verify=True, mode="r")
        _flip(meta, bit)
    assert verify_tree(tmp_path / "t").ok


# -- in-place writes: checksums never silently wrong -----------------------------------------------


def _after_a_tick() -> None:
    time.sleep(0.05)  # file times have a clock tick's granularity: the write is then strictly later


def test_growth_drops_the_checksums_it_changes_and_the_tree_hash(tmp_path):
    d = tmp_path / "buf"
    buf = TensorTree({"x": torch.zeros(2, 3), "s": {"y": torch.ones(2)}}, batch_size=[2]).memmap(d)
    assert "tree_hash" in _meta(d)
    for grow in (
        lambda t: t.append_({"x": torch.ones(3), "s": {"y": torch.zeros(())}}),
        lambda t: t.extend_(TensorTree({"x": torch.ones(5, 3), "s": {"y": torch.zeros(5)}}, batch_size=[5])),
        lambda t: t.resize_(4),  # a shrink: new generations
        lambda t: t.resize_(40),
    ):
        grow(buf)
        assert "tree_hash" not in _meta(d)
        assert all("checksum" not in e for e in _meta(d)["entries"] + _meta(d / "s")["entries"])
        report = verify_tree(d)
        assert report.ok and report.checksummed == 0 and report.tree_hash == "absent"
        memtree.load_memmap(d, verify=True)
    buf.memmap_(d, copy_existing=True)  # a re-save records them again
    assert verify_tree(d).tree_hash == "ok" and verify_tree(d).checksummed == 2


def test_growth_of_one_level_keeps_the_other_checksums_and_drops_the_hash(tmp_path):
    d = tmp_path / "buf"
    buf = TensorTree({"x": torch.zeros(2, 3)}, batch_size=[2]).memmap(d)
    buf.append_({"x": torch.ones(3)})
    assert "tree_hash" not in _meta(d) and verify_tree(d).ok


@pytest.mark.parametrize("how", ["setitem", "row", "inplace_op", "tree_setitem"])
def test_writes_through_a_mapping_are_reported_stale_not_corrupt(tmp_path, how):
    d = tmp_path / "t"
    TensorTree({"x": torch.zeros(4, 3), "s": {"y": torch.zeros(4)}}, batch_size=[4]).memmap(d)
    tree = memtree.load_memmap(d, mode="r+")
    _after_a_tick()
    if how == "setitem":
        tree["x"][1:3] = 7.0
    elif how == "row":
        tree["s", "y"][2] = 5.0
    elif how == "inplace_op":
        tree["x"].add_(1)
    else:
        tree[1] = TensorTree({"x": torch.ones(3), "s": {"y": torch.ones(())}})
    del tree
    report = verify_tree(d)
    assert report.problems and {p.kind for p in report.problems} == {"stale"}
    assert all("written in place" in p.message for p in report.problems)
    with pytest.raises(IntegrityError, match="cannot be verified"):
        memtree.load_memmap(d, verify=True)
    assert memtree.load_memmap(d)["x"].shape == (4, 3)  # without verify it loads as before


def test_memmap_into_an_existing_tree_records_new_checksums(tmp_path):
    d = tmp_path / "t"
    tree = TensorTree({"x": torch.zeros(4)}).memmap(d)
    tree["x"][0] = 1.0
    tree.memmap_(d)  # written again from its own (mapped) leaves
    assert verify_tree(d).ok and verify_tree(d).tree_hash == "ok"
    assert raw_bytes(memtree.load_memmap(d, verify=True)["x"]) == raw_bytes(torch.tensor([1.0, 0, 0, 0]))


def test_cli_verify_reports_the_tree_hash_and_stale_leaves(tmp_path, capsys):
    from memtree.cli.main import main

    d = tmp_path / "t"
    TensorTree({"x": torch.zeros(4), "s": {"y": torch.zeros(2)}}).memmap(d)
    assert main(["verify", str(d)]) == 0
    assert "2 checksums compared, tree hash matches" in capsys.readouterr().out
    assert main(["verify", "--json", str(d)]) == 0
    assert orjson.loads(capsys.readouterr().out)["tree_hash"] == "ok"
    tree = memtree.load_memmap(d)
    _after_a_tick()
    tree["x"][0] = 1.0
    assert main(["verify", str(d)]) == 1
    out = capsys.readouterr().out
    assert "[key x] stale:" in out and "tree hash matches" in out


# -- combining CRCs (the checksum of a file from its pieces, checked by several processes) --------


def _crc(algorithm: str, data: bytes) -> int:
    digest = checksums.new_digest(algorithm)
    digest.update(data)
    return int(digest.hexdigest(), 16)


@settings(max_examples=200, deadline=None)
@given(a=st.binary(max_size=300), b=st.binary(max_size=300),
       algorithm=st.sampled_from([a for a in checksums.COMBINABLE if a in available_checksums()]))
def test_property_crc_combine_and_shifter_agree_with_the_whole(a: bytes, b: bytes, algorithm: str) -> None:
    whole = _crc(algorithm, a + b)
    assert checksums.crc_combine(algorithm, _crc(algorithm, a), _crc(algorithm, b), len(b)) == whole
    assert checksums.crc_shifter(algorithm, len(b))(_crc(algorithm, a)) ^ _crc(algorithm, b) == whole
