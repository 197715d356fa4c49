"""``memtree.integrations.torchrl``: ``MemtreeStorage`` and ``MemtreeStorageCheckpointer`` under
torchrl's own entry points (``ReplayBuffer.extend``/``sample``/``dumps``/``loads``,
``state_dict``), compared with ``LazyMemmapStorage`` doing the same; growth, reopening, several
processes filling one buffer by index, dumps killed half-way, damaged and mismatched dumps."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torchrl", reason="the torchrl extra is not installed")

from tensordict import NonTensorData, TensorDict  # noqa: E402
from torchrl.data import LazyMemmapStorage, ReplayBuffer, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import RandomSampler  # noqa: E402

import memtree  # noqa: E402
from memtree.errors import (  # noqa: E402
    DestinationExistsError,
    IntegrityError,
    InvalidArgumentError,
    InvalidIndexError,
    ShapeMismatchError,
)
from memtree.integrations.torchrl import MemtreeStorage, MemtreeStorageCheckpointer  # noqa: E402
from memtree.store.writing.linking import WriteStats  # noqa: E402
from treeutil import run_children  # noqa: E402

FORK = mp.get_context("fork")
TIMEOUT = 300.0


def batch(i: int, n: int = 3) -> TensorDict:
    """``n`` transitions, every value distinct (``i`` numbers the batch)."""
    base = torch.arange(n, dtype=torch.float32) + 100 * i
    return TensorDict(
        {"obs": base[:, None].expand(n, 4).clone(), "action": (base % 5).long(),
         ("next", "reward"): base.double(), ("next", "done"): base.remainder(2) == 1},
        [n],
    )


def buffers(tmp_path: Path, max_size: int = 10) -> tuple[TensorDictReplayBuffer, TensorDictReplayBuffer]:
    """A buffer on MemtreeStorage and the same on LazyMemmapStorage."""
    ours = TensorDictReplayBuffer(storage=MemtreeStorage(max_size, tmp_path / "ours"), sampler=RandomSampler(), batch_size=5)
    theirs = TensorDictReplayBuffer(storage=LazyMemmapStorage(max_size, scratch_dir=tmp_path / "theirs"),
                                    sampler=RandomSampler(), batch_size=5)
    return ours, theirs


def rows(rb: Any) -> TensorDict:
    return rb.storage.get(slice(0, len(rb.storage)))


def assert_same_rows(a: TensorDict, b: TensorDict) -> None:
    assert a.batch_size == b.batch_size
    assert sorted(a.keys(True, True), key=str) == sorted(b.keys(True, True), key=str)
    for key in a.keys(True, True):
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


# -- torchrl's entry points --------------------------------------------------------------------


def test_extend_sample_and_wrap_around_as_lazy_memmap_storage_does(tmp_path):
    ours, theirs = buffers(tmp_path)
    for i in range(6):  # 18 transitions into 10 rows: wraps around
        ours.extend(batch(i))
        theirs.extend(batch(i))
        assert len(ours) == len(theirs)
        assert_same_rows(rows(ours), rows(theirs))
        torch.manual_seed(i)
        a = ours.sample()
        torch.manual_seed(i)
        b = theirs.sample()
        assert_same_rows(a.exclude("index"), b.exclude("index"))
    assert ours.storage._tree.batch_size == torch.Size([10])


def test_the_tree_on_disk_holds_exactly_the_rows_written_while_it_grows(tmp_path):
    rb = ReplayBuffer(storage=MemtreeStorage(1000, tmp_path / "buf"))
    assert not (tmp_path / "buf").exists()  # created at the first write
    for i in range(5):
        rb.extend(batch(i, 7))
        tree = memtree.load_memmap(tmp_path / "buf")
        assert tree.batch_size == torch.Size([7 * (i + 1)])
        assert torch.equal(tree["obs"][-7:], batch(i, 7)["obs"])
    # the files grow with the rows (capacity doubling), not to max_size up front
    assert os.path.getsize(tree["obs"].filename) < 1000 * 4 * 4


def test_writes_by_index_grow_the_tree_to_the_highest_row(tmp_path):
    storage = MemtreeStorage(50, tmp_path / "buf")
    storage.set(torch.tensor([4, 9]), batch(0, 2), set_cursor=False)
    assert memtree.load_memmap(tmp_path / "buf").batch_size == torch.Size([10])
    assert memtree.load_memmap(tmp_path / "buf")["obs"][9].tolist() == [1.0] * 4
    for bad in (torch.tensor([-1]), torch.tensor([50]), 50):
        with pytest.raises(InvalidIndexError):
            storage.set(bad, batch(0, 1) if not isinstance(bad, int) else batch(0, 1)[0], set_cursor=False)


def test_the_buffer_reopens_from_its_directory(tmp_path):
    rb = ReplayBuffer(storage=MemtreeStorage(20, tmp_path / "buf"))
    rb.extend(batch(0, 6))
    with pytest.raises(DestinationExistsError, match="existsok=True"):
        MemtreeStorage(20, tmp_path / "buf")
    again = MemtreeStorage(20, tmp_path / "buf", existsok=True)
    assert len(again) == 6 and torch.equal(again.get(slice(0, 6))["obs"], batch(0, 6)["obs"])
    with pytest.raises(ShapeMismatchError, match="max_size 4"):
        MemtreeStorage(4, tmp_path / "buf", existsok=True)


def test_state_dict_round_trips_between_memtree_and_lazy_storages(tmp_path):
    ours, theirs = buffers(tmp_path)
    for i in range(2):
        theirs.extend(batch(i))
    ours.load_state_dict(theirs.state_dict())
    assert len(ours) == 6
    assert_same_rows(rows(ours), rows(theirs))
    fresh = TensorDictReplayBuffer(storage=MemtreeStorage(10, tmp_path / "again"), batch_size=5)
    fresh.load_state_dict(ours.state_dict())
    assert_same_rows(rows(fresh), rows(theirs))


def test_dumps_and_loads_through_the_replay_buffer(tmp_path):
    ours, theirs = buffers(tmp_path)
    for i in range(5):
        ours.extend(batch(i))
        theirs.extend(batch(i))
    ours.dumps(tmp_path / "dump")
    storage = tmp_path / "dump" / "storage"
    assert (storage / "meta.json").is_file() and memtree.verify_tree(storage).ok
    assert not [p for p in storage.rglob("*") if p.suffix in (".pkl", ".pickle", ".pt")]
    assert memtree.load_memmap(storage).batch_size == torch.Size([10])
    for target in (MemtreeStorage(10, tmp_path / "restored"), LazyMemmapStorage(10)):
        rb = TensorDictReplayBuffer(storage=target, sampler=RandomSampler(), batch_size=5,
                                    checkpointer=MemtreeStorageCheckpointer())
        rb.loads(tmp_path / "dump")
        assert len(rb) == 10 and rb.writer._cursor == ours.writer._cursor
        assert_same_rows(rows(rb), rows(theirs))
        rb.extend(batch(9))  # goes on where the dumped buffer would
        reference = TensorDictReplayBuffer(storage=LazyMemmapStorage(10), batch_size=5)
        for i in (0, 1, 2, 3, 4, 9):
            reference.extend(batch(i))
        assert_same_rows(rows(rb), rows(reference))


def test_a_dump_of_a_partly_filled_buffer_holds_only_its_rows(tmp_path):
    rb = ReplayBuffer(storage=LazyMemmapStorage(100), checkpointer=MemtreeStorageCheckpointer())
    rb.extend(batch(0, 4))
    rb.dumps(tmp_path / "dump")
    tree = memtree.load_memmap(tmp_path / "dump" / "storage")
    assert tree.batch_size == torch.Size([4]) and torch.equal(tree["next", "reward"], batch(0, 4)["next", "reward"])


def test_consecutive_dumps_link_what_did_not_change(tmp_path, monkeypatch):
    storage = MemtreeStorage(6, tmp_path / "buf")
    rb = ReplayBuffer(storage=storage)
    rb.extend(batch(0, 6))
    rb.dumps(tmp_path / "d1")
    seen: list[WriteStats] = []
    import memtree.integrations.torchrl as mt_torchrl

    real = mt_torchrl.write_level

    def spy(*args: Any, **kwargs: Any) -> WriteStats:
        seen.append(real(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(mt_torchrl, "write_level", spy)
    item = storage.get(0).clone()
    item["action"] = torch.tensor(4)
    storage.set(0, item, set_cursor=False)
    rb.dumps(tmp_path / "d2")  # only "action" changed: the 3 other keys are linked
    assert (seen[-1].files_written, seen[-1].files_linked) == (1, 3)
    first = memtree.load_memmap(tmp_path / "d1" / "storage", mode="r")["obs"].filename
    second = memtree.load_memmap(tmp_path / "d2" / "storage", mode="r")["obs"].filename
    assert os.stat(first).st_ino == os.stat(second).st_ino
    rb.dumps(tmp_path / "d2")  # again, unchanged: everything linked from the dump it replaces
    assert seen[-1].files_written == 0


# -- refusals ----------------------------------------------------------------------------------


def test_data_memtree_cannot_keep_is_refused_clearly(tmp_path):
    rb = ReplayBuffer(storage=MemtreeStorage(10, tmp_path / "a"))
    with pytest.raises(InvalidArgumentError, match="TensorDict"):
        rb.extend(torch.ones(3, 2))
    rb = ReplayBuffer(storage=MemtreeStorage(10, tmp_path / "b"))
    with pytest.raises(InvalidArgumentError, match="'note'"):
        rb.extend(TensorDict({"x": torch.ones(2), "note": NonTensorData("hi", batch_size=[2])}, [2]))
    with pytest.raises(InvalidArgumentError, match="local"):
        MemtreeStorage(10, "s3://bucket/buffer")
    with pytest.raises(InvalidArgumentError, match="max_size"):
        MemtreeStorage(0, tmp_path / "c")


def test_dumping_into_the_storage_s_own_directory_is_refused(tmp_path):
    rb = ReplayBuffer(storage=MemtreeStorage(10, tmp_path / "buf"))
    rb.extend(batch(0))
    with pytest.raises(InvalidArgumentError, match="own directory"):
        rb.storage.dumps(tmp_path / "buf")
    assert memtree.load_memmap(tmp_path / "buf").batch_size == torch.Size([3])


def test_a_dump_that_does_not_fit_the_storage_changes_nothing(tmp_path):
    rb = ReplayBuffer(storage=MemtreeStorage(10, tmp_path / "src"))
    rb.extend(batch(0, 8))
    rb.storage.dumps(tmp_path / "dump")
    small = MemtreeStorage(5, tmp_path / "small")
    with pytest.raises(ShapeMismatchError, match="max_size 5"):
        small.loads(tmp_path / "dump")
    other = ReplayBuffer(storage=MemtreeStorage(10, tmp_path / "other"))
    other.extend(TensorDict({"obs": torch.zeros(2, 3)}, [2]))
    with pytest.raises(ShapeMismatchError, match="does not fit"):
        other.storage.loads(tmp_path / "dump")
    assert len(other) == 2 and memtree.load_memmap(tmp_path / "other")["obs"].shape == (2, 3)


def test_a_damaged_dump_is_refused_before_anything_is_loaded(tmp_path):
    rb = ReplayBuffer(storage=MemtreeStorage(10, tmp_path / "src"))
    rb.extend(batch(0, 8))
    rb.storage.dumps(tmp_path / "dump")
    leaf = memtree.load_memmap(tmp_path / "dump")["obs"].filename
    with open(leaf, "r+b") as f:
        f.write(b"\x01")
    target = ReplayBuffer(storage=MemtreeStorage(10, tmp_path / "dst"))
    target.extend(batch(5, 2))
    with pytest.raises(IntegrityError):
        target.storage.loads(tmp_path / "dump")
    assert len(target) == 2 and torch.equal(rows(target)["obs"], batch(5, 2)["obs"])


# -- processes ---------------------------------------------------------------------------------


def _fill(storage: MemtreeStorage, start: int, barrier: Any) -> None:
    barrier.wait(TIMEOUT)
    for i in range(start, 40, 2):  # this writer's batches, interleaved with the other's
        storage.set(torch.arange(3 * i, 3 * i + 3), batch(i), set_cursor=False)


@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])
def test_two_processes_fill_one_buffer_by_index_while_it_grows(tmp_path, start_method):
    context = mp.get_context(start_method)
    storage = MemtreeStorage(120, tmp_path / "buf")
    storage.set(torch.arange(3), batch(0), set_cursor=False)  # the tree exists; both grow it
    barrier = context.Barrier(2)
    run_children(context, _fill, (storage, 0, barrier), (storage, 1, barrier))
    storage._len = 120
    expected = torch.cat([batch(i) for i in range(40)])
    assert_same_rows(storage.get(slice(0, 120)), expected)  # the parent reloads what they grew
    assert_same_rows(_as_td(memtree.load_memmap(tmp_path / "buf")), expected)


def _as_td(tree: memtree.TensorTree) -> TensorDict:
    td = TensorDict({}, tree.batch_size[:1])
    for key in tree.keys(include_nested=True, leaves_only=True):
        td.set(key, tree[key])
    return td


def test_kill_9_in_the_middle_of_a_dump_leaves_the_previous_dump_whole(tmp_path, monkeypatch):
    rb = ReplayBuffer(storage=MemtreeStorage(20, tmp_path / "buf"))
    rb.extend(batch(0, 10))
    rb.storage.dumps(tmp_path / "dump")
    rb.extend(batch(1, 10))
    monkeypatch.setenv("MEMTREE_FAULT", "after_leaf:2")
    p = FORK.Process(target=_killed_dump, args=(rb, str(tmp_path / "dump")))
    p.start()
    p.join(TIMEOUT)
    assert p.exitcode == 137
    monkeypatch.delenv("MEMTREE_FAULT")
    tree = memtree.load_memmap(tmp_path / "dump", verify=True)
    assert tree.batch_size == torch.Size([10]) and torch.equal(tree["obs"], batch(0, 10)["obs"])
    rb.storage.dumps(tmp_path / "dump")  # the next dump cleans up and commits
    assert memtree.load_memmap(tmp_path / "dump").batch_size == torch.Size([20])
    assert sorted(os.listdir(tmp_path)) == ["buf", "dump"]


def _killed_dump(rb: ReplayBuffer, path: str) -> None:
    from memtree.store.primitives import faults

    faults.reload()  # MEMTREE_FAULT was set after the import
    rb.storage.dumps(path)
    os._exit(0)  # not reached: the fault kills the process first
