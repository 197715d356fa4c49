"""Collective writes under faults: a rank killed with SIGKILL mid-write, a rank whose write fails,
ranks whose trees differ, placements memtree cannot store. Every case: the previous tree stays
the committed one, every surviving rank raises a clear error in bounded time, nothing is left
behind (or recovery removes it).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import memtree
from distutil import RankError, run_ranks, mib_chunks  # noqa: F401 - a fixture

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("mib_chunks"),  # chunks of 1 MiB: the leaves of a few MiB span several
]


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 1024, generator=g), "b": torch.randn(9, 33, generator=g), "c": torch.arange(5)}


def tree(world: int, seed: int) -> memtree.TensorTree:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    t = tensors(seed)
    return memtree.TensorTree({
        "a": distribute_tensor(t["a"], mesh, [Shard(0)], src_data_rank=None),
        "b": distribute_tensor(t["b"], mesh, [Shard(1)], src_data_rank=None),
        "c": distribute_tensor(t["c"], mesh, [Replicate()], src_data_rank=None),
    })


def same_as(d: str, seed: int) -> bool:
    loaded = memtree.load_memmap(d, mode="r")
    return all(torch.equal(loaded[k], v) for k, v in tensors(seed).items())


def leftovers(parent: str) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


def _save(rank: int, world: int, d: str, seed: int) -> None:
    tree(world, seed).memmap(d)


def _killed_mid_write(rank: int, world: int, d: str, victim: int) -> tuple[str, str, float]:
    """The victim SIGKILLs itself inside its first pwrite of shard bytes (some written, some not);
    the others report what they raised and how long it took."""
    import memtree.dist.write as dist_write

    if rank == victim:
        real = dist_write.pwrite_from

        def dying(fd: int, address: int, nbytes: int, offset: int = 0, digest=None) -> None:
            real(fd, address, nbytes // 2, offset)
            os.kill(os.getpid(), signal.SIGKILL)

        dist_write.pwrite_from = dying
    start = time.monotonic()
    try:
        tree(world, seed=2).memmap(d)
    except memtree.DistributedCheckpointError as err:
        return type(err).__name__, str(err), time.monotonic() - start
    return "nothing", "", time.monotonic() - start


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_during_a_collective_save_commits_nothing(tmp_path, victim):
    """kill -9 of one of 3 ranks while it writes its shards: the others raise
    DistributedCheckpointError at once (gloo sees the closed connection; the group's timeout
    bounds a hung rank), the previous tree stays committed, byte for byte; what the dead rank 0
    left (staging directory, lock journal) is recovered by the next write or memtree.recover."""
    d = str(tmp_path / "ckpt")
    run_ranks(3, _save, d, 1)
    with pytest.raises(RankError) as info:
        run_ranks(3, _killed_mid_write, d, victim)
    assert info.value.codes[victim] == -signal.SIGKILL
    for rank, (kind, message, elapsed) in info.value.results.items():
        assert kind == "DistributedCheckpointError", message
        assert "writing" in message and "rank" in message
        assert elapsed < 60
    assert same_as(d, 1)
    if victim == 0:
        memtree.recover(str(tmp_path))
    assert leftovers(str(tmp_path)) == []
    run_ranks(3, _save, d, 3)  # the next save commits
    assert same_as(d, 3)


def _failing_rank(rank: int, world: int, d: str) -> list[str]:
    """Rank 1's write fails (an I/O error), then every rank saves again (which commits)."""
    import memtree.dist.write as dist_write

    out = []
    real = dist_write.pwrite_from
    if rank == 1:
        def broken(*args, **kwargs):
            raise OSError(5, "injected write failure")

        dist_write.pwrite_from = broken
    with pytest.raises(memtree.DistributedCheckpointError) as info:
        tree(world, seed=2).memmap(d)
    out.append(str(info.value))
    assert set(info.value.failures) == {1}
    dist_write.pwrite_from = real
    tree(world, seed=4).memmap(d)
    return out


def test_a_failed_write_on_one_rank_fails_every_rank_and_commits_nothing(tmp_path):
    d = str(tmp_path / "ckpt")
    run_ranks(2, _save, d, 1)
    messages = run_ranks(2, _failing_rank, d)
    for (message,) in messages:
        assert "writing the shards failed on 1 of 2 rank(s)" in message
        assert "rank 1" in message and "injected write failure" in message
    assert same_as(d, 4) and leftovers(str(tmp_path)) == []


def _differing(rank: int, world: int, d: str) -> list[str]:
    """Trees that differ from rank to rank, each refused by every rank, naming the key."""
    from torch.distributed.tensor import Partial

    messages = []
    cases = {
        "extra key": lambda t: t.update({"extra": torch.ones(1)}) if rank == 1 else None,
        "other shape": lambda t: t.__setitem__("c", tree(world, 2)["c"][:4]) if rank == 1 else None,
        "plain values": lambda t: t.__setitem__("p", torch.full((3,), float(rank))),
    }
    for name, change in cases.items():
        t = tree(world, 2)
        change(t)
        with pytest.raises(memtree.PlacementError) as info:
            t.memmap(d)
        messages.append(str(info.value))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    partial = DTensor.from_local(torch.ones(2), init_device_mesh("cpu", (world,)), [Partial()])
    with pytest.raises(memtree.DistributedCheckpointError) as err:
        memtree.TensorTree({"p": partial}).memmap(d)
    messages.append(str(err.value))
    with pytest.raises(memtree.DistributedCheckpointError) as err:
        tree(world, 2).memmap(d, existsok=False)
    messages.append(str(err.value))
    return messages


def test_trees_that_differ_between_ranks_are_refused_by_name(tmp_path):
    d = str(tmp_path / "ckpt")
    run_ranks(2, _save, d, 1)
    for extra, shape, values, partial, exists in run_ranks(2, _differing, d):
        assert "'extra' is in the tree of rank 1 only" in extra
        assert "'c' is" in shape and "[4]" in shape and "[5]" in shape
        assert "the plain tensor 'p' holds different values on rank 0 and rank 1" in values
        assert "Partial" in partial and "redistribute" in partial
        assert "preparing the staging directory failed" in exists and "exists" in exists
    assert same_as(d, 1) and leftovers(str(tmp_path)) == []


# ---------------------------------------------------------------------------------------------
# damaged trees: what a rank reads is checked, and a damaged file never half-fills a model


def _save_big(rank: int, world: int, d: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(1024 * 1024, dtype=torch.float32).reshape(1024, 1024)  # 4 MiB: 4 chunks
    mesh = init_device_mesh("cpu", (world,))
    memtree.TensorTree({"a": distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)}).memmap(d)


def _verified(rank: int, world: int, d: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    try:
        tree = memtree.load_memmap(d, mesh=mesh, verify=True)
    except memtree.IntegrityError as err:
        return str(err)
    assert torch.equal(tree["a"].to_local().reshape(-1)[:3], torch.arange(3.0) + rank * 512 * 1024)
    return "ok"


def test_a_rank_checks_the_chunks_it_reads_and_only_those(tmp_path):
    """A bit flipped in the last chunk of a leaf: the rank whose shard lies there raises
    IntegrityError naming the chunk; the rank whose shard is intact loads it (it never reads the
    damaged chunk); a whole-tree verify finds it too."""
    d = str(tmp_path / "t")
    run_ranks(2, _save_big, d)
    path = os.path.join(d, "a.memmap")
    with open(path, "r+b") as f:
        f.seek((3 << 20) + 12345)
        byte = f.read(1)[0]
        f.seek((3 << 20) + 12345)
        f.write(bytes([byte ^ 4]))
    first, second = run_ranks(2, _verified, d)
    assert first == "ok"
    assert "for chunk 3 of 4 (bytes 3,145,728..4,194,304)" in second and "damaged" in second
    assert not memtree.verify_tree(d).ok


def _fill_truncated(rank: int, world: int, d: str) -> str:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    holder = nn.Module()
    holder.register_buffer("a", distribute_tensor(torch.full((1024, 1024), 7.0), mesh, [Shard(0)], src_data_rank=None))
    with pytest.raises(memtree.MemtreeError) as info:
        memtree.load_into_module(holder, d)
    assert bool((holder.a.to_local() == 7.0).all())  # nothing was filled
    return type(info.value).__name__


def test_a_truncated_leaf_is_refused_by_every_rank_before_any_shard_is_filled(tmp_path):
    d = str(tmp_path / "t")
    run_ranks(2, _save_big, d)
    os.truncate(os.path.join(d, "a.memmap"), (4 << 20) - 4)  # only rank 1's range is cut
    assert run_ranks(2, _fill_truncated, d) == ["LeafSizeError", "LeafSizeError"]
