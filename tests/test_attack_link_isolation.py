"""A write into one tree never changes another tree that shares its files by hard links.

Incremental saves (``Checkpointer``, ``write_tree(link_from=...)``) hard-link the unchanged leaves
of a new tree to the older tree's files. Every writer path memtree offers is run here against the
newer tree of every kind of linked pair, and the older tree must keep its bytes, its files and its
checksums (``memtree verify`` passes), in this process and across processes:

* the writer paths: row writes (``pwrite``), writes through the mapping (in-place ops, numpy
  views, plain aliases), ``from_filename(mode="r+")`` (refused on a shared file), ``memmap_``
  over the tree (also with levels not loaded yet), growth, ``to_module`` then an optimizer step,
  ``load_into_module`` into a module bound to the tree, a process the tensor is sent to (as a
  file reference) and a forked child writing the inherited mapping;
* the other order: a tree mapped read-write first, linked into a new tree afterwards (the linker
  must not link a file some process may write), in this process and in another one, and linking
  again once the writer is gone;
* two processes opening the same linked tree read-write at once: one copy, no row lost;
* the copy itself: killed at any point, out of space, no ``O_TMPFILE``, a tree replaced meanwhile;
* the lease: refused on filesystems and in processes where it cannot see every writer, broken by
  a writer during the link.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import memtree
from memtree.cli.main import main as cli
from memtree.format.level import Level
from memtree.store.primitives import lease
from memtree.store.reading import unshare
from memtree.store.writing import linking
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import WriteStats, write_tree
from treeutil import raw_bytes, snapshot

FORK = mp.get_context("fork")
WEIGHT = torch.arange(32, dtype=torch.float32).reshape(8, 4)  # nn.Linear(4, 8)'s shapes
BIAS = torch.arange(8, dtype=torch.float32) / 8
SUB = torch.arange(8, dtype=torch.int64) * 3


# ----------------------------------------------------------------------------- linked pairs


def _checkpointer(tmp: Path) -> tuple[Path, Path, str]:
    ckpt = memtree.Checkpointer(tmp / "ckpt")
    ckpt.save(1, {"weight": WEIGHT, "bias": BIAS, "sub": {"x": SUB}})
    ckpt.save(2, {"weight": WEIGHT, "bias": BIAS, "sub": {"x": SUB}})
    assert ckpt.last_stats is not None and ckpt.last_stats.files_linked == 3
    return Path(ckpt.path(1)), Path(ckpt.path(2)), "weight"


def _level() -> Level:
    return Level((8,), {"weight": WEIGHT.clone(), "bias": BIAS.clone(), "sub": Level((8,), {"x": SUB.clone()})})


def _link_from(tmp: Path) -> tuple[Path, Path, str]:
    write_tree(tmp / "a", _level())
    stats = WriteStats()
    write_tree(tmp / "b", _level(), WriteOptions.of(link_from=tmp / "a"), stats=stats)
    assert stats.files_linked == 3
    return tmp / "a", tmp / "b", "weight"


def _routed(tmp: Path) -> tuple[Path, Path, str]:
    """Two routed ``torch.save`` files of the same tensors: each has its own tree (``routing.py``
    writes them whole today; if it ever links them, the store's rules cover them too)."""
    with memtree.saving():
        torch.save({"weight": WEIGHT, "bias": BIAS}, tmp / "a.pt")
        torch.save({"weight": WEIGHT, "bias": BIAS}, tmp / "b.pt")
    (a,) = (tmp / "a.pt.memtree").iterdir()
    (b,) = (tmp / "b.pt.memtree").iterdir()
    key = sorted(memtree.load_memmap(b, mode="r").keys())[0]
    return a, b, key


SOURCES = {"checkpointer": _checkpointer, "link_from": _link_from, "routed": _routed}


def _leaf(tree: Path, key: str | tuple[str, ...]) -> Path:
    *dirs, name = (key,) if isinstance(key, str) else key
    return tree.joinpath(*dirs, f"{name}.memmap")


def _assert_untouched(other: Path, before: dict) -> None:
    """The other tree: same files, bytes, times and directories; it verifies, also from the CLI."""
    assert snapshot(other) == before, "a write into the linked tree changed the other tree"
    report = memtree.verify_tree(other)
    assert report.ok and report.checksummed == report.leaves, report.problems
    assert cli(["verify", str(other)]) == 0


def _assert_written(written: Path, keys: set, problems_allowed: bool) -> None:
    """The written tree: its written leaves no longer share a file; only they may have checksums
    made stale by a write in place."""
    for key in keys:
        assert os.stat(_leaf(written, key)).st_nlink == 1
    problems = memtree.verify_tree(written).problems
    if not problems_allowed:
        assert problems == []
    assert all(p.kind in ("stale", "checksum") and p.key in keys for p in problems), problems


# ----------------------------------------------------------------------------- writer paths


def _row_write(path: Path, key: str) -> None:
    t = memtree.load_memmap(path)
    t[key][0] = torch.full_like(t[key][0], 12345)  # one pwrite


def _rows_write(path: Path, key: str) -> None:
    t = memtree.load_memmap(path)
    t[key][1:3] = 7  # pwrite of a broadcast value


def _in_place_op(path: Path, key: str) -> None:
    memtree.load_memmap(path)[key].add_(1)  # through the mapping


def _numpy_view(path: Path, key: str) -> None:
    memtree.load_memmap(path)[key].numpy()[...] = 3


def _plain_alias(path: Path, key: str) -> None:
    memtree.load_memmap(path)[key].as_subclass(torch.Tensor).mul_(2)


def _from_filename(path: Path, key: str) -> None:
    t = memtree.load_memmap(path)[key]  # the load gives the leaf its own file: then it is writable
    m = memtree.MemoryMappedTensor.from_filename(_leaf(path, key), t.dtype, t.shape, mode="r+")
    m.fill_(9)


def _memmap_in_place(path: Path, key: str) -> None:
    t = memtree.load_memmap(path)  # levels not loaded yet: mapped by the write, under its lock
    t.memmap_(path)
    t[key].neg_()  # the new tree's own files


def _forked_child(path: Path, key: str) -> None:
    t = memtree.load_memmap(path)
    leaf = t[key]

    def write() -> None:
        leaf.sub_(5)  # the mapping the child inherited

    assert _in_child(write) == ("ok", None)
    assert float(leaf.reshape(-1)[1]) == float(memtree.load_memmap(path, mode="r")[key].reshape(-1)[1])


def _sent_to_a_process(path: Path, key: str) -> None:
    """The tensor travels as a file reference (memtree's ForkingPickler reducer), as to a
    DataLoader worker, and the receiver writes into it."""
    t = memtree.load_memmap(path)
    leaf = t[key]
    recv, send = FORK.Pipe(duplex=False)
    back_recv, back_send = FORK.Pipe(duplex=False)

    def worker() -> None:
        x = recv.recv()
        x[0] = 4242
        back_send.send(os.stat(x.filename).st_ino)

    p = FORK.Process(target=worker)
    p.start()
    send.send(leaf)  # pickled by ForkingPickler: (file, dtype, layout)
    assert back_recv.poll(120), "the worker did not answer"
    assert back_recv.recv() == os.stat(leaf.filename).st_ino
    p.join(120)
    assert p.exitcode == 0
    assert float(leaf.reshape(-1)[0]) == 4242  # the same file as the sender's


def _to_module_and_train(path: Path, key: str) -> None:
    with memtree.empty_init():
        model = nn.Linear(4, 8)
    t = memtree.load_memmap(path)
    t.exclude("sub").to_module(model)  # bound: the module's weights are the mapped files
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert float(t["bias"][0]) != float(BIAS[0])  # the step went to the tree's files


def _load_into_bound_module(path: Path, key: str) -> None:
    with memtree.empty_init():
        model = nn.Linear(4, 8)
    t = memtree.load_memmap(path)
    t.exclude("sub").to_module(model)
    memtree.load_into_module(model, {"weight": -WEIGHT, "bias": -BIAS})  # filled in place
    assert torch.equal(t["weight"], -WEIGHT)


def _tree_rows(path: Path, key: str) -> None:
    t = memtree.load_memmap(path)
    t[2:4] = t[5:7].clone()  # every leaf of every level, row by row


def _append(path: Path, key: str) -> None:
    t = memtree.load_memmap(path)
    t.append_(t[0].clone())


def _extend(path: Path, key: str) -> None:
    t = memtree.load_memmap(path)
    t.extend_(t[:3].clone())


def _shrink_and_grow(path: Path, key: str) -> None:
    t = memtree.load_memmap(path)
    t.resize_(2)
    t.resize_(12)


WRITERS = {
    "row write": _row_write,
    "rows write": _rows_write,
    "in-place op": _in_place_op,
    "numpy view": _numpy_view,
    "plain alias": _plain_alias,
    "from_filename r+": _from_filename,
    "memmap_ in place": _memmap_in_place,
    "forked child": _forked_child,
    "sent to a process": _sent_to_a_process,
    "to_module + optimizer": _to_module_and_train,
    "load_into_module": _load_into_bound_module,
    "tree rows": _tree_rows,
    "append_": _append,
    "extend_": _extend,
    "resize_ down and up": _shrink_and_grow,
}
#: Writers that commit a new tree (checksums stay right) rather than writing files in place.
RECOMMIT = {"append_", "extend_", "resize_ down and up"}
#: Writers that grow the tree (they drop the checksums of the leaves they grow).
GROWTH = {"append_", "extend_", "resize_ down and up"}
#: Writers that need the tree to have a batch dim (``write_tree`` pairs only).
BATCHED = GROWTH | {"tree rows"}
#: Writers that need a ``weight``/``bias`` tree (not the routed pair's storages).
MODULES = {"to_module + optimizer", "load_into_module"}


def _cases():
    for source in SOURCES:
        for writer in WRITERS:
            if writer in BATCHED and source != "link_from":
                continue
            if writer in MODULES and source == "routed":
                continue
            yield source, writer


@pytest.mark.parametrize("source, writer", list(_cases()))
def test_a_write_into_one_linked_tree_never_changes_the_other(tmp_path, source, writer):
    other, written, key = SOURCES[source](tmp_path)
    before = snapshot(other)
    WRITERS[writer](written, key)
    _assert_untouched(other, before)
    if writer not in GROWTH:  # (growth drops the checksums of the leaves it grows)
        keys = {(key,)}
        if writer in MODULES:
            keys = {("weight",), ("bias",)}
        elif writer == "tree rows":
            keys = {("weight",), ("bias",), ("sub", "x")}
        _assert_written(written, keys, problems_allowed=writer not in RECOMMIT)


def test_the_issue_reproduction_restore_returns_the_saved_values(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, {"w": WEIGHT})
    ckpt.save(2, {"w": WEIGHT})
    t = memtree.load_memmap(ckpt.path(2))
    t["w"][0] = 12345
    assert torch.equal(ckpt.restore(1)["w"], WEIGHT)
    assert memtree.verify_tree(ckpt.path(1)).ok
    with pytest.raises(memtree.IntegrityError, match="stale"):  # step 2 was written in place
        ckpt.restore(2)
    assert float(ckpt.restore(2, verify=False)["w"][0, 0]) == 12345


def test_from_filename_refuses_to_map_a_shared_file_read_write(tmp_path):
    other, written, key = _link_from(tmp_path)
    before = snapshot(other)
    with pytest.raises(memtree.UnsafePathError, match="2 hard links.*mode='r'"):
        memtree.MemoryMappedTensor.from_filename(_leaf(written, key), torch.float32, (8, 4), mode="r+")
    ro = memtree.MemoryMappedTensor.from_filename(_leaf(written, key), torch.float32, (8, 4), mode="r")
    assert torch.equal(ro, WEIGHT)
    assert snapshot(other) == before and os.stat(_leaf(written, key)).st_nlink == 2


def test_mode_r_and_mmap_false_copy_nothing(tmp_path):
    other, written, key = _link_from(tmp_path)
    before = snapshot(written)
    for kw in ({"mode": "r"}, {"mmap": False}, {"device": "meta"}):
        t = memtree.load_memmap(written, lazy=False, **kw)
        assert t[key].shape == (8, 4)
    assert snapshot(written) == before and os.stat(_leaf(written, key)).st_nlink == 2


def test_a_read_write_load_copies_only_the_levels_it_loads(tmp_path):
    other, written, _ = _link_from(tmp_path)
    t = memtree.load_memmap(written)
    t.keys()  # the root level: its two leaves
    assert [os.stat(written / n).st_nlink for n in ("weight.memmap", "bias.memmap", "sub/x.memmap")] == [1, 1, 2]
    assert sorted(os.listdir(written)) == ["bias.memmap", "meta.json", "sub", "weight.memmap"]  # no temporary name
    assert os.stat(written / "weight.memmap").st_mtime_ns == os.stat(other / "weight.memmap").st_mtime_ns


# ----------------------------------------------------------------------------- the other order


def test_a_tree_mapped_read_write_is_not_linked_into_a_new_one(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, {"w": WEIGHT, "b": BIAS})
    t = memtree.load_memmap(ckpt.path(1))
    t.keys()  # mapped read-write
    ckpt.save(2, {"w": WEIGHT, "b": BIAS})
    assert (ckpt.last_stats.files_linked, ckpt.last_stats.link_fallbacks) == (0, 2)
    before = snapshot(Path(ckpt.path(2)))
    t["w"][0] = 12345
    t["b"].add_(1)
    assert snapshot(Path(ckpt.path(2))) == before and memtree.verify_tree(ckpt.path(2)).ok
    assert torch.equal(ckpt.restore(2)["w"], WEIGHT)


def test_a_tree_is_linked_again_once_its_read_write_mappings_are_gone(tmp_path):
    write_tree(tmp_path / "a", _level())
    t = memtree.load_memmap(tmp_path / "a")
    t.keys()  # maps weight and bias read-write, writes nothing
    stats = WriteStats()
    write_tree(tmp_path / "b", _level(), WriteOptions.of(link_from=tmp_path / "a"), stats=stats)
    assert (stats.files_linked, stats.link_fallbacks) == (1, 2)  # sub/x was not mapped
    view = t["weight"][2:]
    del t
    stats = WriteStats()
    write_tree(tmp_path / "c", _level(), WriteOptions.of(link_from=tmp_path / "a"), stats=stats)
    assert (stats.files_linked, stats.link_fallbacks) == (2, 1)  # a view still maps weight
    del view
    stats = WriteStats()
    write_tree(tmp_path / "d", _level(), WriteOptions.of(link_from=tmp_path / "a"), stats=stats)
    assert (stats.files_linked, stats.link_fallbacks) == (3, 0)


def _map_and_wait(path: str, ready, go, done) -> None:
    t = memtree.load_memmap(path)
    t.keys()
    ready.send(True)
    if go.poll(120):
        go.recv()
        t["w"][0] = 777
        t["b"].add_(1)
        done.send(True)


def test_a_tree_mapped_read_write_in_another_process_is_not_linked(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, {"w": WEIGHT, "b": BIAS})
    ready_r, ready_s = FORK.Pipe(duplex=False)
    go_r, go_s = FORK.Pipe(duplex=False)
    done_r, done_s = FORK.Pipe(duplex=False)
    child = FORK.Process(target=_map_and_wait, args=(ckpt.path(1), ready_s, go_r, done_s))
    child.start()
    try:
        assert ready_r.poll(120) and ready_r.recv()
        ckpt.save(2, {"w": WEIGHT, "b": BIAS})
        assert ckpt.last_stats.files_linked == 0
        before = snapshot(Path(ckpt.path(2)))
        go_s.send(True)
        assert done_r.poll(120) and done_r.recv()
    finally:
        child.join(120)
        if child.exitcode is None:
            child.kill()
    assert child.exitcode == 0
    assert snapshot(Path(ckpt.path(2))) == before and memtree.verify_tree(ckpt.path(2)).ok
    # the child's write reached its own tree (whose checksum it made stale: restore refuses it)
    assert float(ckpt.restore(1, verify=False)["w"][0, 0]) == 777


def test_a_writer_killed_with_sigkill_blocks_no_later_link(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, {"w": WEIGHT})
    ready_r, ready_s = FORK.Pipe(duplex=False)
    go_r, _go_s = FORK.Pipe(duplex=False)
    done_r, done_s = FORK.Pipe(duplex=False)
    child = FORK.Process(target=_map_and_wait, args=(ckpt.path(1), ready_s, go_r, done_s))
    child.start()
    assert ready_r.poll(120) and ready_r.recv()
    os.kill(child.pid, signal.SIGKILL)
    child.join(120)
    ckpt.save(2, {"w": WEIGHT})
    assert ckpt.last_stats.files_linked == 1


# ----------------------------------------------------------------------------- two processes at once


def _fill_rows(path: str, key: str, name: str, rows: range, barrier, out) -> None:
    try:
        barrier.wait(120)
        t = memtree.load_memmap(path)
        for i in rows:
            t[key][i] = torch.full((4,), 1000.0 + i)
        out.send(("ok", os.stat(os.path.join(path, name)).st_ino))
    except BaseException as err:  # the parent reports it
        out.send(("error", repr(err)))


def _two_fillers(written: Path, key: str, name: str) -> None:
    """Two processes released together fill rows 0-3 and 4-7 of leaf ``key`` of ``written``; both
    must answer, having written the same file (one copy for both), now ``written / name``."""
    barrier = FORK.Barrier(2)
    pipes = [FORK.Pipe(duplex=False) for _ in range(2)]
    children = [
        FORK.Process(target=_fill_rows, args=(str(written), key, name, rows, barrier, send))
        for rows, (_, send) in zip((range(0, 4), range(4, 8)), pipes)
    ]
    for c in children:
        c.start()
    answers = []
    for c, (recv, _) in zip(children, pipes):
        assert recv.poll(300), "a writer did not answer"
        answers.append(recv.recv())
        c.join(120)
        assert c.exitcode == 0
    assert [a[0] for a in answers] == ["ok", "ok"], answers
    assert answers[0][1] == answers[1][1] == os.stat(written / name).st_ino  # one copy


def test_two_processes_opening_the_same_linked_tree_share_one_copy(tmp_path):
    other, written, _ = _link_from(tmp_path)
    before = snapshot(other)
    _two_fillers(written, "weight", "weight.memmap")
    got = memtree.load_memmap(written, mode="r")["weight"]
    assert torch.equal(got, torch.arange(1000.0, 1008.0)[:, None].expand(8, 4))  # no row lost
    _assert_untouched(other, before)


def _packed_link_from(tmp: Path) -> tuple[Path, Path]:
    """Two trees of 64 small leaves (one pack each, format version 3), the second's pack a hard
    link to the first's (an incremental save of an unchanged pack)."""
    level = Level((8,), {f"s{i}": torch.full((8, 4), float(i)) for i in range(64)})
    write_tree(tmp / "a", level)
    stats = WriteStats()
    write_tree(tmp / "b", level, WriteOptions.of(link_from=tmp / "a"), stats=stats)
    assert stats.files_linked == 1 and os.stat(tmp / "b" / "~pack-0.memmap").st_nlink == 2
    return tmp / "a", tmp / "b"


def test_two_processes_opening_the_same_linked_packed_tree_share_one_copy_of_its_pack(tmp_path):
    other, written = _packed_link_from(tmp_path)
    before = snapshot(other)
    _two_fillers(written, "s7", "~pack-0.memmap")
    got = memtree.load_memmap(written, mode="r")
    assert torch.equal(got["s7"], torch.arange(1000.0, 1008.0)[:, None].expand(8, 4))  # no row lost
    assert torch.equal(got["s6"], torch.full((8, 4), 6.0)) and torch.equal(got["s8"], torch.full((8, 4), 8.0))
    _assert_untouched(other, before)


# ----------------------------------------------------------------------------- the copy


def _in_child(fn, timeout: float = 120):
    recv, send = FORK.Pipe(duplex=False)

    def run() -> None:
        try:
            send.send(("ok", fn()))
        except BaseException as err:
            send.send(("raise", type(err).__name__, str(err)))

    p = FORK.Process(target=run)
    p.start()
    send.close()  # the child's end only: a child that dies closes it (EOF)
    try:
        answer = recv.recv() if recv.poll(timeout) else None
    except EOFError:
        answer = None
    p.join(timeout)
    if p.exitcode is None:
        p.kill()
        pytest.fail(f"the child did not finish within {timeout} s")
    return answer if answer is not None else ("killed", p.exitcode)


@pytest.mark.parametrize("where", ["during the copy", "before the rename", "after the rename"])
def test_a_process_killed_while_copying_leaves_both_trees_whole(tmp_path, where):
    other, written, key = _link_from(tmp_path)
    before = snapshot(other)

    def killed() -> None:  # in a forked child: its patches die with it
        if where == "during the copy":
            unshare.copy_range = lambda *a, **k: os._exit(137)
        else:
            real = os.rename

            def rename(src, dst, **kwargs):
                if ".memtree-copy-" in str(src):
                    if where == "after the rename":
                        real(src, dst, **kwargs)
                    os._exit(137)
                real(src, dst, **kwargs)

            os.rename = rename
        memtree.load_memmap(written)[key]

    assert _in_child(killed) == ("killed", 137)
    _assert_untouched(other, before)
    leftovers = [n for n in os.listdir(written) if n.startswith(".memtree-copy-")]
    # only a kill between the two system calls that name the copy and rename it leaves its name
    assert len(leftovers) == (where == "before the rename")
    assert memtree.verify_tree(written).ok
    links = os.stat(_leaf(written, key)).st_nlink
    assert links == (1 if where == "after the rename" else 2)
    _row_write(written, key)  # a later load copies it (or uses the copy) as usual
    _assert_untouched(other, before)


def test_a_full_disk_during_the_copy_is_a_clear_error_and_changes_nothing(tmp_path, monkeypatch):
    other, written, key = _link_from(tmp_path)
    before_other, before_written = snapshot(other), snapshot(written)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(unshare, "copy_range", full)
    with pytest.raises(memtree.StorageError, match=r"copying .*weight.memmap.*hard link.*filesystem is full") as ei:
        memtree.load_memmap(written)[key]
    assert ei.value.errno == errno.ENOSPC
    assert snapshot(other) == before_other and snapshot(written) == before_written
    assert memtree.load_memmap(written, mode="r")[key].shape == (8, 4)  # readers unaffected


def test_without_o_tmpfile_the_copy_is_a_named_file_renamed_at_once(tmp_path, monkeypatch):
    other, written, key = _link_from(tmp_path)
    before = snapshot(other)
    real_open = os.open

    def no_tmpfile(path, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(unshare.os, "open", no_tmpfile)
    _in_place_op(written, key)
    _assert_untouched(other, before)
    _assert_written(written, {(key,)}, problems_allowed=True)
    assert not [n for n in os.listdir(written) if n.startswith(".")]


def test_a_level_of_a_tree_replaced_since_it_was_opened_is_not_copied_into(tmp_path):
    other, written, key = _link_from(tmp_path)
    t = memtree.load_memmap(written)  # the sub-level is pending
    replaced = tmp_path / "replaced"
    os.rename(written, replaced)
    shutil.copytree(replaced, written, copy_function=os.link)  # the same files, another directory
    before = snapshot(replaced)
    with pytest.raises(memtree.MissingLeafError, match="replaced"):
        t["sub", "x"]
    assert snapshot(replaced) == before


def test_a_write_over_a_tree_maps_its_pending_shared_levels_under_its_own_lock(tmp_path):
    """Re-saving a prefix loads this process's lazily opened trees of it first, under the
    writer's lock: their shared leaves are copied without taking that lock again."""
    other, written, key = _link_from(tmp_path)
    before = snapshot(other)
    pending = memtree.load_memmap(written)  # nothing loaded yet
    start = time.monotonic()
    write_tree(written, Level((8,), {"weight": torch.zeros(8, 4)}))
    assert time.monotonic() - start < 60  # (waiting for its own lock would take LOCK_TIMEOUT)
    assert torch.equal(pending[key], WEIGHT)  # the old tree, mapped before it was replaced
    pending[key].add_(1)
    _assert_untouched(other, before)
    assert torch.equal(memtree.load_memmap(written, mode="r")[key], torch.zeros(8, 4))


def test_a_thread_loading_a_tree_another_thread_writes_gets_a_lock_error_not_a_deadlock(tmp_path):
    from memtree.format.names import lock_path
    from memtree.store.primitives.commit import WriterLock

    other, written, key = _link_from(tmp_path)
    t = memtree.load_memmap(written)
    taken, release, result = threading.Event(), threading.Event(), []

    def writer() -> None:
        with WriterLock(lock_path(os.path.realpath(tmp_path), "b"), "b", timeout=0):
            taken.set()
            release.wait(120)

    th = threading.Thread(target=writer)
    th.start()
    try:
        assert taken.wait(120)
        with pytest.raises(memtree.LockError, match="another thread of this process"):
            t[key]
    finally:
        release.set()
        th.join(120)
    assert memtree.load_memmap(written)[key].shape == (8, 4)  # retried: fine


# ----------------------------------------------------------------------------- the lease


def test_no_link_where_a_lease_cannot_see_every_writer(tmp_path, monkeypatch):
    write_tree(tmp_path / "a", _level())
    monkeypatch.setattr(lease, "filesystem_type", lambda fd: 0x6969)  # NFS
    stats = WriteStats()
    write_tree(tmp_path / "b", _level(), WriteOptions.of(link_from=tmp_path / "a"), stats=stats)
    assert (stats.files_linked, stats.files_written) == (0, 3)
    assert "0x6969" in stats.link_error and "mode='r+'" in stats.link_error


def test_no_link_where_leases_are_disabled(tmp_path, monkeypatch):
    import builtins
    import io

    write_tree(tmp_path / "a", _level())
    real_open = builtins.open

    def sysctl(path, *args, **kwargs):
        if path == "/proc/sys/fs/leases-enable":
            return io.BytesIO(b"0\n")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", sysctl)
    stats = WriteStats()
    write_tree(tmp_path / "b", _level(), WriteOptions.of(link_from=tmp_path / "a"), stats=stats)
    assert stats.files_linked == 0 and "fs.leases-enable" in stats.link_error


def test_no_link_in_a_process_that_handles_sigurg(tmp_path):
    write_tree(tmp_path / "a", _level())
    old = signal.signal(signal.SIGURG, lambda *a: None)
    try:
        stats = WriteStats()
        write_tree(tmp_path / "b", _level(), WriteOptions.of(link_from=tmp_path / "a"), stats=stats)
    finally:
        signal.signal(signal.SIGURG, old)
    assert stats.files_linked == 0 and "SIGURG" in stats.link_error


def test_a_lease_the_kernel_refuses_writes_the_leaf(tmp_path, monkeypatch):
    """Another owner's file (EACCES), leases disabled (EINVAL): written, never linked."""
    write_tree(tmp_path / "a", _level())
    real = lease.fcntl.fcntl

    def refuse(fd, cmd, arg=0):
        if cmd == lease._F_SETLEASE and arg == lease.fcntl.F_RDLCK:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES))
        return real(fd, cmd, arg)

    monkeypatch.setattr(lease.fcntl, "fcntl", refuse)
    stats = WriteStats()
    write_tree(tmp_path / "b", _level(), WriteOptions.of(link_from=tmp_path / "a"), stats=stats)
    assert (stats.files_linked, stats.link_fallbacks) == (0, 3)


def test_a_writer_opening_the_file_during_the_link_undoes_it(tmp_path, monkeypatch):
    write_tree(tmp_path / "a", _level())
    real = os.link
    opened = []

    def link_then_a_writer_comes(src, dst, **kwargs):
        real(src, dst, **kwargs)
        with pytest.raises(BlockingIOError):  # O_NONBLOCK: the lease is broken, the open refused
            os.open(dst, os.O_RDWR | os.O_NONBLOCK)
        opened.append(dst)

    monkeypatch.setattr(linking.os, "link", link_then_a_writer_comes)
    stats = WriteStats()
    write_tree(tmp_path / "b", _level(), WriteOptions.of(link_from=tmp_path / "a"), stats=stats)
    assert len(opened) == 3 and (stats.files_linked, stats.link_fallbacks) == (0, 3)
    assert all(os.stat(p).st_nlink == 1 for p in (tmp_path / "b").rglob("*.memmap"))
    assert memtree.verify_tree(tmp_path / "b").ok


def test_a_read_write_load_waits_for_a_lease_to_be_released(tmp_path):
    other, written, key = _link_from(tmp_path)
    fd = os.open(_leaf(written, key), os.O_RDONLY)
    result: list = []
    with lease.read_lease(fd) as held:
        assert held is not None
        loader = threading.Thread(target=lambda: result.append(memtree.load_memmap(written)[key].shape))
        loader.start()
        deadline = time.monotonic() + 60
        while held.intact() and time.monotonic() < deadline:  # the loader's open breaks it
            time.sleep(0.001)
        assert not held.intact()
    os.close(fd)
    loader.join(120)
    assert result == [torch.Size([8, 4])]
