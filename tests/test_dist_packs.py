"""Rank-aware reads of packed leaves (format version 3 packs, written by one process) and the
collective write's choice of no packs (memtree.dist; docs/guide/distributed.md).

A tree written by one process with ``pack_below=`` keeps its small leaves (biases, norms) in a
pack at the root; loaded with ``mesh=`` (locally, mapped or read, or from a URL) or into a
module's ``DTensor`` s, each rank reads its ranges of each packed leaf from its pack at the
leaf's offset, bit for bit what ``distribute_tensor`` gives it, and only those bytes; with
``verify=True`` the leaf's checksum is checked.
"""

from __future__ import annotations

import os

import orjson
import pytest
import torch
import torch.distributed as dist

import memtree
from distutil import run_ranks
from test_dist import Counted, Holder, distribute, same

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.timeout(600),
]

#: Each packed leaf is 512 KiB (packed with pack_below=1 MiB), so a rank's half is far more
#: than the meta.json files it also reads.
LEAF = 512 * 1024
META_BYTES = 64 * 1024  # what the meta.json files of the tree may add to a rank's reads


def packed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "b1": torch.randn(LEAF // 4, generator=g),  # a bias: Shard(0), one range per rank
        "b2": torch.randn(256, LEAF // 1024, generator=g),  # a norm's weight: Shard(1), a range per row
        "w": torch.randn(1024, 1024, generator=g),  # 4 MiB: a file of its own
    }


PLACEMENT = {"b1": 0, "b2": 1}


def _write(d: str) -> None:
    """The tree, written by one process with its two small leaves packed."""
    memtree.TensorTree(packed_tensors()).memmap(d, pack_below=1 << 20)
    root = orjson.loads(open(os.path.join(d, "meta.json"), "rb").read())
    entries = {e["key"]: e for e in root["entries"]}
    assert [p["file"] for p in root["packs"]] == ["~pack-0.memmap"]
    assert entries["b1"]["pack"] == entries["b2"]["pack"] == "~pack-0.memmap" and "file" not in entries["b1"]
    assert entries["b2"]["offset"] > 0 and entries["w"]["file"].endswith(".memmap")


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("packed") / "t")
    _write(d)
    return d


def _placements(key: str) -> list:
    from torch.distributed.tensor import Shard

    return [Shard(PLACEMENT[key])]


def _load_packed(rank: int, world: int, d: str) -> dict[str, int]:
    """Each packed leaf loaded three ways on this rank: the bytes each read asked for."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = packed_tensors()
    out: dict[str, int] = {}
    for key in PLACEMENT:
        want = distribute(full[key], mesh, _placements(key)).to_local()
        out[f"{key}_local"] = want.nbytes
        for how, kwargs in (("read", {"mmap": False}), ("mapped", {}), ("verified", {"verify": True})):
            with Counted() as counted:
                tree = memtree.load_memmap(d, mesh=mesh, placements={key: _placements(key)}, keys=[key], **kwargs)
            assert list(tree[key].placements) == _placements(key), (key, how)
            assert same(tree[key].to_local(), want), (key, how)
            out[f"{key}_{how}"] = counted.nbytes
        holder = Holder({key: distribute(torch.zeros_like(full[key]), mesh, _placements(key))})
        with Counted() as counted:
            memtree.load_into_module(holder, d, strict=False)
        assert same(getattr(holder, key).to_local(), want), (key, "load_into_module")
        out[f"{key}_module"] = counted.nbytes
    return out


def test_packed_leaves_load_into_dtensors_on_2_ranks_bit_exact_reading_their_own_bytes(packed):
    """mesh= (read into memory, mapped, verified) and load_into_module: each rank's shard of a
    packed leaf comes from its pack at the leaf's offset, bit-exact; reading it asks for the
    rank's bytes only (a mapped shard: none), verify=True for the whole leaf (one checksum)."""
    for m in run_ranks(2, _load_packed, packed):
        for key in PLACEMENT:
            local = m[f"{key}_local"]
            assert local == LEAF // 2
            assert local <= m[f"{key}_read"] <= local + META_BYTES, (key, m)
            assert m[f"{key}_module"] <= local + META_BYTES, (key, m)
            assert m[f"{key}_verified"] <= LEAF + META_BYTES, (key, m)
        assert m["b1_mapped"] <= META_BYTES  # one range: a view of the pack's mapping


def _damaged(rank: int, world: int, d: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for kwargs in ({"verify": True}, {"verify": True, "mmap": False}):
        with pytest.raises(memtree.IntegrityError) as err:
            memtree.load_memmap(d, mesh=mesh, placements={"b1": _placements("b1")}, keys=["b1"], **kwargs)
    return str(err.value)


def test_a_damaged_packed_leaf_is_refused_by_every_rank_with_verify(tmp_path):
    """One byte of b1 flipped in the pack (in rank 1's half): verify=True refuses it on both
    ranks, naming the leaf, since a packed leaf has one checksum of all its bytes."""
    d = str(tmp_path / "t")
    _write(d)
    entry = next(e for e in orjson.loads(open(os.path.join(d, "meta.json"), "rb").read())["entries"]
                 if e["key"] == "b1")
    with open(os.path.join(d, entry["pack"]), "r+b") as f:
        f.seek(entry["offset"] + LEAF - 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    for message in run_ranks(2, _damaged, d):
        assert "b1" in message and "~pack-0.memmap" in message


def _remote_packed(rank: int, world: int, url: str, verify: bool) -> int:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    tree = memtree.load_memmap(url, mesh=mesh, placements={k: _placements(k) for k in PLACEMENT}, verify=verify)
    full = packed_tensors()
    for key in PLACEMENT:
        assert same(tree[key].to_local(), distribute(full[key], mesh, _placements(key)).to_local()), key
    assert torch.equal(tree["w"], full["w"])  # a plain leaf, whole
    return rank


@pytest.mark.parametrize("verify", [False, True])
def test_packed_leaves_of_a_remote_tree_are_ranged_requests_of_the_pack(packed, verify):
    """load_memmap(url, mesh=): a packed leaf's ranges are requests of its pack at its offset;
    the server sends each rank its halves of the packed leaves (the whole leaves with verify,
    a packed leaf's checksum covering all of it) and the plain leaf whole."""
    import remote_server

    srv, _ = remote_server.start()
    try:
        srv.publish(packed, "t")
        assert run_ranks(2, _remote_packed, f"{srv.url}/t", verify) == [0, 1]
        plain = packed_tensors()["w"].nbytes
        packs = 2 * LEAF  # b1 and b2: halves on each of the two ranks, or wholes with verify
        assert srv.leaf_bytes() <= 2 * plain + (2 * packs if verify else packs) * 1.05
    finally:
        remote_server.stop(srv)


def _collective(rank: int, world: int, d: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    full = packed_tensors()
    small = {f"s{i}": torch.full((4,), float(i)) for i in range(64)}  # a write from one process packs these
    tree = memtree.TensorTree({**{k: distribute(full[k], mesh, _placements(k)) for k in PLACEMENT}, **small})
    with pytest.raises(memtree.InvalidArgumentError) as err:
        tree.memmap(d + "-refused", pack_below=1 << 20)
    tree.memmap(d)  # pack_below=None: no packs either
    return str(err.value)


def test_a_collective_write_packs_nothing(tmp_path):
    """A collective write gives every leaf a file of its own: pack_below= is refused with the
    fix, and a write with the default packs nothing (64 small plain leaves included, which
    the same write from one process packs)."""
    d = str(tmp_path / "t")
    for message in run_ranks(2, _collective, d):
        assert "pack_below=" in message and "leave pack_below= out" in message
    assert not os.path.exists(d + "-refused")
    root = orjson.loads(open(os.path.join(d, "meta.json"), "rb").read())
    assert "packs" not in root and all("file" in e for e in root["entries"])
    assert not [n for n in os.listdir(d) if n.startswith("~pack-")]
    loaded = memtree.load_memmap(d)
    for key in PLACEMENT:
        assert torch.equal(loaded[key], packed_tensors()[key])
    for i in range(64):
        assert torch.equal(loaded[f"s{i}"], torch.full((4,), float(i)))
