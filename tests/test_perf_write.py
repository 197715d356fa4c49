"""The write path's performance properties, as relative facts (no timings; issue 9).

What a save costs in system calls and threads, checked by counting calls with ``monkeypatch``:
each leaf file is created once and filled from the tensor's memory; large leaves are
preallocated in one ``fallocate`` (small ones are not); a failed preallocation behaves like a
failed write. Writer threads are started only when there is work for them, share the files
dynamically and stop together on the first failure. The old copy of a large overwritten tree is
deleted after the write returns, never the new tree, and is recoverable if the process dies.
"""

from __future__ import annotations

import errno
import gc
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import memtree
from memtree.store.reading.options import WriteOptions
from memtree import TensorTree
from memtree.store.primitives import commit as commit_mod
from memtree.store.primitives import files as fileio
from memtree.store.writing import write as write_mod
from treeutil import assert_tree_equal_to, leaf_dict

pytestmark = pytest.mark.timeout(120)

BIG = fileio.PREALLOCATE_MIN // 4  # float32 elements of a leaf that is just large enough


def mixed_tree() -> TensorTree:
    g = torch.Generator().manual_seed(0)
    return TensorTree(
        {
            "big": torch.randn(BIG, generator=g),
            "small": torch.randn(7, generator=g),
            "half": torch.randn(4, 3, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0, 5),
            "scalar": torch.tensor(3, dtype=torch.int64),
            "strided": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous: copied once
            "sub": {"big": torch.randn(2, BIG, generator=g), "flag": torch.tensor([True, False])},
        }
    )


@pytest.fixture
def creates(monkeypatch):
    """Paths opened with O_CREAT (in order), recorded through os.open."""
    seen: list[str] = []
    real = os.open

    def spy(path, flags, mode=0o777, *, dir_fd=None):
        if flags & os.O_CREAT:
            seen.append(os.fspath(path))
        return real(path, flags, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "open", spy)
    return seen


@pytest.fixture
def fallocations(monkeypatch):
    """The requested length of every preallocation."""
    seen: list[int] = []
    real = fileio._fallocate

    def spy(fd, mode, offset, length):
        seen.append(length)
        return real(fd, mode, offset, length)

    monkeypatch.setattr(fileio, "_fallocate", spy)
    return seen


@pytest.mark.parametrize("num_threads", [0, 2])
def test_each_leaf_file_is_created_once(tmp_path, creates, num_threads):
    tree = mixed_tree()
    out = tree.memmap(tmp_path / "t", num_threads=num_threads)
    leaves = [p for p in creates if p.endswith(".memmap")]
    assert len(leaves) == len(set(leaves)) == 8
    assert_tree_equal_to(out, leaf_dict(tree))
    assert_tree_equal_to(memtree.load_memmap(tmp_path / "t"), leaf_dict(tree))


@pytest.mark.skipif(fileio._fallocate is None, reason="no fallocate(2) on this platform")
def test_only_large_leaves_are_preallocated(tmp_path, fallocations):
    tree = mixed_tree()
    tree.memmap(tmp_path / "t")
    assert sorted(fallocations) == [BIG * 4, 2 * BIG * 4]
    for rel in ("big.memmap", "sub/big.memmap"):  # exactly the data's size, not rounded up
        assert os.path.getsize(tmp_path / "t" / rel) == leaf_dict(tree)[tuple(rel[:-7].split("/"))].nbytes
    fallocations.clear()
    tree.memmap_like(tmp_path / "like")  # no data written: sparse files, no preallocation
    assert fallocations == []


@pytest.mark.skipif(fileio._fallocate is None, reason="no fallocate(2) on this platform")
@pytest.mark.parametrize("err", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_unsupported_preallocation_is_skipped(tmp_path, monkeypatch, err):
    def unsupported(fd, mode, offset, length):
        import ctypes

        ctypes.set_errno(err)
        return -1

    monkeypatch.setattr(fileio, "_fallocate", unsupported)
    tree = mixed_tree()
    assert_tree_equal_to(tree.memmap(tmp_path / "t"), leaf_dict(tree))


@pytest.mark.skipif(fileio._fallocate is None, reason="no fallocate(2) on this platform")
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_full_disk_at_preallocation_is_a_storage_error(tmp_path, monkeypatch, overwrite):
    prefix = tmp_path / "t"
    old = TensorTree({"x": torch.ones(3)})
    if overwrite:
        old.memmap(prefix)

    def full(fd, mode, offset, length):
        import ctypes

        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(fileio, "_fallocate", full)
    with pytest.raises(memtree.StorageError) as ei:
        mixed_tree().memmap(prefix)
    assert ei.value.errno == errno.ENOSPC
    assert "'big'" in str(ei.value) or "('sub', 'big')" in str(ei.value)
    assert os.listdir(tmp_path) == (["t"] if overwrite else [])
    if overwrite:
        assert_tree_equal_to(memtree.load_memmap(prefix), leaf_dict(old))


def offloaded_tensor(tmp_path, value: torch.Tensor) -> torch.Tensor:
    """A wrapper subclass (no storage of its own: ``data_ptr()`` is not its data) holding ``value``."""
    from memtree import empty_init, offload

    TensorTree({"weight": value}).memmap(tmp_path / "offload")
    with empty_init():
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.empty(value.shape))
    offload(module, tmp_path / "offload")
    assert type(module.weight).__name__ == "OffloadedTensor"
    return module.weight


def src_bytes(t: torch.Tensor) -> bytes:
    plain = torch.empty(t.shape, dtype=t.dtype)
    plain.copy_(t.detach())
    return plain.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_write_fd_writes_every_kind_of_tensor_exactly(tmp_path):
    """The no-copy view of a plain tensor, and the fallback for everything else."""
    src = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    cases = {
        "plain": src,
        "offset view": src[1:3],
        "scalar": torch.tensor(7, dtype=torch.int16),
        "empty": torch.zeros(0),
        "transposed": src.t(),
        "bfloat16": src.to(torch.bfloat16),
        "complex": torch.complex(src, -src),
        "parameter": torch.nn.Parameter(src.clone()),
        "wrapper subclass": offloaded_tensor(tmp_path, src),
    }
    for name, t in cases.items():
        path = tmp_path / name.replace(" ", "_")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fileio.write_fd(fd, t, 3)
        finally:
            os.close(fd)
        expected = src_bytes(t)
        assert path.read_bytes() == (b"\0" * 3 + expected if expected else b""), name


# ----------------------------------------------------------------------------- writer threads


def many_levels(levels: int = 30, leaves: int = 4, seed: int = 0) -> TensorTree:
    g = torch.Generator().manual_seed(seed)
    return TensorTree(
        {f"l{i}": {f"x{k}": torch.randn(3, generator=g) for k in range(leaves)} for i in range(levels)}
    )


@pytest.fixture
def writers(monkeypatch):
    """Names of the threads that created leaf files."""
    names: list[str] = []
    real = write_mod.create_leaf

    def spy(*a, **kw):
        names.append(threading.current_thread().name)
        return real(*a, **kw)

    monkeypatch.setattr(write_mod, "create_leaf", spy)
    return names


def test_small_tree_is_written_by_the_calling_thread(tmp_path, writers):
    tree = many_levels(2)
    out = tree.memmap(tmp_path / "t", num_threads=8)  # ~1 ms of work: threads would cost more
    assert set(writers) == {threading.current_thread().name}
    assert_tree_equal_to(out, leaf_dict(tree))


def test_threads_are_sized_by_work(tmp_path, monkeypatch, writers):
    monkeypatch.setattr(write_mod, "THREAD_MIN_WORK", 4 * write_mod.FILE_COST)  # 4 files a thread
    tree = many_levels(3, 4)  # 12 leaves: work for 3 threads
    tree.memmap(tmp_path / "t", num_threads=8)
    assert len(set(writers)) <= 3 and all(n.startswith("memtree-write-") for n in writers)
    writers.clear()
    tree.memmap(tmp_path / "u", num_threads=2)
    assert len(set(writers)) <= 2 and all(n.startswith("memtree-write-") for n in writers)


@pytest.mark.parametrize("checksum", [None, "crc32"])
@pytest.mark.parametrize("fsync", [False, True])
def test_threaded_write_of_many_levels_round_trips(tmp_path, monkeypatch, checksum, fsync):
    monkeypatch.setattr(write_mod, "THREAD_MIN_WORK", 1)  # threads for leaves and meta.json files
    tree = many_levels(40, 3)
    tree["big"] = torch.randn(2, fileio.PREALLOCATE_MIN // 4)
    out = tree.memmap(tmp_path / "t", num_threads=4, checksum=checksum, fsync=fsync)
    assert_tree_equal_to(out, leaf_dict(tree))
    loaded = memtree.load_memmap(tmp_path / "t", verify=checksum is not None)
    assert_tree_equal_to(loaded, leaf_dict(tree))
    report = memtree.verify_tree(tmp_path / "t")
    assert report.ok and report.checksummed == (121 if checksum else 0)


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "injected"), KeyboardInterrupt("injected")], ids=["EIO", "KeyboardInterrupt"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_failure_in_one_thread_stops_the_others(tmp_path, monkeypatch, exc, overwrite):
    """Row 33 with threads: the first failure is raised once every thread has stopped."""
    monkeypatch.setattr(write_mod, "THREAD_MIN_WORK", 1)
    prefix = tmp_path / "t"
    old = many_levels(2, 2, seed=1)
    if overwrite:
        old.memmap(prefix)
    real = write_mod.create_leaf
    started: list[str] = []
    lock = threading.Lock()

    def flaky(*a, **kw):
        with lock:
            started.append(a[0])
            n = len(started)
        if n == 3:
            raise exc
        if n > 3:
            threading.Event().wait(0.2)  # slow leaves: the failure is seen while they run
        return real(*a, **kw)

    monkeypatch.setattr(write_mod, "create_leaf", flaky)
    expected = memtree.StorageError if isinstance(exc, OSError) else KeyboardInterrupt
    with pytest.raises(expected, match="injected") as ei:
        many_levels(10, 4).memmap(prefix, num_threads=3)
    assert getattr(ei.value, "errno", None) == getattr(exc, "errno", None)
    assert len(started) < 10, f"{len(started)} of 40 leaves were started after the failure"
    assert not any(t.name.startswith("memtree-write-") for t in threading.enumerate())
    assert os.listdir(tmp_path) == (["t"] if overwrite else [])
    if overwrite:
        assert_tree_equal_to(memtree.load_memmap(prefix), leaf_dict(old))


def test_no_garbage_collection_while_planning(tmp_path, monkeypatch):
    runs: list[int] = []

    def count(phase, info):
        if phase == "start":
            runs.append(info["generation"])

    real = write_mod.plan_write

    def watched(*a, **kw):
        gc.callbacks.append(count)
        try:
            return real(*a, **kw)
        finally:
            gc.callbacks.remove(count)

    monkeypatch.setattr(write_mod, "plan_write", watched)
    tree = many_levels(50, 40)  # 2,000 leaves: dozens of collections if the collector ran
    gc.collect()
    tree.memmap(tmp_path / "t")
    assert runs == []
    assert gc.isenabled()


# ----------------------------------------------------------------------------- the old copy


@pytest.fixture
def big_overwrite(monkeypatch):
    """Make every overwrite delete its old copy in the background (as a large tree's does)."""
    monkeypatch.setattr(write_mod, "BACKGROUND_REMOVAL_FILES", 0)
    yield
    assert write_mod.wait_for_removals(timeout=60)


def hidden(parent: Path) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


def test_small_overwrite_removes_the_old_copy_before_returning(tmp_path):
    many_levels(2, seed=1).memmap(tmp_path / "t")
    many_levels(2, seed=2).memmap(tmp_path / "t")
    assert os.listdir(tmp_path) == ["t"]


def test_large_overwrite_returns_before_the_old_copy_is_deleted(tmp_path, monkeypatch, big_overwrite):
    prefix = tmp_path / "t"
    old, new = many_levels(seed=1), many_levels(seed=2)
    old.memmap(prefix)
    reader = memtree.load_memmap(prefix, lazy=False)  # maps the old files
    release = threading.Event()
    real = shutil.rmtree

    def slow(path, *a, **kw):
        if threading.current_thread().name == "memtree-remove-old":
            assert release.wait(30)
        return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", slow)
    new.memmap(prefix)
    (staging,) = hidden(tmp_path)  # the old tree, under its hidden staging name
    assert ".t.memtree-tmp-" in staging
    assert not write_mod.wait_for_removals(timeout=0)
    assert_tree_equal_to(memtree.load_memmap(prefix), leaf_dict(new))
    assert_tree_equal_to(reader, leaf_dict(old))
    release.set()
    assert write_mod.wait_for_removals(timeout=30)
    assert os.listdir(tmp_path) == ["t"]
    assert_tree_equal_to(memtree.load_memmap(prefix), leaf_dict(new))
    assert_tree_equal_to(reader, leaf_dict(old))  # mappings outlive the deletion


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two_renames"])
def test_background_removal_deletes_only_the_old_tree(tmp_path, monkeypatch, big_overwrite, exchange):
    if not exchange:
        def no_exchange(olddir, old, newdir, new, flags):
            import ctypes

            if flags == 2:
                ctypes.set_errno(errno.EINVAL)
                return -1
            return real_rename2(olddir, old, newdir, new, flags)

        real_rename2 = commit_mod._renameat2
        monkeypatch.setattr(commit_mod, "_renameat2", no_exchange)
    prefix = tmp_path / "t"
    trees = [many_levels(seed=i) for i in range(4)]
    for tree in trees:  # back to back: each deletion may still run while the next write does
        tree.memmap(prefix)
    assert write_mod.wait_for_removals(timeout=60)
    assert os.listdir(tmp_path) == ["t"]
    assert_tree_equal_to(memtree.load_memmap(prefix), leaf_dict(trees[-1]))


def test_old_copy_left_by_an_interrupted_removal_is_recovered(tmp_path, monkeypatch, big_overwrite):
    """A process that dies before the background deletion ends leaves a hidden staging name."""
    prefix = tmp_path / "t"
    many_levels(seed=1).memmap(prefix)
    real = shutil.rmtree

    def killed(path, *a, **kw):  # the deletion never runs, as when the process is killed
        if threading.current_thread().name != "memtree-remove-old":
            return real(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", killed)
    new = many_levels(seed=2)
    new.memmap(prefix)
    assert write_mod.wait_for_removals(timeout=30)
    assert len(hidden(tmp_path)) == 1
    monkeypatch.undo()
    assert [a.split(": ")[0] for a in memtree.recover(tmp_path)] == ["removed staging directory"]
    assert os.listdir(tmp_path) == ["t"]
    assert_tree_equal_to(memtree.load_memmap(prefix), leaf_dict(new))


def _overwrite_and_die(prefix: str) -> None:
    write_mod.BACKGROUND_REMOVAL_FILES = 0
    many_levels(seed=2, levels=200).memmap(prefix)
    os._exit(0)  # no interpreter shutdown: the deletion thread dies wherever it is


def test_process_killed_during_background_removal(tmp_path):
    prefix = tmp_path / "t"
    many_levels(seed=1, levels=200).memmap(prefix)
    p = mp.get_context("fork").Process(target=_overwrite_and_die, args=(str(prefix),))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    assert_tree_equal_to(memtree.load_memmap(prefix), leaf_dict(many_levels(seed=2, levels=200)))
    memtree.recover(tmp_path)
    assert os.listdir(tmp_path) == ["t"]


@pytest.mark.slow
def test_interpreter_exit_waits_for_the_removal(tmp_path):
    code = f"""
import shutil, time, threading
import torch
from memtree import TensorTree
from memtree.store.writing import write
write.BACKGROUND_REMOVAL_FILES = 0
real = shutil.rmtree
checked = threading.Event()
def slow(path, *a, **kw):
    checked.wait(60)  # however late this process is scheduled, the check below sees the old copy
    time.sleep(0.5)
    return real(path, *a, **kw)
shutil.rmtree = slow
TensorTree({{"x": torch.ones(2)}}).memmap({str(tmp_path / "t")!r})
TensorTree({{"x": torch.zeros(2)}}).memmap({str(tmp_path / "t")!r})
assert len([n for n in __import__("os").listdir({str(tmp_path)!r})]) == 2  # still deleting
checked.set()
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(memtree.__file__).parents[1]), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
    assert os.listdir(tmp_path) == ["t"]


# ----------------------------------------------------------------------------- the returned tree


@pytest.mark.parametrize("checksum", [None, "sha256"])
def test_returned_tree_holds_the_metadata_as_written(tmp_path, checksum):
    """write_tree opens the new tree from what it wrote (no meta.json read back), exactly."""
    from memtree.format.schema import parse_level
    from memtree.format.level import Level

    level = Level((2,), {"x": torch.arange(4).reshape(2, 2), "sub": Level((2,), {"y": torch.ones(2, 3)})})
    root = write_mod.write_tree(tmp_path / "t", level, WriteOptions.of(checksum=checksum))
    on_disk = parse_level((tmp_path / "t" / "meta.json").read_bytes(), "meta.json")
    assert root.meta == on_disk and on_disk.save_id is not None
    sub = root.load()["sub"]
    assert sub.meta == parse_level((tmp_path / "t" / "sub" / "meta.json").read_bytes(), "sub/meta.json")
    assert (sub.meta.entries[0].checksum is not None) == (checksum is not None)
