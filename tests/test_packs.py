"""Packs of small leaves (format version 3, issue 28): what is on disk, what loads, what stays
true of every operation on a tree (written in place, grown, linked, verified, diffed, sent to
other processes, loaded remotely, exported), and what a hostile ``meta.json`` cannot do."""

from __future__ import annotations

import json
import os
import pickle
import stat
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import orjson
import pytest
import torch

import memtree
from memtree import MetaFormatError, TensorTree
from memtree.format import packs as packs_mod
from memtree.format.packs import PACK_ALIGN, PACK_BELOW, PACK_MIN_LEAVES, layout_packs
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import WriteStats, write_tree
from treeutil import fingerprint, random_tensor, raw_bytes

DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
    torch.bfloat16, torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
]


def many(n: int = 100, groups: int = 4, size: int = 16, seed: int = 0) -> TensorTree:
    """``n`` float32 leaves of ``size`` elements in ``groups`` sub-trees."""
    g = torch.Generator().manual_seed(seed)
    return TensorTree({
        f"g{i}": {f"x{j}": torch.randn(size, generator=g) for j in range(n // groups)} for i in range(groups)
    })


def files_below(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def meta(path: Path) -> dict:
    return orjson.loads((path / "meta.json").read_bytes())


def packed_tree(tmp_path: Path, tree: TensorTree | None = None, **kw) -> tuple[TensorTree, Path]:
    tree = tree if tree is not None else many()
    d = tmp_path / "t"
    tree.memmap(d, **kw)
    return tree, d


# ---------------------------------------------------------------------------------------------
# the layout


def test_small_leaves_share_one_pack_per_64_mib_and_a_meta_json_per_level(tmp_path):
    tree = TensorTree({f"g{i}": {f"x{j}": torch.randn(1024) for j in range(100)} for i in range(50)})
    tree["big"] = torch.randn(64 * 1024)  # 256 KiB: its own file
    tree.memmap(tmp_path / "t")
    names = files_below(tmp_path / "t")
    levels = 51
    assert len(names) == levels + 1 + 1  # a meta.json per level, one pack (20 MB), the big leaf
    assert "~pack-0.memmap" in names and "big.memmap" in names
    root = meta(tmp_path / "t")
    assert root["version"] == 3 and root["packs"] == [{"file": "~pack-0.memmap", "nbytes": 5000 * 4096}]
    leaf = meta(tmp_path / "t" / "g7")["entries"][3]
    assert leaf == {"key": "x3", "kind": "tensor", "pack": "~pack-0.memmap", "offset": (7 * 100 + 3) * 4096,
                    "dtype": "float32", "shape": [1024], "checksum": leaf["checksum"]}
    assert (memtree.load_memmap(tmp_path / "t") == tree).all()


def test_packs_hold_at_most_64_mib_each(tmp_path):
    layout = layout_packs([40 << 20, 30 << 20, 1, 0, 64 << 20, 3])
    assert layout.sizes == [("~pack-0.memmap", 40 << 20), ("~pack-1.memmap", (30 << 20) + 64),
                            ("~pack-2.memmap", 64 << 20), ("~pack-3.memmap", 64)]
    assert all(o % PACK_ALIGN == 0 for _, o in layout.places)


def test_the_default_packs_only_trees_with_many_small_leaves(tmp_path):
    few = many(PACK_MIN_LEAVES - 1, groups=1)
    few.memmap(tmp_path / "few")
    assert "~pack-0.memmap" not in os.listdir(tmp_path / "few")
    assert meta(tmp_path / "few")["version"] == 2 and meta(tmp_path / "few" / "g0")["version"] == 2
    enough = many(PACK_MIN_LEAVES, groups=1)
    enough.memmap(tmp_path / "enough")
    assert sorted(os.listdir(tmp_path / "enough")) == ["g0", "meta.json", "~pack-0.memmap"]
    big = TensorTree({f"x{i}": torch.zeros(PACK_BELOW // 4) for i in range(100)})  # 64 KiB each: not under
    big.memmap(tmp_path / "big")
    assert "~pack-0.memmap" not in os.listdir(tmp_path / "big")


def test_pack_below_0_writes_todays_layout_byte_for_byte(tmp_path):
    tree = many()
    tree.memmap(tmp_path / "a", pack_below=0, checksum="crc32")
    names = files_below(tmp_path / "a")
    assert len(names) == 100 + 5 and not any("~pack" in n for n in names)
    assert all(meta(tmp_path / "a" / d)["version"] == 2 for d in ["", "g0", "g3"])


def test_an_explicit_pack_below_packs_even_a_few_leaves_and_levels_without_them_stay_version_2(tmp_path):
    tree = TensorTree({"a": torch.ones(3), "sub": {"big": torch.zeros(1000)}, "plain": {"n": "x"}})
    tree.memmap(tmp_path / "t", pack_below=100)
    assert sorted(os.listdir(tmp_path / "t")) == ["meta.json", "plain", "sub", "~pack-0.memmap"]
    assert meta(tmp_path / "t")["version"] == 3
    assert meta(tmp_path / "t" / "sub")["version"] == 2 and meta(tmp_path / "t" / "plain")["version"] == 2
    assert os.path.getsize(tmp_path / "t" / "~pack-0.memmap") == PACK_ALIGN


@pytest.mark.parametrize("value", [-1, 1.5, True, "64k", 64 * 1024 * 1024 + 1])
def test_a_bad_pack_below_is_refused(tmp_path, value):
    with pytest.raises(memtree.InvalidArgumentError, match="pack_below"):
        many().memmap(tmp_path / "t", pack_below=value)
    assert not (tmp_path / "t").exists()


def test_encrypted_trees_pack_nothing_and_refuse_pack_below(tmp_path):
    pytest.importorskip("cryptography")
    key = memtree.EncryptionKey.generate()
    tree = many()
    tree.memmap(tmp_path / "e", encryption=key)
    assert "~pack-0.memmap" not in os.listdir(tmp_path / "e")
    assert (memtree.load_memmap(tmp_path / "e", encryption=key) == tree).all()
    with pytest.raises(memtree.InvalidArgumentError, match="encryption"):
        tree.memmap(tmp_path / "f", encryption=key, pack_below=4096)
    assert not (tmp_path / "f").exists()


# ---------------------------------------------------------------------------------------------
# loading


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_shape_round_trips_bit_exactly(tmp_path, dtype):
    leaves = {f"s{i}": random_tensor(shape, dtype, seed=i)
              for i, shape in enumerate([(), (1,), (3,), (2, 5), (0,), (4, 0, 3), (7, 3, 2)])}
    tree = TensorTree({**leaves, "odd": random_tensor((5,), torch.uint8, seed=9)})
    tree.memmap(tmp_path / "t", pack_below=4096)
    assert sorted(os.listdir(tmp_path / "t")) == ["meta.json", "~pack-0.memmap"]
    for opts in [{}, {"mode": "r"}, {"mmap": False}, {"verify": True}, {"lazy": False}]:
        loaded = memtree.load_memmap(tmp_path / "t", **opts)
        for k, v in tree.items():
            got = loaded[k]
            assert got.dtype == v.dtype and got.shape == v.shape and raw_bytes(got) == raw_bytes(v), (k, opts)


def test_packed_leaves_are_views_of_one_mapping_of_their_pack(tmp_path):
    tree, d = packed_tree(tmp_path)
    loaded = memtree.load_memmap(d)
    leaves = list(loaded.values(include_nested=True, leaves_only=True))
    assert {t.filename for t in leaves} == {str(d / "~pack-0.memmap")}
    assert len({t.untyped_storage().data_ptr() for t in leaves}) == 1  # across lazily loaded levels
    assert all(isinstance(t, memtree.MemoryMappedTensor) for t in leaves)


def test_keys_selection_and_the_meta_device_read_only_what_they_need(tmp_path):
    tree, d = packed_tree(tmp_path)
    part = memtree.load_memmap(d, keys=[("g2", "x5")])
    assert list(part.keys(include_nested=True, leaves_only=True)) == [("g2", "x5")]
    assert raw_bytes(part["g2", "x5"]) == raw_bytes(tree["g2", "x5"])
    os.unlink(d / "~pack-0.memmap")  # the structure needs no leaf byte
    structure = memtree.load_memmap(d, device="meta")
    assert structure["g1", "x1"].shape == (16,) and structure["g1", "x1"].device.type == "meta"


def test_a_packed_leaf_is_written_in_place_by_index_and_its_neighbours_keep_their_bytes(tmp_path):
    tree, d = packed_tree(tmp_path, TensorTree({f"x{i}": torch.zeros(4, 8) for i in range(80)}, batch_size=[4]))
    loaded = memtree.load_memmap(d)
    loaded["x5"][2] = torch.arange(8.0)  # one pwrite of one row, at its offset in the pack
    loaded[1:3] = TensorTree({f"x{i}": torch.full((2, 8), 7.0) for i in range(80)}, batch_size=[2])
    again = memtree.load_memmap(d, mode="r")
    assert again["x5"][2].tolist() == [7.0] * 8 and again["x5"][0].tolist() == [0.0] * 8
    assert again["x4"][3].tolist() == [0.0] * 8 and again["x6"][0].tolist() == [0.0] * 8
    with pytest.raises(memtree.ReadOnlyError):
        again["x0"][0] = 1.0


def test_packed_leaves_travel_to_other_processes_as_their_range_of_the_pack(tmp_path):
    tree, d = packed_tree(tmp_path)
    leaf = memtree.load_memmap(d)["g3", "x7"]
    copy = pickle.loads(ForkingPickler.dumps(leaf))  # what a DataLoader worker or a queue receives
    assert isinstance(copy, memtree.MemoryMappedTensor) and copy.filename == leaf.filename
    assert raw_bytes(copy) == raw_bytes(tree["g3", "x7"])
    copy[0] = 42.0
    assert memtree.load_memmap(d, mode="r")["g3", "x7"][0].item() == 42.0


def test_load_into_module_fills_live_parameters_from_packed_leaves(tmp_path):
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)])
    TensorTree.from_module(model).memmap(tmp_path / "m")
    assert "~pack-0.memmap" in os.listdir(tmp_path / "m")
    fresh = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)])
    result = memtree.load_into_module(fresh, tmp_path / "m")
    assert not result.missing and not result.unexpected
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
    bound = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(40)])
    memtree.load_memmap(tmp_path / "m").to_module(bound)
    x = torch.randn(2, 4)
    assert torch.equal(model(x), bound(x))


@pytest.mark.filterwarnings("ignore:torch.quantize_per")
def test_subclass_groups_whose_inner_tensors_are_packed_rebuild_exactly(tmp_path):
    """A quantized tensor's inner tensors are ordinary leaves of its group: packed like any small
    leaf, they are views into the pack, which a rebuild must not read past (it read to the end of
    the pack's storage, and refused the tree)."""
    q = {f"q{i}": torch.quantize_per_tensor(torch.randn(4, 8), 0.1, 0, torch.qint8) for i in range(70)}
    q["pc"] = torch.quantize_per_channel(torch.randn(4, 8), torch.rand(4) + 0.1, torch.zeros(4, dtype=torch.long),
                                         0, torch.quint8)
    TensorTree(q).memmap(tmp_path / "q")
    assert "~pack-0.memmap" in os.listdir(tmp_path / "q")
    for opts in [{}, {"mode": "r"}, {"mmap": False}, {"verify": True, "lazy": False}]:
        loaded = memtree.load_memmap(tmp_path / "q", **opts)
        for k, v in q.items():
            assert loaded[k].is_quantized and torch.equal(loaded[k].int_repr(), v.int_repr()), (k, opts)
    ao = pytest.importorskip("torchao.quantization")
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    ao.quantize_(model, ao.Int8WeightOnlyConfig())
    TensorTree.from_module(model).memmap(tmp_path / "m", pack_below=1 << 20)
    assert "~pack-0.memmap" in os.listdir(tmp_path / "m")
    bound = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    ao.quantize_(bound, ao.Int8WeightOnlyConfig())
    memtree.load_memmap(tmp_path / "m").to_module(bound)
    x = torch.randn(2, 64)
    assert torch.equal(bound(x), model(x))


def test_resaving_a_loaded_packed_tree_onto_its_own_prefix(tmp_path):
    tree, d = packed_tree(tmp_path)
    loaded = memtree.load_memmap(d)
    loaded["g0", "x0"][0] = 5.0
    again = loaded.memmap(d)
    assert again["g0", "x0"][0].item() == 5.0 and (memtree.load_memmap(d, verify=True) == again).all()
    assert loaded["g1", "x1"].tolist() == tree["g1", "x1"].tolist()  # the old mapping stays valid


# ---------------------------------------------------------------------------------------------
# growth moves packed leaves out


def test_growth_moves_every_packed_leaf_into_its_own_file_in_the_same_commit(tmp_path):
    tree = TensorTree({"obs": torch.arange(6.0).reshape(3, 2), "n": {f"r{i}": torch.arange(3) * i for i in range(70)},
                       "big": torch.ones(3, 100_000)}, batch_size=[3])
    grown = tree.memmap(tmp_path / "t")
    assert "~pack-0.memmap" in os.listdir(tmp_path / "t")
    held = memtree.load_memmap(tmp_path / "t", mode="r")
    grown.append_({"obs": torch.tensor([7.0, 8.0]), "n": {f"r{i}": torch.tensor(i) for i in range(70)},
                   "big": torch.zeros(100_000)})
    assert sorted(os.listdir(tmp_path / "t")) == ["big.memmap", "meta.json", "n", "obs.memmap"]
    assert "r69.memmap" in os.listdir(tmp_path / "t" / "n") and "packs" not in meta(tmp_path / "t")
    assert grown["n", "r3"].filename == str(tmp_path / "t" / "n" / "r3.memmap")
    loaded = memtree.load_memmap(tmp_path / "t", verify=True)
    assert loaded["n", "r3"].tolist() == [0, 3, 6, 3] and loaded["obs"].tolist()[-1] == [7.0, 8.0]
    assert held["n", "r3"].tolist() == [0, 3, 6] and held["obs"].shape == (3, 2)  # never changes under a reader
    assert memtree.verify_tree(tmp_path / "t").ok
    grown.resize_(1)
    assert memtree.load_memmap(tmp_path / "t")["n", "r3"].tolist() == [0]


def test_a_packed_memmap_like_dataset_is_filled_by_index_then_grown(tmp_path):
    datum = TensorTree({f"f{i}": torch.zeros(3) for i in range(70)})
    data = datum.expand(10).memmap_like(tmp_path / "ds")
    assert "~pack-0.memmap" in os.listdir(tmp_path / "ds")
    for i in range(10):
        data[i] = TensorTree({f"f{k}": torch.full((3,), float(i * k)) for k in range(70)})
    data.append_(TensorTree({f"f{k}": torch.full((3,), -1.0) for k in range(70)}))
    loaded = memtree.load_memmap(tmp_path / "ds")
    assert loaded["f5"][:, 0].tolist() == [5.0 * i for i in range(10)] + [-1.0]


# ---------------------------------------------------------------------------------------------
# incremental saves and link isolation


def test_an_unchanged_pack_is_linked_whole_and_a_changed_one_rewritten(tmp_path):
    tree = many()
    s1 = WriteStats()
    write_tree(tmp_path / "1", tree, WriteOptions.of())
    write_tree(tmp_path / "2", tree, WriteOptions.of(link_from=tmp_path / "1"), stats=s1)
    assert (s1.files_linked, s1.files_written) == (1, 0)
    assert os.stat(tmp_path / "2" / "~pack-0.memmap").st_ino == os.stat(tmp_path / "1" / "~pack-0.memmap").st_ino
    tree["g2", "x3"] += 1
    s2 = WriteStats()
    write_tree(tmp_path / "3", tree, WriteOptions.of(link_from=tmp_path / "2"), stats=s2)
    assert (s2.files_linked, s2.files_written, s2.bytes_written) == (0, 1, os.path.getsize(tmp_path / "3" / "~pack-0.memmap"))
    assert (memtree.load_memmap(tmp_path / "3", verify=True) == tree).all()
    assert memtree.load_memmap(tmp_path / "2")["g2", "x3"].tolist() != tree["g2", "x3"].tolist()


def test_the_public_link_from_links_an_unchanged_pack_and_maps_it_read_only(tmp_path):
    tree = many()
    tree.memmap(tmp_path / "1")
    new = tree.memmap(tmp_path / "2", link_from=tmp_path / "1")
    pack1, pack2 = tmp_path / "1" / "~pack-0.memmap", tmp_path / "2" / "~pack-0.memmap"
    assert os.stat(pack2).st_ino == os.stat(pack1).st_ino
    with pytest.raises(memtree.ReadOnlyError, match="mode='r\\+'"):
        new["g1", "x2"][0] = 5.0
    writable = memtree.load_memmap(tmp_path / "2")  # r+: the linked pack gets its own copy first
    writable["g1", "x2"][0] = 5.0
    assert os.stat(pack2).st_ino != os.stat(pack1).st_ino
    assert (memtree.load_memmap(tmp_path / "1", mode="r") == tree).all()
    assert float(memtree.load_memmap(tmp_path / "2", mode="r")["g1", "x2"][0]) == 5.0


def test_a_pack_with_a_leaf_more_or_less_is_not_linked(tmp_path):
    tree = many()
    tree.memmap(tmp_path / "1")
    fewer = many()
    del fewer["g3", "x24"]  # the same offsets for all the others, one leaf fewer
    stats = WriteStats()
    write_tree(tmp_path / "2", fewer, WriteOptions.of(link_from=tmp_path / "1"), stats=stats)
    assert stats.files_linked == 0
    assert (memtree.load_memmap(tmp_path / "2", verify=True) == fewer).all()


def test_writes_into_a_tree_never_reach_a_tree_that_shares_its_pack(tmp_path):
    tree = many()
    tree.memmap(tmp_path / "1")
    write_tree(tmp_path / "2", tree, WriteOptions.of(link_from=tmp_path / "1"))
    assert os.stat(tmp_path / "1" / "~pack-0.memmap").st_nlink == 2
    second = memtree.load_memmap(tmp_path / "2")  # mode r+: the shared pack gets its own copy
    second["g0", "x0"][0] = 123.0
    assert os.stat(tmp_path / "1" / "~pack-0.memmap").st_nlink == 1
    assert memtree.load_memmap(tmp_path / "1", verify=True)["g0", "x0"][0].item() == tree["g0", "x0"][0].item()
    # while the second tree maps its pack read-write, a new save never links it
    stats = WriteStats()
    write_tree(tmp_path / "3", memtree.load_memmap(tmp_path / "2", mode="r").clone(),
               WriteOptions.of(link_from=tmp_path / "2", pack_below=PACK_BELOW), stats=stats)
    assert stats.files_linked == 0
    with pytest.raises(memtree.UnsafePathError, match="hard links"):
        os.link(tmp_path / "3" / "~pack-0.memmap", tmp_path / "other")
        memtree.MemoryMappedTensor.from_filename(tmp_path / "3" / "~pack-0.memmap", torch.uint8,
                                                 (os.path.getsize(tmp_path / "3" / "~pack-0.memmap"),))


def test_checkpointer_steps_link_their_unchanged_packs(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path / "ckpt")
    state = {"model": {f"b{i}": torch.randn(8) for i in range(100)}}
    ckpt.save(1, state)
    ckpt.save(2, state)
    assert os.stat(tmp_path / "ckpt" / "2" / "~pack-0.memmap").st_nlink == 2
    restored = ckpt.restore(2)
    assert all(torch.equal(restored["model"][k], v) for k, v in state["model"].items())


# ---------------------------------------------------------------------------------------------
# checksums, verify, diff, du, info


def test_verify_and_load_catch_a_flipped_bit_in_a_pack_and_name_the_leaf(tmp_path):
    tree, d = packed_tree(tmp_path)
    pack = d / "~pack-0.memmap"
    offset = meta(d / "g1")["entries"][2]["offset"]
    mtime = os.stat(pack).st_mtime_ns
    with open(pack, "r+b") as f:
        f.seek(offset + 5)
        byte = f.read(1)
        f.seek(offset + 5)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(pack, ns=(mtime, mtime))  # bit rot: the time does not change
    report = memtree.verify_tree(d)
    assert [(p.kind, p.key) for p in report.problems] == [("checksum", ("g1", "x2"))]
    assert report.leaves == report.checksummed == 100
    with pytest.raises(memtree.IntegrityError, match=r"\('g1', 'x2'\).*is damaged"):
        memtree.load_memmap(d, verify=True)["g1"]["x2"]
    part = memtree.load_memmap(d, verify=True, keys=[("g1", "x1")])  # the other leaves of the pack check out
    assert raw_bytes(part["g1", "x1"]) == raw_bytes(tree["g1", "x1"])


def test_a_write_in_place_makes_the_packs_checksums_stale_not_damaged(tmp_path):
    tree, d = packed_tree(tmp_path)
    loaded = memtree.load_memmap(d)
    loaded["g0", "x1"][0] = 9.0
    os.utime(d / "~pack-0.memmap", ns=(os.stat(d / "meta.json").st_mtime_ns + 10**9,) * 2)
    assert [(p.kind, p.key) for p in memtree.verify_tree(d).problems] == [("stale", ("g0", "x1"))]


@pytest.mark.parametrize("damage", ["missing", "short", "long", "symlink", "fifo", "directory"])
def test_a_damaged_pack_is_refused_before_anything_is_mapped(tmp_path, damage):
    tree, d = packed_tree(tmp_path)
    pack = d / "~pack-0.memmap"
    size = os.path.getsize(pack)
    if damage == "missing":
        pack.unlink()
    elif damage == "short":
        os.truncate(pack, size - 1)
    elif damage == "long":
        os.truncate(pack, size + 1)
    elif damage in ("symlink", "fifo", "directory"):
        pack.rename(d / "elsewhere")
        {"symlink": lambda: pack.symlink_to(d / "elsewhere"), "fifo": lambda: os.mkfifo(pack),
         "directory": lambda: pack.mkdir()}[damage]()
    before = files_below(d), {p: os.lstat(d / p).st_size for p in files_below(d) if not (d / p).is_fifo()}
    for opts in [{}, {"mode": "r"}, {"mmap": False}]:
        with pytest.raises(memtree.MemtreeError) as ei:
            memtree.load_memmap(d, **opts)["g0"]["x0"]
        assert "~pack-0.memmap" in str(ei.value)
    report = memtree.verify_tree(d)
    assert not report.ok and len(report.problems) == 1 and report.problems[0].path.endswith("~pack-0.memmap")
    after = files_below(d), {p: os.lstat(d / p).st_size for p in files_below(d) if not (d / p).is_fifo()}
    assert before == after  # nothing written, extended or truncated


def test_diff_compares_packed_leaves_by_checksum_or_by_their_range(tmp_path):
    from memtree.cli.diff import diff_trees

    a, b = many(), many()
    b["g1", "x2"][0] = 1.0
    a.memmap(tmp_path / "a")
    b.memmap(tmp_path / "b")
    report = diff_trees(str(tmp_path / "a"), str(tmp_path / "b"))
    assert [c["key"] for c in report.changed] == [["g1", "x2"]] and report.bytes_read == 0
    a.memmap(tmp_path / "c", checksum=None)
    b.memmap(tmp_path / "d", checksum="crc32")
    report = diff_trees(str(tmp_path / "c"), str(tmp_path / "d"))
    assert [c["key"] for c in report.changed] == [["g1", "x2"]] and report.same == 99 + 4
    assert report.bytes_read == 100 * 64  # each leaf of the side without checksums: its range of the pack


def test_du_info_and_verify_from_the_command_line(tmp_path):
    from memtree.cli.du import disk_usage
    from memtree.cli.info import describe

    tree, d = packed_tree(tmp_path)
    usage = disk_usage(str(d))
    assert usage.files == 6 and usage.apparent_bytes >= 100 * 64
    info = describe(str(d))
    assert info["version"] == 3 and info["packs"] == [{"file": "~pack-0.memmap", "nbytes": 100 * 64}]
    entry = next(e for e in info["entries"] if e["key"] == ["g0", "x1"])
    assert (entry["file"], entry["offset"]) == ("~pack-0.memmap", 64)


# ---------------------------------------------------------------------------------------------
# remote trees, other layouts


def test_remote_uploads_and_ranged_loads_of_packs(tmp_path):
    pytest.importorskip("fsspec")
    from memtree.remote import upload

    tree = many()
    tree["big"] = torch.randn(100_000)
    upload(tree, "memory://packs/t")
    import fsspec

    fs = fsspec.filesystem("memory")
    assert fs.exists("/packs/t/~pack-0.memmap") and not fs.exists("/packs/t/g0/x0.memmap")
    assert (memtree.load_memmap("memory://packs/t", verify=True) == tree).all()
    part = memtree.load_memmap("memory://packs/t", keys=[("g2", "x4")])
    assert raw_bytes(part["g2", "x4"]) == raw_bytes(tree["g2", "x4"])
    cached = memtree.load_memmap("memory://packs/t", cache_dir=tmp_path / "cache", keys=[("g2", "x4"), "big"])
    assert raw_bytes(cached["g2", "x4"]) == raw_bytes(tree["g2", "x4"])
    entry = Path(os.path.dirname(cached["g2", "x4"].filename))
    assert memtree.verify_tree(entry).ok and meta(entry)["packs"] == [{"file": "~pack-0.memmap", "nbytes": 100 * 64}]
    fs.pipe_file("/packs/t/~pack-0.memmap", fs.cat_file("/packs/t/~pack-0.memmap")[:-64])  # a truncated object
    with pytest.raises(memtree.LeafSizeError, match="~pack-0.memmap"):
        memtree.load_memmap("memory://packs/t")


def test_a_packed_tree_converts_to_tensordicts_layout(tmp_path):
    pytest.importorskip("tensordict")
    from tensordict import TensorDict

    tree, d = packed_tree(tmp_path)
    memtree.convert(d, tmp_path / "td", format="tensordict")
    td = TensorDict.load_memmap(tmp_path / "td")
    assert torch.equal(td["g2", "x9"], tree["g2", "x9"])


# ---------------------------------------------------------------------------------------------
# hostile meta.json files


def _edit(path: Path, fn) -> None:
    doc = meta(path)
    fn(doc)
    (path / "meta.json").write_bytes(orjson.dumps(doc))


def _first_leaf(doc: dict) -> dict:
    return next(e for e in doc["entries"] if e["kind"] == "tensor")


HOSTILE = {
    "pack not listed": (lambda root, sub: _first_leaf(sub).update(pack="~pack-7.memmap"), "does not list"),
    "past the end": (lambda root, sub: _first_leaf(sub).update(offset=64 * 100), "which has 6400"),
    "overlap in a level": (lambda root, sub: sub["entries"][1].update(offset=sub["entries"][0]["offset"]), "overlapping"),
    "overlap across levels": (lambda root, sub: _first_leaf(sub).update(offset=0), "overlapping"),
    "unaligned offset": (lambda root, sub: _first_leaf(sub).update(offset=65), "multiple of 64"),
    "negative offset": (lambda root, sub: _first_leaf(sub).update(offset=-64), "offset"),
    "offset beyond 2**62": (lambda root, sub: _first_leaf(sub).update(offset=2**63), "offset"),
    "pack is a path": (lambda root, sub: _first_leaf(sub).update(pack="../x/~pack-0.memmap"), "pack name"),
    "file and pack": (lambda root, sub: _first_leaf(sub).update(file="x0.memmap"), "unknown field"),
    "capacity on a packed leaf": (lambda root, sub: _first_leaf(sub).update(capacity=99), "unknown field"),
    "packs in a sub-level": (lambda root, sub: sub.update(packs=root["packs"]), "only allowed in the root"),
    "version 2 with packs": (lambda root, sub: root.update(version=2), "version 3"),
    "version 2 packed leaf": (lambda root, sub: sub.update(version=2), "version 3"),
    "pack size unaligned": (lambda root, sub: root["packs"][0].update(nbytes=6401), "multiple of 64"),
    "pack twice": (lambda root, sub: root["packs"].append(dict(root["packs"][0])), "repeats the pack"),
    "pack name of an entry": (lambda root, sub: root["packs"][0].update(file="g0"), "pack name"),
    "entry named like the pack": (lambda root, sub: root["entries"][0].update(dir="~PACK-0.memmap"), "reuses the file name"),
    "packs not a list": (lambda root, sub: root.update(packs={"file": "~pack-0.memmap"}), "non-empty list"),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=list(HOSTILE))
def test_a_hostile_meta_json_is_refused_naming_the_file(tmp_path, case):
    edit, message = HOSTILE[case]
    tree, d = packed_tree(tmp_path)
    root, sub = meta(d), meta(d / "g1")
    edit(root, sub)
    (d / "meta.json").write_bytes(orjson.dumps(root))
    (d / "g1" / "meta.json").write_bytes(orjson.dumps(sub))
    before = (d / "~pack-0.memmap").read_bytes()
    with pytest.raises(memtree.MemtreeError, match=message):
        loaded = memtree.load_memmap(d)
        loaded["g0"]["x0"], loaded["g1"]["x0"]
    report = memtree.verify_tree(d)
    assert not report.ok
    assert (d / "~pack-0.memmap").read_bytes() == before


def test_overlapping_leaves_of_lazily_loaded_levels_are_refused_whatever_the_order(tmp_path):
    tree, d = packed_tree(tmp_path)
    _edit(d / "g3", lambda doc: doc["entries"][0].update(offset=meta(d / "g1")["entries"][4]["offset"]))
    for first, second in [("g1", "g3"), ("g3", "g1")]:
        loaded = memtree.load_memmap(d)
        loaded[first]["x0"]
        with pytest.raises(MetaFormatError, match="overlapping"):
            loaded[second]["x0"]
    with pytest.raises(MetaFormatError, match="overlapping"):
        memtree.load_memmap(d, lazy=False)


def test_a_failed_level_load_can_be_retried_without_a_false_overlap(tmp_path):
    tree, d = packed_tree(tmp_path)
    loaded = memtree.load_memmap(d)
    real = (d / "~pack-0.memmap").read_bytes()
    (d / "~pack-0.memmap").rename(d / "away")
    with pytest.raises(memtree.MissingLeafError):
        loaded["g2"]["x0"]
    (d / "away").rename(d / "~pack-0.memmap")
    assert raw_bytes(loaded["g2"]["x0"]) == raw_bytes(tree["g2", "x0"])
    assert (d / "~pack-0.memmap").read_bytes() == real


def test_the_short_path_of_the_parser_agrees_with_the_full_checks_on_packed_entries(monkeypatch):
    from memtree.format import schema

    base = {"key": "w", "kind": "tensor", "pack": "~pack-0.memmap", "offset": 64, "dtype": "float32", "shape": [2]}
    variants = [base, {**base, "checksum": "crc32:00000000"}, {**base, "offset": 3}, {**base, "offset": True},
                {**base, "pack": "x.memmap"}, {**base, "shape": [-1]}, {**base, "dtype": "f4"}, {**base, "key": ""},
                {**base, "offset": 2**62}, {**base, "offset": 2**62 + 64}]
    for version in (2, 3):
        for entry in variants:
            doc = {"format": "memtree", "version": version, "type": "TensorTree", "byteorder": "little",
                   "batch_size": [], "entries": [entry], "packs": [{"file": "~pack-0.memmap", "nbytes": 128}]}
            data = orjson.dumps(doc)

            def parse():
                try:
                    return schema.parse_level(data, "t/meta.json")
                except memtree.MemtreeError as err:
                    return type(err), str(err)

            fast = parse()
            with monkeypatch.context() as m:
                m.setattr(schema, "_plain_entry", lambda raw, batch_size: None)
                assert parse() == fast, (version, entry)


def test_mutated_packed_meta_json_files_never_crash_a_load(tmp_path):
    """Every single-field mutation of a packed level (values of other types and sizes) gives a
    MemtreeError or a load, never another exception, a crash or a write; and verify_tree reports
    a problem exactly when load_memmap(verify=True) fails."""
    tree, d = packed_tree(tmp_path, many(64, groups=1))
    good = (d / "g0" / "meta.json").read_bytes()
    doc = orjson.loads(good)
    values = [None, True, -1, 0, 63, 64, 2**62, 2**64, 1.5, "", "~pack-0.memmap", "x.memmap", [], {}]
    pack = (d / "~pack-0.memmap").read_bytes()
    for i in (0, 1, 63):
        for field in ("pack", "offset", "shape", "dtype", "key", "kind", "checksum", "extra"):
            for value in values:
                entry = dict(doc["entries"][i])
                entry[field] = value
                mutated = {**doc, "entries": doc["entries"][:i] + [entry] + doc["entries"][i + 1:]}
                (d / "g0" / "meta.json").write_bytes(json.dumps(mutated).encode())  # (ints past 64 bits too)
                ok = memtree.verify_tree(d).ok
                try:
                    loaded = memtree.load_memmap(d, lazy=False, verify=True)
                except memtree.MemtreeError as err:
                    assert not ok, (i, field, value, err)
                    continue
                assert ok, (i, field, value)
                for k, v in flat_leaves(loaded).items():
                    assert isinstance(v, torch.Tensor)
    (d / "g0" / "meta.json").write_bytes(good)
    assert (d / "~pack-0.memmap").read_bytes() == pack


def flat_leaves(tree: TensorTree) -> dict:
    return dict(tree.items(include_nested=True, leaves_only=True))


# ---------------------------------------------------------------------------------------------
# the golden directory of version 3's packs


GOLDEN = Path(__file__).parent / "golden" / "v3-packs"


def golden_tree() -> TensorTree:
    return TensorTree(
        {
            "obs": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
            "nested": {"step": torch.tensor([7, 8], dtype=torch.int64), "empty": torch.zeros(2, 0),
                       "flag": torch.tensor([True, False])},
            "big": torch.arange(2 * 40, dtype=torch.int16).reshape(2, 40),  # 160 bytes: not packed
            "name": "golden",
        },
        batch_size=[2],
    )


def test_golden_v3_packs_directory_loads_bit_exactly():
    loaded = memtree.load_memmap(GOLDEN, mode="r", verify=True)
    assert fingerprint(loaded) == fingerprint(golden_tree())
    assert memtree.verify_tree(GOLDEN).ok


def test_writer_reproduces_the_v3_packs_golden_directory_byte_for_byte(tmp_path):
    golden_tree().memmap(tmp_path / "t", checksum="crc32", pack_below=100)
    written = {n: (tmp_path / "t" / n).read_bytes() for n in files_below(tmp_path / "t")}
    golden = {n: (GOLDEN / n).read_bytes() for n in files_below(GOLDEN)}
    assert sorted(written) == sorted(golden) == ["big.memmap", "meta.json", "nested/meta.json", "~pack-0.memmap"]
    for name, data in golden.items():
        if name == "meta.json":  # save_id and tree_hash differ per save
            a, b = orjson.loads(data), orjson.loads(written[name])
            for doc in (a, b):
                doc.pop("save_id")
                doc.pop("tree_hash")
            assert a == b
        else:
            assert written[name] == data, name
