"""Reliability of writes and loads: the writer lock, the commit protocol and its syscall order,
recovery after a crashed writer, checksums (``checksum=``, ``verify=True``, ``memtree verify``),
concurrent readers and writers, and resource faults (file too large, disk full, permission
denied, read-only filesystem). RELIABILITY.md §7 rows 30-37 and §8a; docs/format.md "How a write
is committed" and "Checksums and locking".

Crash tests (kill -9 at every step) are in test_faults.py; the child-process fuzzer of the loader
is in test_fuzz_load.py.
"""

from __future__ import annotations

import errno
import faulthandler
import hashlib
import importlib
import json
import multiprocessing as mp
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import zlib
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

import memtree
from memtree.store.reading.options import WriteOptions
from memtree import TensorTree
from memtree.store.primitives import commit as commit_mod
from memtree.store.primitives import durability as durability_mod
from memtree.store.writing import write as write_mod
from treeutil import fingerprint, flat, plain
from treeutil import raw_bytes as raw

recover_mod = importlib.import_module("memtree.store.writing.recovery")

pytestmark = pytest.mark.timeout(240)

FORK = mp.get_context("fork")


# ----------------------------------------------------------------------------- helpers


def sample(seed: int = 0, batch: int = 4, big: int = 0) -> TensorTree:
    g = torch.Generator().manual_seed(seed)
    t = TensorTree(
        {
            "obs": torch.randn(batch, 3, generator=g),
            "act": torch.randint(0, 10, (batch,), generator=g),
            "nested": {
                "x": torch.randn(batch, 2, 2, generator=g).to(torch.bfloat16),
                "empty": torch.zeros(batch, 0),
                "deeper": {"mask": torch.rand(batch, generator=g) > 0.5},
            },
            "name": f"tree-{seed}",
        },
        batch_size=[batch],
    )
    if big:
        t["big"] = torch.randint(0, 256, (batch, big), dtype=torch.uint8, generator=g)
    return t


def others(parent: Path, *keep: str) -> list[str]:
    """Names in parent other than the given ones (staging dirs, old copies, lock files...)."""
    return sorted(n for n in os.listdir(parent) if n not in keep)


def _child_main(conn, fn, args):
    try:
        result = ("ok", fn(*args))
    except BaseException as e:  # report everything; the parent decides
        result = ("raise", type(e).__name__, getattr(e, "errno", None), str(e), isinstance(e, memtree.MemtreeError))
    conn.send(result)
    conn.close()


def in_child(fn, *args, timeout: float = 120):
    """Run fn(*args) in a forked process; return its result; fail if it hangs or is signalled."""
    recv, send = FORK.Pipe(duplex=False)
    p = FORK.Process(target=_child_main, args=(send, fn, args))
    p.start()
    send.close()
    if not recv.poll(timeout):
        p.kill()
        p.join()
        pytest.fail(f"child did not answer within {timeout} s (hang)")
    try:
        result = recv.recv()
    except EOFError:
        result = None
    p.join(timeout)
    assert p.exitcode == 0, f"child died with exit code {p.exitcode} (negative: killed by signal {-p.exitcode})"
    return result


@pytest.fixture
def parent(tmp_path) -> Path:
    d = tmp_path / "parent"
    d.mkdir()
    return d


@pytest.fixture(autouse=True)
def threads_even_for_small_trees(monkeypatch):
    """num_threads=N starts real writer threads here, however small the test's tree."""
    monkeypatch.setattr(write_mod, "THREAD_MIN_WORK", 1)


@pytest.fixture
def short_lock(monkeypatch):
    monkeypatch.setattr(commit_mod, "LOCK_TIMEOUT", 0.05)


def lock_of(prefix: Path) -> commit_mod.WriterLock:
    return commit_mod.WriterLock(recover_mod.lock_path(str(prefix.parent), prefix.name), str(prefix), timeout=0)


# ----------------------------------------------------------------------------- writer lock (row 36)


def test_lock_file_exists_only_during_the_write(parent, monkeypatch):
    prefix = parent / "tree"
    seen = []
    real = write_mod._write_staging

    def spy(*a, **kw):
        seen.append(sorted(os.listdir(parent)))
        return real(*a, **kw)

    monkeypatch.setattr(write_mod, "_write_staging", spy)
    sample().memmap(prefix)
    assert ".tree.memtree.lock" in seen[0]
    assert any(".tree.memtree-tmp-" in n for n in seen[0])
    assert os.listdir(parent) == ["tree"]


@pytest.mark.parametrize("existing", [False, True])
def test_second_writer_gets_lock_error_and_touches_nothing(parent, short_lock, existing):
    prefix = parent / "tree"
    if existing:
        sample(1).memmap(prefix)
    before = sorted(os.listdir(parent))
    with lock_of(prefix):
        with pytest.raises(memtree.LockError) as ei:
            sample(2).memmap(prefix)
        assert isinstance(ei.value, TimeoutError)
        assert str(prefix) in str(ei.value) and "memtree.lock" in str(ei.value)
        assert sorted(os.listdir(parent)) == sorted(before + [".tree.memtree.lock"])
    assert sorted(os.listdir(parent)) == before
    if existing:
        assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(1))


def test_lock_of_one_destination_does_not_block_another(parent, short_lock):
    with lock_of(parent / "a"):
        sample().memmap(parent / "b")
    assert fingerprint(memtree.load_memmap(parent / "b")) == fingerprint(sample())


def test_writer_waits_for_lock_released_within_timeout(parent, monkeypatch):
    monkeypatch.setattr(commit_mod, "LOCK_TIMEOUT", 30.0)
    prefix = parent / "tree"
    lock = lock_of(prefix)
    lock.acquire()
    timer = threading.Timer(0.2, lock.release)
    timer.start()
    sample(3).memmap(prefix)  # blocks until the timer releases the lock
    timer.join()
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(3))
    assert os.listdir(parent) == ["tree"]


def test_waiter_on_an_unlinked_lock_inode_starts_over(tmp_path):
    path = str(tmp_path / ".t.memtree.lock")
    first = commit_mod.WriterLock(path, "t", timeout=0)
    first.acquire()
    stale_fd = os.open(path, os.O_RDWR)  # what a waiter opened before the release
    first.release()  # unlinks, then unlocks
    second = commit_mod.WriterLock(path, "t", timeout=5)
    second.acquire()
    try:
        assert os.fstat(second.fd).st_ino == os.stat(path).st_ino
        assert os.fstat(second.fd).st_ino != os.fstat(stale_fd).st_ino
        third = commit_mod.WriterLock(path, "t", timeout=0)
        with pytest.raises(memtree.LockError):
            third.acquire()
    finally:
        second.release()
        os.close(stale_fd)


def test_stale_lock_file_of_a_dead_writer_does_not_block(parent):
    prefix = parent / "tree"
    (parent / ".tree.memtree.lock").write_bytes(b"")  # left by a writer killed with -9
    sample().memmap(prefix)
    assert os.listdir(parent) == ["tree"]


def _barrier_writer(barrier, prefix, seed, existsok, big):
    commit_mod.LOCK_TIMEOUT = 0.0
    barrier.wait()
    try:
        sample(seed, big=big).memmap(prefix, existsok=existsok, num_threads=2)
    except memtree.MemtreeError as e:
        return type(e).__name__
    return "committed"


def _run_two_writers(prefix, existsok, big):
    barrier = FORK.Barrier(2)
    results = FORK.Queue()

    def target(seed):
        results.put((seed, _barrier_writer(barrier, prefix, seed, existsok, big)))

    procs = [FORK.Process(target=target, args=(seed,)) for seed in (11, 12)]
    for p in procs:
        p.start()
    out = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return out


def test_two_writers_released_together_exactly_one_commits(parent):
    prefix = parent / "tree"
    out = _run_two_writers(prefix, existsok=False, big=1 << 20)
    winners = [s for s, r in out.items() if r == "committed"]
    assert len(winners) == 1, out
    loser = next(r for r in out.values() if r != "committed")
    assert loser in ("LockError", "DestinationExistsError"), out
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(winners[0], big=1 << 20))
    assert os.listdir(parent) == ["tree"]


def test_two_overwriters_never_interleave(parent):
    prefix = parent / "tree"
    sample(0).memmap(prefix)
    out = _run_two_writers(prefix, existsok=True, big=1 << 20)
    assert set(out.values()) <= {"committed", "LockError"}, out
    committed = [s for s, r in out.items() if r == "committed"]
    assert committed
    loaded = fingerprint(memtree.load_memmap(prefix))
    assert loaded in [fingerprint(sample(s, big=1 << 20)) for s in committed]
    assert os.listdir(parent) == ["tree"]


# ----------------------------------------------------------------------------- publish and syscall order


class Recorder:
    """Records fsync and syncfs (by path), file creation, rename and renameat2 calls, in order."""

    def __init__(self, monkeypatch, *, exchange: bool = True, noreplace: bool = True):
        self.calls: list[tuple] = []
        real_fsync, real_open, real_rename = os.fsync, os.open, os.rename
        real_rename2 = commit_mod._renameat2
        real_syncfs = durability_mod._syncfs

        def fsync(fd):
            self.calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return real_fsync(fd)

        def syncfs(fd):
            self.calls.append(("syncfs", os.readlink(f"/proc/self/fd/{fd}")))
            return real_syncfs(fd)

        def open_(path, flags, mode=0o777, *, dir_fd=None):
            fd = real_open(path, flags, mode, dir_fd=dir_fd)
            if flags & os.O_CREAT:
                self.calls.append(("create", os.readlink(f"/proc/self/fd/{fd}")))
            return fd

        def rename(a, b, **kw):
            self.calls.append(("rename", os.fspath(a), os.fspath(b)))
            return real_rename(a, b, **kw)

        def rename2(olddir, old, newdir, new, flags):
            self.calls.append(("renameat2", os.fsdecode(old), os.fsdecode(new), flags))
            if (flags == 2 and not exchange) or (flags == 1 and not noreplace):
                import ctypes

                ctypes.set_errno(errno.EINVAL)
                return -1
            return real_rename2(olddir, old, newdir, new, flags)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(commit_mod, "_renameat2", rename2)
        if real_syncfs is not None:
            monkeypatch.setattr(durability_mod, "_syncfs", syncfs)

    def index(self, pred) -> list[int]:
        return [i for i, c in enumerate(self.calls) if pred(c)]


def _staging_dir(calls) -> str:
    for c in calls:
        if c[0] == "create" and ".memtree-tmp-" in c[1]:
            parts = c[1].split(os.sep)
            i = next(i for i, part in enumerate(parts) if ".memtree-tmp-" in part)
            return os.sep.join(parts[: i + 1])
    raise AssertionError("no file created in a staging directory")


def per_file_fsync(monkeypatch) -> None:
    """Make every write fsync its files one by one (as where syncfs is not known to be as safe)."""
    monkeypatch.setattr(durability_mod, "syncfs_refusal", lambda fd: "per-file fsync (this test)")


def syncfs_or_skip(parent: Path) -> None:
    fd = os.open(parent, os.O_RDONLY)
    try:
        why = durability_mod.syncfs_refusal(fd)
    finally:
        os.close(fd)
    if why is not None:
        pytest.skip(f"no batched durability here: {why}")


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("num_threads", [0, 3])
def test_fsync_order_leaves_then_root_meta_then_publish_then_parent(parent, monkeypatch, overwrite, num_threads):
    prefix = parent / "tree"
    if overwrite:
        sample(1).memmap(prefix)
    per_file_fsync(monkeypatch)
    rec = Recorder(monkeypatch)
    sample(2).memmap(prefix, fsync=True, num_threads=num_threads)
    calls = rec.calls
    staging = _staging_dir(calls)
    assert os.path.dirname(staging) == str(parent)
    leaf_creates = [c[1] for c in calls if c[0] == "create" and c[1].endswith(".memmap")]
    assert len(leaf_creates) == 5
    root_meta = os.path.join(staging, "meta.json")
    (root_create,) = rec.index(lambda c: c == ("create", root_meta))
    (publish,) = rec.index(lambda c: c[0] == "renameat2")
    assert calls[publish][1:] == (staging, str(prefix), 2 if overwrite else 1)
    for leaf in leaf_creates:  # every leaf is fsynced before the root meta.json exists
        (i,) = rec.index(lambda c, leaf=leaf: c == ("fsync", leaf))
        assert i < root_create
    for d in ["nested/deeper", "nested", ""]:  # each meta.json, then its directory, deepest first
        meta = os.path.join(staging, d, "meta.json")
        (m,) = rec.index(lambda c, meta=meta: c == ("fsync", meta))
        (dd,) = rec.index(lambda c, d=d: c == ("fsync", os.path.join(staging, d).rstrip("/")))
        assert m < dd < publish
    (parent_sync,) = rec.index(lambda c: c == ("fsync", str(parent)))
    assert parent_sync > publish
    assert not rec.index(lambda c: c[0] == "syncfs")
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(2))


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
@pytest.mark.parametrize("num_threads", [0, 3])
def test_batched_durability_one_syncfs_after_every_file_before_the_publish(parent, monkeypatch, overwrite, num_threads):
    """Where syncfs reports writeback errors and flushes every file (docs/format.md,
    "Durability"), a durable write makes one syncfs call after its last file, the root
    meta.json, and before the publishing rename, instead of an fsync per file and directory;
    the rename is still made durable by an fsync of the parent."""
    syncfs_or_skip(parent)
    prefix = parent / "tree"
    if overwrite:
        sample(1).memmap(prefix)
    rec = Recorder(monkeypatch)
    sample(2).memmap(prefix, fsync=True, num_threads=num_threads)
    calls = rec.calls
    staging = _staging_dir(calls)
    (synced,) = rec.index(lambda c: c[0] == "syncfs")
    assert calls[synced][1] == staging
    creates = rec.index(lambda c: c[0] == "create" and c[1].startswith(staging + os.sep))
    assert len(creates) == 5 + 3 and max(creates) < synced  # 5 leaves, 3 meta.json files
    (publish,) = rec.index(lambda c: c[0] == "renameat2")
    assert synced < publish
    assert [c for c in calls if c[0] == "fsync"] == [("fsync", str(parent))]  # no file's, no directory's
    assert rec.index(lambda c: c[0] == "fsync")[0] > publish
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(2))


def test_a_failed_syncfs_publishes_nothing(parent, monkeypatch):
    """A syncfs that reports an error (a page of the filesystem could not be written back)
    fails the write before the rename: the destination keeps the old tree."""
    syncfs_or_skip(parent)
    prefix = parent / "tree"
    sample(1).memmap(prefix)

    def failing(fd):
        import ctypes

        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(durability_mod, "_syncfs", failing)
    with pytest.raises(memtree.StorageError, match="syncfs") as ei:
        sample(2).memmap(prefix, fsync=True)
    assert ei.value.errno == errno.EIO
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(1))
    assert os.listdir(parent) == ["tree"]


@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_no_fsync_without_fsync_flag(parent, monkeypatch, overwrite):
    prefix = parent / "tree"
    if overwrite:
        sample(1).memmap(prefix)
    rec = Recorder(monkeypatch)
    sample(2).memmap(prefix, num_threads=2)
    assert not rec.index(lambda c: c[0] in ("fsync", "syncfs"))
    assert rec.index(lambda c: c[0] == "renameat2")


def test_fallback_without_renameat2_new_destination(parent, monkeypatch):
    prefix = parent / "tree"
    rec = Recorder(monkeypatch, noreplace=False)
    sample(2).memmap(prefix, fsync=True)
    renames = [c for c in rec.calls if c[0] == "rename"]
    assert len(renames) == 1 and renames[0][2] == str(prefix)
    (publish,) = rec.index(lambda c: c[0] == "rename")
    assert rec.index(lambda c: c == ("fsync", str(parent)))[0] > publish
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(2))
    assert os.listdir(parent) == ["tree"]


def test_fallback_overwrite_two_renames_journaled_and_old_copy_removed(parent, monkeypatch):
    prefix = parent / "tree"
    sample(1).memmap(prefix)
    journals = []
    real = commit_mod.WriterLock.write_journal

    def spy(self, record, *, fsync):
        journals.append((dict(record), fsync))
        return real(self, record, fsync=fsync)

    monkeypatch.setattr(commit_mod.WriterLock, "write_journal", spy)
    rec = Recorder(monkeypatch, exchange=False)
    sample(2).memmap(prefix, fsync=True)
    renames = [c for c in rec.calls if c[0] == "rename"]
    assert [r[1] for r in renames][0] == str(prefix)
    old = renames[0][2]
    assert os.path.basename(old).startswith(".tree.memtree-old-")
    assert renames[1][2] == str(prefix)
    assert journals[-1] == ({"staging": os.path.basename(renames[1][1]), "old": os.path.basename(old)}, True)
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(2))
    assert os.listdir(parent) == ["tree"]


def test_fallback_overwrite_second_rename_failure_restores_old(parent, monkeypatch):
    prefix = parent / "tree"
    sample(1).memmap(prefix)
    Recorder(monkeypatch, exchange=False)
    real = os.rename  # the recorder's wrapper

    def failing(a, b, **kw):
        if ".memtree-tmp-" in os.fspath(a):
            raise OSError(errno.EIO, "injected", os.fspath(a))
        return real(a, b, **kw)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(memtree.StorageError) as ei:
        sample(2).memmap(prefix)
    assert ei.value.errno == errno.EIO
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(1))
    assert os.listdir(parent) == ["tree"]


def test_writer_does_not_list_the_parent_directory(parent, monkeypatch):
    """The lock, recovery and publish cost O(1) per write: the parent is never listed."""
    prefix = parent / "tree"
    sample(1).memmap(prefix)
    real_listdir, real_scandir = os.listdir, os.scandir

    def guard(fn):
        def wrapper(path=".", *a, **kw):
            if not isinstance(path, int):
                assert os.path.realpath(path) != str(parent), "the writer listed the parent directory"
            return fn(path, *a, **kw)

        return wrapper

    monkeypatch.setattr(os, "listdir", guard(real_listdir))
    monkeypatch.setattr(os, "scandir", guard(real_scandir))
    sample(2).memmap(prefix)
    sample(3).memmap(parent / "other")
    monkeypatch.undo()
    assert sorted(os.listdir(parent)) == ["other", "tree"]


# ----------------------------------------------------------------------------- exceptions during a write (§8a test 2)


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "injected"), RuntimeError("injected"), KeyboardInterrupt("injected")],
                         ids=["EIO", "RuntimeError", "KeyboardInterrupt"])
@pytest.mark.parametrize("num_threads", [0, 3])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_exception_in_a_leaf_write_cleans_up_and_comes_back(parent, monkeypatch, exc, num_threads, overwrite):
    prefix = parent / "tree"
    if overwrite:
        sample(1).memmap(prefix)
    real = write_mod.create_leaf
    count = {"n": 0}
    lock = threading.Lock()

    def flaky(*a, **kw):
        with lock:
            count["n"] += 1
            n = count["n"]
        if n == 3:
            raise exc
        return real(*a, **kw)

    monkeypatch.setattr(write_mod, "create_leaf", flaky)
    expected = memtree.StorageError if isinstance(exc, OSError) else type(exc)
    with pytest.raises(expected) as ei:
        sample(2).memmap(prefix, num_threads=num_threads, checksum="crc32")
    assert "injected" in str(ei.value)
    assert os.listdir(parent) == (["tree"] if overwrite else [])
    if overwrite:
        assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(1))
    monkeypatch.undo()
    sample(4).memmap(prefix)  # the lock was released
    assert os.listdir(parent) == ["tree"]


def test_exception_while_writing_root_meta_leaves_destination_unchanged(parent, monkeypatch):
    prefix = parent / "tree"
    sample(1).memmap(prefix)
    real = write_mod.write_small_file

    def failing(path, data, *, fsync):
        if os.path.dirname(path).startswith(str(parent / ".tree.memtree-tmp-")) and b'"save_id"' in data:
            raise OSError(errno.ENOSPC, "injected", path)
        return real(path, data, fsync=fsync)

    monkeypatch.setattr(write_mod, "write_small_file", failing)
    with pytest.raises(memtree.StorageError) as ei:
        sample(2).memmap(prefix)
    assert ei.value.errno == errno.ENOSPC
    assert os.listdir(parent) == ["tree"]
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(1))


# ----------------------------------------------------------------------------- recovery


def _old_copy(parent: Path, name: str, seed: int) -> Path:
    """An old copy as the fallback overwrite leaves it between its two renames."""
    old = parent / f".{name}.memtree-old-{os.urandom(16).hex()}"
    sample(seed).memmap(old.parent / "scratch")
    os.rename(old.parent / "scratch", old)
    return old


def _staging(parent: Path, name: str) -> Path:
    s = parent / f".{name}.memtree-tmp-{os.urandom(16).hex()}"
    s.mkdir()
    (s / "a.memmap").write_bytes(b"partial")
    return s


@pytest.mark.parametrize("how", ["prefix", "parent"])
def test_recover_restores_destination_missing_between_renames(parent, how):
    prefix = parent / "tree"
    _old_copy(parent, "tree", seed=5)
    _staging(parent, "tree")
    (parent / ".tree.memtree.lock").write_bytes(b"")
    with pytest.raises(memtree.NotAMemtreeError):
        memtree.load_memmap(prefix)
    actions = memtree.recover(prefix if how == "prefix" else parent)
    assert any(a.startswith("restored the old tree") for a in actions)
    assert any(a.startswith("removed staging directory") for a in actions)
    assert os.listdir(parent) == ["tree"]
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(5))
    assert memtree.recover(parent) == []


def test_recover_removes_old_copy_when_destination_exists(parent):
    sample(6).memmap(parent / "tree")
    old = _old_copy(parent, "tree", seed=5)
    actions = memtree.recover(parent)
    assert actions == [f"removed old copy: {old}"]
    assert fingerprint(memtree.load_memmap(parent / "tree")) == fingerprint(sample(6))
    assert os.listdir(parent) == ["tree"]


def test_recover_leaves_ambiguous_old_copies_alone(parent):
    a, b = _old_copy(parent, "tree", 1), _old_copy(parent, "tree", 2)
    actions = memtree.recover(parent)
    assert len(actions) == 1 and "left 2 old copies" in actions[0]
    assert sorted(os.listdir(parent)) == sorted([a.name, b.name])


def test_recover_skips_a_destination_whose_writer_is_alive(parent):
    s = _staging(parent, "tree")
    with lock_of(parent / "tree"):
        actions = memtree.recover(parent)
    assert actions == [f"skipped {parent / 'tree'}: a writer holds its lock right now"]
    assert s.exists()


def test_recover_handles_several_destinations_and_ignores_other_files(parent):
    sample(1).memmap(parent / "a")
    _staging(parent, "a")
    _staging(parent, "b")
    (parent / ".c.memtree.lock").write_bytes(b"")
    (parent / ".a.memtree-tmp-notahexname").mkdir()  # not memtree's: never touched
    (parent / "unrelated.txt").write_text("keep")
    actions = memtree.recover(parent)
    assert len(actions) == 3
    assert sorted(os.listdir(parent)) == [".a.memtree-tmp-notahexname", "a", "unrelated.txt"]


def test_recover_never_follows_a_symlinked_leftover(parent, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    os.symlink(outside, parent / f".tree.memtree-tmp-{'ab' * 16}")
    memtree.recover(parent)
    assert (outside / "precious").read_text() == "keep"


def test_next_writer_replays_the_journal_of_a_crashed_one(parent):
    prefix = parent / "tree"
    sample(1).memmap(prefix)
    staging, old = _staging(parent, "tree"), _old_copy(parent, "tree", 9)
    lock = lock_of(prefix)
    lock.acquire()
    lock.write_journal({"staging": staging.name, "old": old.name}, fsync=False)
    os.close(lock.fd)  # die holding it: the file and its journal stay, the flock goes
    sample(2).memmap(prefix)
    assert os.listdir(parent) == ["tree"]
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(2))


def test_next_writer_restores_old_copy_from_the_journal(parent):
    prefix = parent / "tree"
    old = _old_copy(parent, "tree", 9)
    lock = lock_of(prefix)
    lock.acquire()
    lock.write_journal({"staging": f".tree.memtree-tmp-{'cd' * 16}", "old": old.name}, fsync=False)
    os.close(lock.fd)
    with pytest.raises(memtree.DestinationExistsError):  # the restored tree is back first
        sample(2).memmap(prefix, existsok=False)
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(9))
    assert os.listdir(parent) == ["tree"]


@pytest.mark.parametrize("record", [
    {"staging": "../../etc"}, {"staging": "tree"}, {"old": ".other.memtree-old-" + "0" * 32},
    {"staging": ".tree.memtree-tmp-xyz"}, {"staging": 5}, {"old": ["x"]},
])
def test_journal_never_names_anything_but_this_destinations_siblings(parent, record):
    prefix = parent / "tree"
    sample(1).memmap(prefix)
    victim = parent / (".other.memtree-old-" + "0" * 32)
    victim.mkdir()
    lock = lock_of(prefix)
    lock.acquire()
    lock.write_journal(record, fsync=False)
    os.close(lock.fd)
    sample(2).memmap(prefix)
    assert victim.is_dir()
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(2))


def test_garbage_journal_is_ignored(parent):
    prefix = parent / "tree"
    (parent / ".tree.memtree.lock").write_bytes(b"\xff\x00{not json")
    sample(1).memmap(prefix)
    assert os.listdir(parent) == ["tree"]


@pytest.mark.parametrize("name", [f".tree.memtree-old-{'ab' * 16}", f".tree.memtree-tmp-{'ab' * 16}"])
def test_loader_refuses_staging_and_old_copy_roots(parent, name):
    sample(1).memmap(parent / "scratch")
    os.rename(parent / "scratch", parent / name)
    with pytest.raises(memtree.NotCommittedError) as ei:
        memtree.load_memmap(parent / name)
    assert "recover" in str(ei.value)


# ----------------------------------------------------------------------------- checksums (row 30)


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
@pytest.mark.parametrize("num_threads", [0, 3])
def test_checksums_recorded_match_file_bytes(parent, algorithm, num_threads):
    prefix = parent / "tree"
    tree = sample(3, big=1 << 20)
    tree["float8"] = torch.randn(4, 5).to(torch.float8_e4m3fn)
    tree.memmap(prefix, checksum=algorithm, num_threads=num_threads)
    n = 0
    for d, _, files in os.walk(prefix):
        meta = json.loads((Path(d) / "meta.json").read_bytes())
        for e in meta["entries"]:
            if e["kind"] != "tensor":
                continue
            data = (Path(d) / e["file"]).read_bytes()
            want = f"crc32:{zlib.crc32(data):08x}" if algorithm == "crc32" else f"sha256:{hashlib.sha256(data).hexdigest()}"
            assert e["checksum"] == want
            n += 1
    assert n == 7
    loaded = memtree.load_memmap(prefix, verify=True)
    assert fingerprint(loaded) == fingerprint(tree)


def test_checksum_of_zero_element_leaf(parent):
    TensorTree({"e": torch.zeros(0)}).memmap(parent / "t", checksum="crc32")
    assert json.loads((parent / "t" / "meta.json").read_bytes())["entries"][0]["checksum"] == "crc32:00000000"
    memtree.load_memmap(parent / "t", verify=True)


def test_memmap_in_place_with_checksum(parent):
    tree = sample(4)
    tree.memmap_(parent / "t", checksum="sha256")
    assert tree.is_memmap()
    memtree.load_memmap(parent / "t", verify=True)
    assert memtree.verify_tree(parent / "t").checksummed == 5


def test_checksums_by_default_and_none_on_request(parent):
    from memtree.store.primitives.checksums import default_checksum

    sample().memmap(parent / "t")
    meta = json.loads((parent / "t" / "meta.json").read_bytes())
    tensors = [e for e in meta["entries"] if e["kind"] == "tensor"]
    assert tensors and all(e["checksum"].startswith(default_checksum() + ":") for e in tensors)
    sample().memmap(parent / "n", checksum=None)
    meta = json.loads((parent / "n" / "meta.json").read_bytes())
    assert all("checksum" not in e for e in meta["entries"]) and "tree_hash" not in meta


@pytest.mark.parametrize("bad", ["md5", "CRC32", "", "crc32:"])
def test_unknown_checksum_algorithm_refused_before_writing(parent, bad):
    with pytest.raises(ValueError):
        sample().memmap(parent / "t", checksum=bad)
    assert os.listdir(parent) == []


def test_memmap_like_takes_no_checksum(parent):
    with pytest.raises(ValueError):
        write_mod.write_tree(str(parent / "t"), sample()._to_level(), WriteOptions.of(like=True, checksum="crc32"))
    assert os.listdir(parent) == []


def _flip(path: Path, offset: int = 0) -> None:
    """Damage (bit rot): one bit flipped, the file's modification time kept (a later one would
    mean a write in place, which verification reports as a stale checksum instead)."""
    times = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


@pytest.mark.parametrize("kw", [{}, {"mode": "r"}, {"mmap": False}], ids=["default", "mode_r", "no_mmap"])
@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_bit_flip_detected_by_verify_with_key_path_expected_found(parent, kw, algorithm):
    prefix = parent / "t"
    sample(5).memmap(prefix, checksum=algorithm)
    leaf = prefix / "nested" / "x.memmap"
    meta = json.loads((prefix / "nested" / "meta.json").read_bytes())
    expected = next(e["checksum"] for e in meta["entries"] if e["key"] == "x")
    _flip(leaf, 5)
    data = leaf.read_bytes()
    found = f"crc32:{zlib.crc32(data):08x}" if algorithm == "crc32" else f"sha256:{hashlib.sha256(data).hexdigest()}"
    before = data
    with pytest.raises(memtree.IntegrityError) as ei:
        memtree.load_memmap(prefix, verify=True, **kw)
    msg = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert "('nested', 'x')" in msg and str(leaf) in msg and expected in msg and found in msg
    assert leaf.read_bytes() == before
    loaded = memtree.load_memmap(prefix, **kw)  # without verify: the size is right, it loads
    assert raw(loaded["nested", "x"]) == data


def test_verify_of_a_partial_load_checks_only_the_selected_leaves(parent):
    prefix = parent / "t"
    sample(5).memmap(prefix, checksum="crc32")
    _flip(prefix / "obs.memmap")
    memtree.load_memmap(prefix, verify=True, keys=["act", ("nested", "x")])
    with pytest.raises(memtree.IntegrityError):
        memtree.load_memmap(prefix, verify=True, keys=["obs"])


def test_verify_reads_only_leaves_with_a_checksum(parent, monkeypatch):
    prefix = parent / "t"
    sample(5).memmap(prefix, checksum=None)
    _flip(prefix / "obs.memmap")
    assert memtree.load_memmap(prefix, verify=True) is not None
    assert memtree.verify_tree(prefix).ok


# ----------------------------------------------------------------------------- verify_tree and `memtree verify`


def _damaged_tree(parent: Path) -> Path:
    prefix = parent / "t"
    tree = sample(7)
    tree["more"] = {"a": torch.arange(4), "b": torch.ones(4, 2)}
    tree.memmap(prefix, checksum="crc32")
    _flip(prefix / "obs.memmap", 3)  # checksum
    os.truncate(prefix / "act.memmap", 5)  # size
    os.unlink(prefix / "nested" / "deeper" / "mask.memmap")  # missing
    (prefix / "more" / "meta.json").write_bytes(b"{broken")  # meta
    return prefix


def test_verify_tree_reports_every_problem(parent):
    prefix = _damaged_tree(parent)
    report = memtree.verify_tree(prefix)
    assert not report.ok
    got = {(p.kind, p.key) for p in report.problems}
    assert got == {
        ("checksum", ("obs",)),
        ("size", ("act",)),
        ("missing", ("nested", "deeper", "mask")),
        ("meta", ("more",)),
    }
    size = next(p for p in report.problems if p.kind == "size")
    assert size.expected.startswith("32 bytes") and size.found == "5 bytes"
    assert size.path == str(prefix / "act.memmap")
    crc = next(p for p in report.problems if p.kind == "checksum")
    data = (prefix / "obs.memmap").read_bytes()
    assert crc.found == f"crc32:{zlib.crc32(data):08x}" and crc.expected.startswith("crc32:")
    assert report.leaves == 5
    assert memtree.verify_tree(prefix, checksums=False).checksummed == 0
    assert {p.kind for p in memtree.verify_tree(prefix, checksums=False).problems} == {"size", "missing", "meta"}


def test_verify_tree_of_clean_tree_and_of_non_trees(parent, tmp_path):
    sample(1).memmap(parent / "t", checksum="sha256")
    r = memtree.verify_tree(parent / "t")
    assert r.ok and r.leaves == 5 and r.checksummed == 5
    assert [p.kind for p in memtree.verify_tree(tmp_path / "missing").problems] == ["not-a-tree"]
    (tmp_path / "empty").mkdir()
    assert [p.kind for p in memtree.verify_tree(tmp_path / "empty").problems] == ["not-a-tree"]


def test_verify_tree_flags_links_and_foreign_file_kinds(parent, tmp_path):
    prefix = parent / "t"
    sample(1).memmap(prefix)
    os.unlink(prefix / "obs.memmap")
    os.symlink(tmp_path / "elsewhere", prefix / "obs.memmap")
    os.unlink(prefix / "act.memmap")
    os.mkfifo(prefix / "act.memmap")
    shutil.rmtree(prefix / "nested")
    os.symlink("/", prefix / "nested")
    kinds = {p.key: (p.kind, p.found) for p in memtree.verify_tree(prefix).problems}
    assert kinds[("obs",)] == ("unsafe", "a symbolic link")
    assert kinds[("act",)] == ("unsafe", "a FIFO")
    assert kinds[("nested",)][0] == "unsafe"


def test_verify_tree_of_a_grown_tree_checks_the_capacity(parent):
    tree = TensorTree({"x": torch.arange(4.0), "y": torch.zeros(4, 3)}, batch_size=[4]).memmap_(parent / "t")
    tree.extend_(TensorTree({"x": torch.ones(3), "y": torch.ones(3, 3)}, batch_size=[3]))
    meta = json.loads((parent / "t" / "meta.json").read_bytes())
    capacity = meta["entries"][0]["capacity"]
    assert capacity > 7 and os.path.getsize(parent / "t" / "x.memmap") == capacity * 4
    assert memtree.verify_tree(parent / "t").ok
    os.truncate(parent / "t" / "x.memmap", 7 * 4)  # enough for the tensor, short of the capacity
    (problem,) = memtree.verify_tree(parent / "t").problems
    assert problem.kind == "size" and problem.expected.startswith(f"{capacity * 4} bytes")
    assert f"capacity {capacity}" in problem.expected and problem.found == "28 bytes"
    with pytest.raises(memtree.LeafSizeError):
        memtree.load_memmap(parent / "t", lazy=False)


def test_verify_agrees_with_load(parent):
    prefix = _damaged_tree(parent)
    with pytest.raises(memtree.MemtreeError):
        memtree.load_memmap(prefix, verify=True)
    prefix2 = parent / "clean"
    sample(2).memmap(prefix2, checksum="crc32")
    assert memtree.verify_tree(prefix2).ok
    memtree.load_memmap(prefix2, verify=True)


def test_cli_verify_exit_codes_and_lines(parent, capsys):
    from memtree.cli import main

    sample(1).memmap(parent / "ok", checksum="crc32")
    assert main(["verify", str(parent / "ok")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "5 checksums compared" in out
    prefix = _damaged_tree(parent)
    assert main(["verify", str(prefix)]) == 1
    lines = capsys.readouterr().out.splitlines()
    bad = [ln for ln in lines if ln.startswith("BAD ")]
    assert len(bad) == 4
    crc = next(ln for ln in bad if "checksum" in ln)
    assert str(prefix / "obs.memmap") in crc and "expected crc32:" in crc and "found crc32:" in crc
    assert any(str(prefix / "act.memmap") in ln and "expected 32 bytes" in ln and "found 5 bytes" in ln for ln in bad)
    assert lines[-1].startswith("FAILED ") and "4 problem(s)" in lines[-1]


def test_cli_verify_json(parent, capsys):
    from memtree.cli import main

    prefix = _damaged_tree(parent)
    assert main(["verify", "--json", str(prefix)]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["path"] == str(prefix) and doc["leaves"] == 5
    assert {(p["kind"], tuple(p["key"])) for p in doc["problems"]} >= {("checksum", ("obs",)), ("size", ("act",))}
    assert all(set(p) == {"path", "key", "kind", "expected", "found", "message"} for p in doc["problems"])
    sample(1).memmap(parent / "ok")
    assert main(["verify", "--json", str(parent / "ok")]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


def test_cli_verify_as_a_program(parent):
    prefix = _damaged_tree(parent)
    r = subprocess.run([sys.executable, "-m", "memtree", "verify", str(prefix)], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 1, r.stderr
    assert r.stdout.count("BAD ") == 4


# ----------------------------------------------------------------------------- readers and writers at once (rows 37, 39)


def _reader_during_overwrite(prefix, mode, conn):
    tree = memtree.load_memmap(prefix, mode=mode)
    first = {k: raw(v[:1]) for k, v in flat(tree).items() if isinstance(v, torch.Tensor)}  # fault in a page
    conn.send("mapped")
    assert conn.recv() == "overwritten"
    conn.send((first, fingerprint(tree)))


@pytest.mark.parametrize("mode", ["r", "r+"])
def test_reader_process_keeps_old_data_while_tree_is_overwritten(parent, mode):
    prefix = parent / "t"
    old, new = sample(1, big=1 << 16), sample(2, big=1 << 16)
    new["only_new"] = torch.ones(4)
    old.memmap(prefix)
    here, there = FORK.Pipe()
    p = FORK.Process(target=_reader_during_overwrite, args=(prefix, mode, there))
    p.start()
    assert here.poll(60) and here.recv() == "mapped"
    new.memmap(prefix, num_threads=2)
    here.send("overwritten")
    assert here.poll(60)
    _, seen = here.recv()
    p.join(60)
    assert p.exitcode == 0
    assert seen == fingerprint(old)
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(new)


def _read_after_truncation(prefix, conn):
    faulthandler.disable()  # the SIGBUS below is expected: no traceback dump
    tree = memtree.load_memmap(prefix, mode="r", lazy=False)
    conn.send("mapped")
    conn.recv()
    conn.send(int(plain(tree["big"]).sum()))  # touches pages the file no longer has


def test_third_party_truncating_a_mapped_leaf_kills_the_reader(parent):
    """Row 38, a documented hazard: memtree never truncates a published file, but if someone else
    does while a process maps it, that process dies with SIGBUS on its next access."""
    prefix = parent / "t"
    sample(1, big=1 << 16).memmap(prefix)
    here, there = FORK.Pipe()
    p = FORK.Process(target=_read_after_truncation, args=(prefix, there))
    p.start()
    assert here.poll(60) and here.recv() == "mapped"
    os.truncate(prefix / "big.memmap", 0)
    here.send("read")
    p.join(60)
    assert p.exitcode == -signal.SIGBUS


class _TreeDataset(Dataset):
    def __init__(self, path):
        self.tree = memtree.load_memmap(path, mode="r")

    def __len__(self):
        return self.tree.batch_size[0]

    def __getitem__(self, i):
        return self.tree["image"][i], self.tree["label"][i]


@pytest.mark.parametrize("batch_size", [4, None], ids=["collated", "uncollated_views"])
def test_dataloader_two_fork_workers_read_a_memmapped_dataset(parent, batch_size):
    n = 37
    src = TensorTree({"image": torch.randint(0, 255, (n, 3, 8, 8), dtype=torch.uint8), "label": torch.arange(n)},
                     batch_size=[n])
    src.memmap(parent / "ds")
    loader = DataLoader(_TreeDataset(parent / "ds"), batch_size=batch_size, num_workers=2,
                        multiprocessing_context="fork", timeout=120)
    images, labels = [], []
    for image, label in loader:
        images.append(plain(image))
        labels.append(plain(label))
    cat = torch.cat if batch_size else torch.stack
    assert torch.equal(cat(images), src["image"]) and torch.equal(cat(labels), src["label"])


def _fill_rows(data, idx, value):
    data[idx] = TensorTree({"img": torch.full((len(idx), 3, 4), value, dtype=torch.uint8),
                            "y": torch.full((len(idx),), value)}, batch_size=[len(idx)])
    again = memtree.load_memmap(data["img"].filename.rsplit("/", 1)[0])
    again["y"][0] = -5


def test_forked_process_writes_by_index_into_memmap_like_dataset(parent):
    datum = TensorTree({"img": torch.zeros(3, 4, dtype=torch.uint8), "y": torch.zeros((), dtype=torch.int64)})
    data = datum.expand(1000).memmap_like(parent / "ds")
    idx = torch.tensor([3, 500, 999])
    assert in_child(_fill_rows, data, idx, 7) == ("ok", None)
    assert torch.equal(plain(data["img"][idx]), torch.full((3, 3, 4), 7, dtype=torch.uint8))
    assert plain(data["y"][idx]).tolist() == [7, 7, 7]
    assert int(data["y"][0]) == -5 and int(data["img"].sum()) == 7 * 3 * 12
    reloaded = memtree.load_memmap(parent / "ds", mode="r")
    assert plain(reloaded["y"][idx]).tolist() == [7, 7, 7] and int(reloaded["y"][0]) == -5


# ----------------------------------------------------------------------------- growth under readers


def _buffer_rows(values: list[int], nested: bool) -> dict:
    v = torch.tensor(values, dtype=torch.int64)
    rows = {"x": v[:, None].float().expand(len(values), 3).contiguous(), "i": v}
    if nested:
        rows["n"] = {"y": v[:, None].to(torch.bfloat16).expand(len(values), 2).contiguous()}
    return rows


_GROWTH_OPS = st.one_of(
    st.tuples(st.just("resize"), st.integers(0, 20)),
    st.tuples(st.just("extend"), st.integers(1, 9)),
    st.tuples(st.just("load"), st.sampled_from(["r", "r+", "own leaves"])),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nested=st.booleans(), ops=st.lists(_GROWTH_OPS, min_size=1, max_size=14))
def test_resize_and_extend_never_change_what_a_tree_loaded_earlier_shows(nested, ops):
    """Any sequence of shrinks and growths: every tree loaded before (mode "r" or "r+") and every
    leaf the growing tree handed out before keeps its values, while the tree and a fresh load
    follow the model (kept rows, zeros for resize_, the appended values)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "buf"
        model = [1, 2, 3]
        buf = TensorTree(_buffer_rows(model, nested), batch_size=[3]).memmap(d)
        readers: list[tuple[dict, dict]] = []
        fresh = 100
        for op, arg in ops:
            if op == "resize":
                buf.resize_(arg)
                model = model[:arg] + [0] * max(0, arg - len(model))
            elif op == "extend":
                new = list(range(fresh, fresh + arg))
                fresh += arg
                buf.extend_(_buffer_rows(new, nested))
                model += new
            else:
                leaves = flat(buf if arg == "own leaves" else memtree.load_memmap(d, mode=arg, lazy=False))
                readers.append((leaves, {k: raw(t) for k, t in leaves.items()}))
            for leaves, seen in readers:
                assert {k: raw(t) for k, t in leaves.items()} == seen, f"a reader's rows changed after {op} {arg}"
            expected = fingerprint(TensorTree(_buffer_rows(model, nested), batch_size=[len(model)]))
            assert fingerprint(buf) == expected
        assert fingerprint(memtree.load_memmap(d)) == expected
        assert sorted(os.listdir(tmp)) == ["buf"]


# ----------------------------------------------------------------------------- resource faults (row 34)


def _write_under_fsize_limit(prefix, limit, num_threads):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    sample(8, big=4 << 20).memmap(prefix, num_threads=num_threads)


@pytest.mark.parametrize("num_threads", [0, 3])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_file_too_large_in_child_gives_storage_error_not_signal(parent, num_threads, overwrite):
    prefix = parent / "t"
    if overwrite:
        sample(1).memmap(prefix)
    result = in_child(_write_under_fsize_limit, prefix, 1 << 20, num_threads)
    assert result[0] == "raise" and result[1] == "StorageError" and result[2] == errno.EFBIG, result
    assert "big" in result[3]
    assert os.listdir(parent) == (["t"] if overwrite else [])
    if overwrite:
        assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(1))


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 1 MiB tmpfs (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs failed: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _write_past_free_space(prefix, skip_check):
    if skip_check:  # another process fills the disk after the up-front check
        from memtree.store.writing import staged

        staged.check_free_space = lambda *a: None
    tree = TensorTree({"a": torch.ones(600 << 10, dtype=torch.uint8), "b": torch.ones(600 << 10, dtype=torch.uint8)})
    tree.memmap(prefix, num_threads=2)


@pytest.mark.parametrize("skip_check", [False, True], ids=["refused_up_front", "enospc_while_writing"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["new", "overwrite"])
def test_disk_full_on_tiny_tmpfs(tiny_tmpfs, skip_check, overwrite):
    prefix = tiny_tmpfs / "t"
    if overwrite:
        sample(1).memmap(prefix)
    result = in_child(_write_past_free_space, prefix, skip_check)
    assert result[0] == "raise" and result[4], result
    assert result[1] == ("StorageError" if skip_check else "InsufficientSpaceError"), result
    assert result[2] == errno.ENOSPC
    assert os.listdir(tiny_tmpfs) == (["t"] if overwrite else [])
    if overwrite:
        assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(1))
    sample(2).memmap(prefix)  # the space was given back
    assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(sample(2))


@pytest.fixture
def shared_tmp():
    """A directory every user can enter (tmp_path is private to root)."""
    d = tempfile.mkdtemp(prefix="memtree-perm-")
    os.chmod(d, 0o755)
    try:
        yield Path(d)
    finally:
        subprocess.run(["chattr", "-R", "-i", d], capture_output=True, check=False)
        shutil.rmtree(d, ignore_errors=True)


def _as_nobody(fn, *args):
    if os.geteuid() == 0:
        os.setgid(65534)
        os.setuid(65534)
    return fn(*args)


def _write(prefix):
    sample(2).memmap(prefix)


def _load(prefix, mode="r"):
    memtree.load_memmap(prefix, mode=mode, lazy=False)


def test_permission_denied_on_write_gives_storage_error(shared_tmp):
    ro = shared_tmp / "ro"
    ro.mkdir()
    sample(1).memmap(ro / "t")
    os.chmod(ro, 0o555)
    result = in_child(_as_nobody, _write, ro / "t")
    assert result[0] == "raise" and result[1] == "StorageError" and result[2] == errno.EACCES, result
    assert str(ro) in result[3]
    os.chmod(ro, 0o755)
    assert os.listdir(ro) == ["t"]
    assert fingerprint(memtree.load_memmap(ro / "t")) == fingerprint(sample(1))


@pytest.mark.parametrize("what", ["leaf", "meta"])
def test_permission_denied_on_load_gives_storage_error(shared_tmp, what):
    prefix = shared_tmp / "t"
    sample(1).memmap(prefix)
    target = prefix / ("obs.memmap" if what == "leaf" else "nested/meta.json")
    os.chmod(target, 0o600)
    if os.geteuid() != 0:
        os.chmod(target, 0o000)
    result = in_child(_as_nobody, _load, prefix)
    assert result[0] == "raise" and result[1] == "StorageError" and result[2] == errno.EACCES, result
    assert str(target) in result[3]


def test_tree_readable_but_not_writable_loads_read_only_and_refuses_read_write(shared_tmp):
    prefix = shared_tmp / "t"
    sample(1).memmap(prefix)
    if os.geteuid() != 0:
        for d, _, files in os.walk(prefix):
            for f in files:
                os.chmod(os.path.join(d, f), 0o444)
    result = in_child(_as_nobody, _load, prefix, "r+")
    assert result[0] == "raise" and result[1] == "StorageError" and result[2] == errno.EACCES, result
    assert "mode='r'" in result[3] and str(prefix) in result[3]
    assert in_child(_as_nobody, _load, prefix, "r") == ("ok", None)


def test_immutable_directory_gives_storage_error(shared_tmp):
    if os.geteuid() != 0:
        pytest.skip("chattr +i needs root")
    d = shared_tmp / "imm"
    d.mkdir()
    sample(1).memmap(d / "t")
    r = subprocess.run(["chattr", "+i", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr +i not supported here: {r.stderr.strip()}")
    with pytest.raises(memtree.StorageError) as ei:
        sample(2).memmap(d / "t")
    assert ei.value.errno == errno.EPERM
    subprocess.run(["chattr", "-i", str(d)], check=True)
    assert os.listdir(d) == ["t"]
    assert fingerprint(memtree.load_memmap(d / "t")) == fingerprint(sample(1))


def test_read_only_filesystem_gives_storage_error_and_still_loads(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("bind mounts need root")
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    sample(1).memmap(src / "t", checksum="crc32")
    r = subprocess.run(["mount", "--bind", str(src), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount --bind failed: {r.stderr.strip()}")
    try:
        r = subprocess.run(["mount", "-o", "remount,ro,bind", str(mnt)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"read-only remount failed: {r.stderr.strip()}")
        with pytest.raises(memtree.StorageError) as ei:
            sample(2).memmap(mnt / "t")
        assert ei.value.errno == errno.EROFS
        assert "read-only" in str(ei.value)
        assert fingerprint(memtree.load_memmap(mnt / "t", mode="r", verify=True)) == fingerprint(sample(1))
        assert memtree.verify_tree(mnt / "t").ok
        assert os.listdir(mnt) == ["t"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
