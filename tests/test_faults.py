"""Kill -9 of a writer at every step of the commit, and at random times (RELIABILITY §7 rows
31-33, §8a test 1): afterwards the destination loads as the new tree, as the old tree (overwrite),
or is refused with a MemtreeError; never partial. ``memtree.recover()`` or the next write to the
same destination removes every leftover.

Writers run in fork-started processes (no torch re-import). Deterministic crashes use the
private hook ``memtree._faults`` (``os._exit(137)`` at a named point); random ones send SIGKILL.
The long variant is ``python benchmarks/soak_faults.py``.
"""

from __future__ import annotations

import ctypes
import errno
import multiprocessing as mp
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import memtree
from memtree import TensorTree
from memtree.store.primitives import faults as _faults
from memtree.store.primitives import commit as commit_mod
from treeutil import fingerprint

pytestmark = pytest.mark.timeout(300)

FORK = mp.get_context("fork")
NAME = "tree"


# ----------------------------------------------------------------------------- trees


def make_tree(seed: int, size: str) -> TensorTree:
    """small: 5 leaves over 3 levels (KB); large: 24 leaves over 4 levels, about 12 MiB; packed:
    the small tree and 80 more small leaves (so they share a pack, format version 3) and one
    leaf of 1 MiB in its own file."""
    g = torch.Generator().manual_seed(seed)
    t = TensorTree(
        {
            "obs": torch.randn(4, 3, generator=g),
            "act": torch.randint(0, 10, (4,), generator=g),
            "nested": {
                "x": torch.randn(4, 2, generator=g).to(torch.bfloat16),
                "empty": torch.zeros(4, 0),
                "deeper": {"mask": torch.rand(4, generator=g) > 0.5},
            },
            "step": seed,
        },
        batch_size=[4],
    )
    if size == "packed":
        t["many"] = {f"s{i}": torch.randn(4, 8, generator=g) for i in range(80)}
        t["big"] = torch.randint(0, 256, (4, 256 << 10), dtype=torch.uint8, generator=g)
    if size == "large":
        for i in range(16):
            t[f"w{i}"] = torch.randint(0, 256, (4, 64 << 10), dtype=torch.uint8, generator=g)
        t["nested", "deeper", "deepest"] = {f"b{i}": torch.randn(4, 64 << 10, generator=g) for i in range(3)}
    return t


# ----------------------------------------------------------------------------- the writer child


def _unsupported(flag: int):
    real = commit_mod._renameat2

    def rename2(olddir, old, newdir, new, flags):
        if flags == flag:
            ctypes.set_errno(errno.EINVAL)
            return -1
        return real(olddir, old, newdir, new, flags)

    return rename2


def _writer(prefix, tree, fault, num_threads, fsync, no_flag, ready=None):
    if fault:
        os.environ[_faults.ENV] = fault
    _faults.reload()
    if no_flag:  # a filesystem without RENAME_EXCHANGE (2) or RENAME_NOREPLACE (1)
        commit_mod._renameat2 = _unsupported(no_flag)
    if ready is not None:
        ready.send(time.perf_counter())
    tree.memmap(prefix, num_threads=num_threads, fsync=fsync)
    if ready is not None:
        ready.send(time.perf_counter())


def run_writer(prefix, tree, *, fault=None, num_threads=0, fsync=False, no_flag=0) -> int:
    p = FORK.Process(target=_writer, args=(prefix, tree, fault, num_threads, fsync, no_flag))
    p.start()
    p.join(120)
    assert p.exitcode is not None, "writer hung"
    return p.exitcode


# ----------------------------------------------------------------------------- checking the aftermath


def state(prefix: Path, old: dict | None, new: dict) -> str:
    """"new", "old", "absent" (no tree there) or "missing" (no tree, but an old copy waits)."""
    try:
        loaded = fingerprint(memtree.load_memmap(prefix))
    except memtree.MemtreeError as e:
        assert isinstance(e, memtree.NotAMemtreeError), f"{type(e).__name__}: {e}"
        olds = [n for n in os.listdir(prefix.parent) if n.startswith(f".{NAME}.memtree-old-")]
        return "missing" if olds else "absent"
    if loaded == new:
        return "new"
    assert old is not None and loaded == old, "the destination holds neither the new nor the old tree"
    return "old"


def clean_up(prefix: Path, old: dict | None, new: dict, how: str, after: str) -> None:
    """Remove leftovers with recover() or with the next write; check the result."""
    parent = prefix.parent
    if how == "recover":
        memtree.recover(parent)
        assert os.listdir(parent) == ([] if after == "absent" else [NAME])
        if after != "absent":
            assert state(prefix, old, new) == after
    else:
        third = make_tree(99, "small")
        third.memmap(prefix)
        assert os.listdir(parent) == [NAME]
        assert fingerprint(memtree.load_memmap(prefix)) == fingerprint(third)


BEFORE_PUBLISH = [
    "after_lock", "staging_created", "before_leaves", "after_leaf:1", "after_leaf:3", "before_meta:1",
    "before_meta:2", "before_root_meta", "after_root_meta", "before_publish",
]

# (scenario, size, threads, fsync, no_flag, point) -> (state right after the crash, after recovery)
CASES = []
for size, threads in [("small", 0), ("large", 4)]:
    for point in BEFORE_PUBLISH:
        CASES.append(("new", size, threads, False, 0, point, "absent", "absent"))
        CASES.append(("overwrite", size, threads, False, 0, point, "old", "old"))
    CASES.append(("new", size, threads, False, 0, "after_publish", "new", "new"))
    CASES.append(("overwrite", size, threads, False, 0, "after_publish", "new", "new"))
    CASES.append(("overwrite", size, threads, False, 0, "before_old_removed", "new", "new"))
    # filesystems without RENAME_EXCHANGE / RENAME_NOREPLACE
    CASES.append(("overwrite", size, threads, False, 2, "before_publish", "old", "old"))
    CASES.append(("overwrite", size, threads, False, 2, "between_renames", "missing", "old"))
    CASES.append(("overwrite", size, threads, False, 2, "after_publish", "new", "new"))
    CASES.append(("new", size, threads, False, 1, "after_publish", "new", "new"))
# packs of small leaves (one job writes a whole pack: after_leaf:1 and :2 are the pack and the big leaf)
for point in ["before_leaves", "after_leaf:1", "after_leaf:2", "before_meta:2", "before_root_meta", "before_publish"]:
    CASES.append(("new", "packed", 2, False, 0, point, "absent", "absent"))
    CASES.append(("overwrite", "packed", 0, False, 0, point, "old", "old"))
CASES.append(("overwrite", "packed", 0, False, 0, "after_publish", "new", "new"))
CASES.append(("overwrite", "packed", 2, True, 0, "before_publish", "old", "old"))  # after the one syncfs
# durable writes
CASES += [
    ("new", "small", 2, True, 0, "after_leaf:2", "absent", "absent"),
    ("new", "small", 0, True, 0, "after_publish", "new", "new"),
    ("overwrite", "small", 2, True, 0, "before_old_removed", "new", "new"),
    ("overwrite", "small", 0, True, 2, "between_renames", "missing", "old"),
]


def _case_id(c):
    scenario, size, threads, fsync, no_flag, point = c[:6]
    flag = {0: "", 1: "-no_noreplace", 2: "-no_exchange"}[no_flag]
    return f"{scenario}-{size}-t{threads}{'-fsync' if fsync else ''}{flag}-{point}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_kill_at_fault_point(tmp_path, case):
    scenario, size, threads, fsync, no_flag, point, expected, recovered = case
    parent = tmp_path / "parent"
    parent.mkdir()
    prefix = parent / NAME
    old_tree, new_tree = make_tree(1, size), make_tree(2, size)
    old = None
    if scenario == "overwrite":
        old_tree.memmap(prefix)
        old = fingerprint(old_tree)
    new = fingerprint(new_tree)
    code = run_writer(prefix, new_tree, fault=point, num_threads=threads, fsync=fsync, no_flag=no_flag)
    assert code == _faults.EXIT_CODE, f"the writer never reached {point} (exit code {code})"
    assert state(prefix, old, new) == expected
    left = [n for n in os.listdir(parent) if n != NAME]
    assert f".{NAME}.memtree.lock" in left, "a killed writer leaves its lock file behind"
    if point != "after_lock" and expected != "new":
        assert any(".memtree-tmp-" in n or ".memtree-old-" in n for n in left)
    how = "recover" if CASES.index(case) % 2 == 0 else "next_write"
    clean_up(prefix, old, new, how, recovered)


def test_every_fault_point_is_exercised():
    used = {c[5].partition(":")[0] for c in CASES}
    assert used == set(_faults.POINTS)


def test_unknown_fault_point_is_refused(monkeypatch):
    monkeypatch.setenv(_faults.ENV, "no_such_point")
    with pytest.raises(ValueError):
        _faults.reload()
    monkeypatch.delenv(_faults.ENV)
    _faults.reload()
    assert _faults.armed() is None


def test_unarmed_hook_does_nothing():
    assert _faults.armed() is None
    for name in _faults.POINTS:
        _faults.point(name)


# ----------------------------------------------------------------------------- kill -9 at random times

RANDOM_TRIALS = 4  # per parameter combination below: 6 combinations, 24 trials


def _timed_write(prefix, tree, num_threads, no_flag):
    recv, send = FORK.Pipe(duplex=False)
    p = FORK.Process(target=_writer, args=(prefix, tree, None, num_threads, False, no_flag, send))
    p.start()
    send.close()
    start = recv.recv()
    end = recv.recv()
    p.join(120)
    assert p.exitcode == 0
    return end - start


def kill_trial(parent: Path, scenario: str, num_threads: int, no_flag: int, delay: float) -> tuple[str, int]:
    """One writer killed with SIGKILL ``delay`` s after it starts; returns (state, exit code)."""
    prefix = parent / NAME
    old_tree, new_tree = make_tree(1, "large"), make_tree(2, "large")
    old = None
    if scenario == "overwrite":
        old_tree.memmap(prefix)
        old = fingerprint(old_tree)
    new = fingerprint(new_tree)
    recv, send = FORK.Pipe(duplex=False)
    p = FORK.Process(target=_writer, args=(prefix, new_tree, None, num_threads, False, no_flag, send))
    p.start()
    send.close()
    assert recv.poll(60), "writer did not start"
    recv.recv()
    time.sleep(delay)
    try:
        os.kill(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.join(60)
    assert p.exitcode is not None
    got = state(prefix, old, new)
    allowed = {"new", "absent"} if scenario == "new" else {"new", "old"} | ({"missing"} if no_flag == 2 else set())
    assert got in allowed, got
    memtree.recover(parent)
    assert os.listdir(parent) == ([] if got == "absent" else [NAME])
    if got != "absent":
        assert state(prefix, old, new) == ("old" if got == "missing" else got)
    return got, p.exitcode


@pytest.fixture(scope="module")
def write_seconds(tmp_path_factory):
    """How long one uninterrupted large write takes here (the range of random kill delays)."""
    d = tmp_path_factory.mktemp("calibrate")
    runs = [_timed_write(d / f"t{i}", make_tree(2, "large"), 0, 0) for i in range(2)]
    return max(runs)


@pytest.fixture(scope="module")
def outcomes(request):
    """Counts of random-kill outcomes, printed at the end of the module (also without -s)."""
    counts: Counter = Counter()
    yield counts
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if counts and capture is not None:
        with capture.global_and_fixture_disabled():
            print(f"\nkill -9 at random times ({sum(counts.values())} trials): {dict(sorted(counts.items()))}")


@pytest.mark.parametrize(
    "scenario,num_threads,no_flag",
    [("new", 0, 0), ("new", 4, 0), ("overwrite", 0, 0), ("overwrite", 4, 0), ("overwrite", 0, 2), ("overwrite", 4, 2)],
    ids=["new-t0", "new-t4", "overwrite-t0", "overwrite-t4", "overwrite-t0-no_exchange", "overwrite-t4-no_exchange"],
)
def test_kill_at_random_times(tmp_path, write_seconds, outcomes, scenario, num_threads, no_flag):
    rng = random.Random(f"{scenario}{num_threads}{no_flag}")
    for i in range(RANDOM_TRIALS):
        parent = tmp_path / f"trial{i}"
        parent.mkdir()
        got, code = kill_trial(parent, scenario, num_threads, no_flag, rng.uniform(0, 1.2 * write_seconds))
        outcomes[(scenario, got, "killed" if code == -signal.SIGKILL else "finished")] += 1


# ----------------------------------------------------------------------------- single-file conversions

def _convert_writer(src, dst, fault, existsok):
    os.environ[_faults.ENV] = fault
    _faults.reload()
    memtree.convert(src, dst, existsok=existsok)


def _sources(where: Path) -> tuple[Path, Path]:
    old, new = where / "old.pt", where / "new.pt"
    torch.save({f"w{i}": torch.full((64 << 10,), float(i)) for i in range(3)}, old)  # 256 KiB each
    torch.save({"w0": torch.arange(64 << 10, dtype=torch.int64), "w1": torch.ones(3, dtype=torch.bfloat16),
                "w2": torch.randn(64 << 10, generator=torch.Generator().manual_seed(0)), "w3": torch.zeros(0)}, new)
    return old, new


# (scenario, existsok, point, state right after the crash, a temporary file is left)
FILE_CASES = [
    ("new", False, "after_lock", "absent", False),
    ("new", False, "staging_created", "absent", True),
    ("new", True, "after_leaf:2", "absent", True),
    ("new", False, "before_publish", "absent", True),
    ("new", False, "after_publish", "new", True),  # linked: the temporary name is a second name of the file
    ("new", True, "after_publish", "new", False),
    ("overwrite", True, "after_lock", "old", False),
    ("overwrite", True, "staging_created", "old", True),
    ("overwrite", True, "after_leaf:1", "old", True),
    ("overwrite", True, "after_leaf:3", "old", True),
    ("overwrite", True, "before_publish", "old", True),
    ("overwrite", True, "after_publish", "new", False),
]


@pytest.mark.parametrize("name", ["m.safetensors", os.fsdecode(b"m\xff.safetensors")], ids=["utf8", "not-utf8"])
@pytest.mark.parametrize("case", FILE_CASES, ids=[f"{c[0]}-{'existsok-' if c[1] else ''}{c[2]}" for c in FILE_CASES])
def test_kill_during_a_single_file_conversion(tmp_path, case, name):
    """kill -9 of ``convert(src, "m.safetensors")``: the file is the old one or the new one, byte for
    byte, never partial; its full-size temporary file is removed by ``memtree.recover(parent)`` and
    by the next conversion to the same file (the lock's journal names it)."""
    scenario, existsok, point, expected, left_tmp = case
    old_src, new_src = _sources(tmp_path)
    refs = tmp_path / "refs"
    refs.mkdir()
    memtree.convert(old_src, refs / "old.safetensors")
    memtree.convert(new_src, refs / "new.safetensors")
    content = {s: (refs / f"{s}.safetensors").read_bytes() for s in ("old", "new")}
    parent = tmp_path / "parent"
    parent.mkdir()
    dst = parent / name
    if scenario == "overwrite":
        memtree.convert(old_src, dst)
    p = FORK.Process(target=_convert_writer, args=(str(new_src), str(dst), point, existsok))
    p.start()
    p.join(120)
    assert p.exitcode == _faults.EXIT_CODE, f"the writer never reached {point} (exit code {p.exitcode})"
    assert (dst.read_bytes() if dst.exists() else None) == content.get(expected)
    tmps = [n for n in os.listdir(parent) if n.startswith(f".{name}.memtree-tmp-")]
    assert len(tmps) == int(left_tmp)
    if point.startswith(("after_leaf", "before_publish")):  # the issue: a full-size file was left for good
        assert (parent / tmps[0]).stat().st_size == len(content["new"])
    if FILE_CASES.index(case) % 2 == 0:
        actions = memtree.recover(parent)
        assert any(a.startswith("removed temporary file") for a in actions) == left_tmp
        assert os.listdir(parent) == ([] if expected == "absent" else [name])
        assert (dst.read_bytes() if dst.exists() else None) == content.get(expected)
    else:
        memtree.convert(old_src, dst, existsok=True)  # the next conversion replays the journal first
        assert os.listdir(parent) == [name] and dst.read_bytes() == content["old"]


def _blocked_writer(dst, started, hold):
    from memtree.interop.safetensors_file import write_safetensors

    def produce(key):
        if key == "b":  # "a" is written: tell the parent, then wait to be killed
            started.send(True)
            hold.recv()
        return torch.ones(1 << 16)

    specs = [(k, (1 << 16,), torch.float32) for k in ("a", "b")]
    write_safetensors(dst, specs, produce, existsok=True)


def test_sigkill_mid_write_leaves_a_file_that_recover_and_the_next_write_remove(tmp_path):
    """SIGKILL (no fault hook) while a safetensors file is half written: the full-size temporary
    file is named in the lock's journal, so the next write of the file, or ``recover``, removes it."""
    from memtree.interop.safetensors_file import save_safetensors

    for how in ("recover", "next_write"):
        parent = tmp_path / how
        parent.mkdir()
        dst = parent / "m.safetensors"
        started, child_end = FORK.Pipe(duplex=False)
        hold, hold_end = FORK.Pipe(duplex=False)
        p = FORK.Process(target=_blocked_writer, args=(str(dst), child_end, hold))
        p.start()
        assert started.poll(120), "the writer never started"
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
        tmps = [n for n in os.listdir(parent) if ".memtree-tmp-" in n]
        assert len(tmps) == 1 and (parent / tmps[0]).stat().st_size > 2 * (1 << 18) and not dst.exists()
        if how == "recover":
            assert memtree.recover(parent) == [f"removed temporary file: {parent / tmps[0]}"]
            assert os.listdir(parent) == []
        else:
            save_safetensors({"c": torch.zeros(2)}, dst)
            assert os.listdir(parent) == ["m.safetensors"]


def test_recover_leaves_the_temporary_file_of_a_live_writer(tmp_path):
    """``recover`` takes each destination's lock before it removes anything: the temporary file of a
    writer that holds it is left alone, and that writer still commits."""
    from memtree.store.writing.staged import staged_file

    dst = tmp_path / "m.safetensors"
    with staged_file(dst, existsok=False) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"in progress")
        assert memtree.recover(tmp_path) == [f"skipped {dst}: a writer holds its lock right now"]
        assert os.path.exists(tmp)
    assert dst.read_bytes() == b"in progress" and os.listdir(tmp_path) == ["m.safetensors"]


def test_recover_reports_a_temporary_file_no_journal_names(tmp_path):
    """A temporary file whose writer took no lock (a ``MemoryMappedTensor`` file being written, or
    one an older memtree left) may still be written: it is reported, never removed."""
    stray = tmp_path / (".m.safetensors.memtree-tmp-" + "ab" * 16)
    stray.write_bytes(b"x" * 10)
    actions = memtree.recover(tmp_path)
    assert len(actions) == 1 and actions[0].startswith(f"left {stray}: a temporary file that no crashed")
    assert stray.read_bytes() == b"x" * 10


@pytest.mark.parametrize("point", ["staging_created", "after_leaf:2"])
def test_kill_while_writing_a_tree_whose_name_is_not_utf8(tmp_path, point):
    """The lock's journal holds the staging name of a destination whose name is not UTF-8 (it was
    a TypeError before anything was written): the next write and ``recover`` clean up after a kill."""
    parent = tmp_path / "parent"
    parent.mkdir()
    name = os.fsdecode(b"tree\xff")
    new_tree = make_tree(2, "small")
    assert run_writer(parent / name, new_tree, fault=point) == _faults.EXIT_CODE
    assert any(n.startswith(f".{name}.memtree-tmp-") for n in os.listdir(parent))
    assert [a.split(": ")[0] for a in memtree.recover(parent)] == ["removed staging directory"]
    assert os.listdir(parent) == []
    new_tree.memmap(parent / name)
    assert fingerprint(memtree.load_memmap(parent / name)) == fingerprint(new_tree)


# ----------------------------------------------------------------------------- other temporary names

def _record_creator(root, key, fault):
    os.environ[_faults.ENV] = fault
    _faults.reload()
    memtree.Checkpointer(root, encryption=key).save(1, {"w": torch.ones(2)})


@pytest.mark.parametrize("cleanup", ["recover", "next_creator"])
def test_kill_while_creating_a_roots_record_leaves_nothing_recover_or_the_next_creator_keeps(tmp_path, cleanup):
    """kill -9 while an encrypted root's ``.memtree-root.json`` is written: before, its temporary
    file had no journal, so ``recover`` only reported it and it stayed for good."""
    key = memtree.EncryptionKey.generate()
    root = tmp_path / "root"
    root.mkdir()
    p = FORK.Process(target=_record_creator, args=(str(root), key, "before_publish:1"))  # the record's
    p.start()
    p.join(120)
    assert p.exitcode == _faults.EXIT_CODE, f"the creator never reached before_publish (exit code {p.exitcode})"
    tmps = [n for n in os.listdir(root) if n.startswith("..memtree-root.json.memtree-tmp-")]
    assert len(tmps) == 1 and not (root / ".memtree-root.json").exists()
    if cleanup == "recover":
        assert memtree.recover(root) == [f"removed temporary file: {root / tmps[0]}"]
        assert os.listdir(root) == []
    else:
        ckpt = memtree.Checkpointer(root, encryption=key)
        ckpt.save(1, {"w": torch.ones(2)})
        assert sorted(os.listdir(root)) == [".memtree-root.json", "1"]
        assert ckpt.restore(1)["w"].tolist() == [1.0, 1.0]


def _mapped_writer(path, fault):
    os.environ[_faults.ENV] = fault
    _faults.reload()
    from memtree.store.reading.mapped import MemoryMappedTensor

    MemoryMappedTensor.from_tensor(torch.arange(1 << 16), filename=path)


def test_kill_while_a_memory_mapped_tensor_file_is_written_is_reported_with_the_command(tmp_path):
    """``MemoryMappedTensor(filename=...)`` takes no lock (its temporary file may still be being
    written): after a kill, ``recover`` leaves the file and names the exact command that removes it."""
    import shlex
    import subprocess

    path = tmp_path / "x.bin"
    p = FORK.Process(target=_mapped_writer, args=(str(path), "before_publish:1"))
    p.start()
    p.join(120)
    assert p.exitcode == _faults.EXIT_CODE
    (tmp,) = [tmp_path / n for n in os.listdir(tmp_path)]
    assert tmp.name.startswith(".x.bin.memtree-tmp-") and not path.exists()
    (action,) = memtree.recover(tmp_path)
    command = f"rm -- {shlex.quote(str(tmp))}"
    assert action.startswith(f"left {tmp}: a temporary file") and action.endswith(command)
    assert tmp.exists()  # reported, never removed: its writer may be alive
    subprocess.run(command, shell=True, check=True)
    assert os.listdir(tmp_path) == [] and memtree.recover(tmp_path) == []
