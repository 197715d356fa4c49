"""kill -9 during Checkpointer saves (async and blocking, incremental, with retention).

A fork-started "trainer" saves a training state every step (most of its bytes unchanged, so every
save after the first hard-links them from the previous step; ``keep_last=2`` retires old steps)
and reports each step once its save is committed. It dies either at a fault point of the commit
protocol (``MEMTREE_FAULT``, deterministic) or by SIGKILL at a random moment. Whatever the
moment, a new ``Checkpointer`` on the root must: clean up every staging directory and lock file,
list only committed steps, never lose a step reported committed (or one newer than it), and
every step it lists must pass ``verify_tree`` and restore exactly the state saved at that step.
No assertion depends on timing: the random delays only choose where the kill lands.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time

import pytest
import torch

import memtree
from memtree.store.primitives import faults as _faults
from test_training import assert_same

FORK = mp.get_context("fork")
FROZEN = {f"layer{i}": torch.randn(1 << 16, generator=torch.Generator().manual_seed(i)) for i in range(8)}


def expected_state(step: int) -> dict:
    """The state a trainer saves at ``step``: 2 MiB that never change, a little that does."""
    return {
        "model": dict(FROZEN),
        "adapter": torch.full((4096,), float(step)),
        "optim": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"betas": (0.9, 0.999), "lr": step / 1000}]},
        "step": step,
    }


def _trainer(root: str, fault: str | None, blocking: bool, report) -> None:
    if fault:
        os.environ[_faults.ENV] = fault
    _faults.reload()
    ckpt = memtree.Checkpointer(root, keep_last=2)
    latest = ckpt.latest()
    start = 0 if latest is None else latest + 1
    state = expected_state(start)
    for step in range(start, start + 300):
        state["adapter"].fill_(float(step))  # updated in place, as an optimizer does
        state["optim"]["state"][0]["step"].fill_(float(step))
        state["optim"]["param_groups"][0]["lr"] = step / 1000
        state["step"] = step
        ckpt.save(step, state, blocking=blocking)  # an async save first waits for the previous one
        if blocking:
            report.send(step)
        elif step > start:
            report.send(step - 1)
    ckpt.wait()
    report.send(step)
    report.close()


def start(target, *args):
    """A forked ``target(*args, report)``, and the end of the pipe it reports through."""
    recv, send = FORK.Pipe(duplex=False)
    p = FORK.Process(target=target, args=(*args, send))
    p.start()
    send.close()
    return p, recv


def run_trainer(root: str, *, fault: str | None = None, blocking: bool = False):
    return start(_trainer, root, fault, blocking)


def drain(recv, committed: list[int]) -> None:
    try:
        while recv.poll(0):
            committed.append(recv.recv())
    except (EOFError, OSError):
        pass


def kill_after(p, recv, reports: list, count: int, pause: float) -> None:
    """SIGKILL ``p`` ``pause`` seconds after its ``count``-th report (all kept in ``reports``)."""
    try:
        for _ in range(count):
            assert recv.poll(300), "the child reported nothing"
            reports.append(recv.recv())
        time.sleep(pause)
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join(60)
    assert p.exitcode == -signal.SIGKILL  # killed while saving, not after all its saves
    drain(recv, reports)


def check_root(root: str, committed: list[int]) -> None:
    """The aftermath of a crash: see the module docstring."""
    ckpt = memtree.Checkpointer(root)  # opening the root recovers it
    names = sorted(os.listdir(root))
    assert all(n.isdigit() for n in names), names  # no staging directory, no lock file
    steps = ckpt.steps()
    assert [str(s) for s in steps] == sorted(names, key=int)
    if committed:
        assert steps and steps[-1] >= max(committed), (steps, committed)
    assert len(steps) <= 3  # keep_last=2, plus a save committed right before its retention ran
    for step in steps:
        report = memtree.verify_tree(ckpt.path(step))
        assert report.ok and report.checksummed == report.leaves, report
        assert_same(ckpt.restore(step), expected_state(step))


FAULTS = [
    ("after_lock:3", False),
    ("staging_created:3", True),
    ("before_leaves:4", False),
    ("after_leaf:12", False),
    ("after_leaf:5", True),  # in the first save: nothing committed yet
    ("before_meta:7", False),
    ("before_root_meta:3", True),
    ("after_root_meta:3", False),
    ("before_publish:4", False),
    ("after_publish:3", False),
    ("after_publish:3", True),
]


@pytest.mark.parametrize("fault, blocking", FAULTS, ids=[f"{f}-{'blocking' if b else 'async'}" for f, b in FAULTS])
def test_killed_at_a_fault_point(tmp_path, fault, blocking):
    root = str(tmp_path / "ckpts")
    p, recv = run_trainer(root, fault=fault, blocking=blocking)
    p.join(300)
    committed: list[int] = []
    drain(recv, committed)
    assert p.exitcode == _faults.EXIT_CODE, f"the trainer did not reach {fault} (exit code {p.exitcode})"
    check_root(root, committed)
    # the next run resumes from the latest step, saves incrementally again, and finishes
    p, recv = run_trainer(root, fault="after_lock:2", blocking=not blocking)
    p.join(300)
    assert p.exitcode == _faults.EXIT_CODE
    drain(recv, committed)
    check_root(root, committed)


@pytest.mark.parametrize("seed", range(8))
def test_killed_at_random_moments(tmp_path, seed):
    """Two runs per seed, each SIGKILLed at a random moment after a random number of saves."""
    rng = random.Random(seed)
    root = str(tmp_path / "ckpts")
    committed: list[int] = []
    for run in range(2):
        p, recv = run_trainer(root, blocking=(seed + run) % 3 == 0)
        kill_after(p, recv, committed, rng.randint(1, 3), rng.uniform(0, 0.15))
        check_root(root, committed)


# -- roll backs (save(..., discard_newer=True)) killed at random moments ---------------------------


def rollback_state(step: int, run: int) -> dict:
    state = expected_state(step)
    state["run"] = run
    state["adapter"] = torch.full((4096,), float(step * 1000 + run))
    return state


def _roll_backs(root: str, run: int, report) -> None:
    """Saves 5 steps, rolls back over the last 3 (discard_newer), and again, forever."""
    ckpt = memtree.Checkpointer(root, keep_last=4)
    step = (ckpt.latest() or 0) + 1
    while True:
        for _ in range(5):
            ckpt.save(step, rollback_state(step, run), blocking=step % 2 == 0)
            ckpt.wait()
            report.send(("saved", step))
            step += 1
        step -= 3
        ckpt.save(step, rollback_state(step, run), discard_newer=True, overwrite=True)
        report.send(("rolled back", step))
        step += 1


@pytest.mark.parametrize("seed", range(4))
def test_roll_backs_killed_at_random_moments(tmp_path, seed):
    """Whatever the moment: every step listed afterwards is whole and exactly one save's state,
    nothing but steps is left in the root, and a roll back reported done left no step above it
    but the ones saved after it (those reported, and the one in flight when it was killed)."""
    rng = random.Random(seed)
    root = str(tmp_path / "ckpts")
    for run in range(2):
        p, recv = start(_roll_backs, root, run)
        events: list = []
        kill_after(p, recv, events, rng.randint(3, 9), rng.uniform(0, 0.1))
        ckpt = memtree.Checkpointer(root)  # opening the root recovers it
        names = sorted(os.listdir(root))
        assert all(n.isdigit() for n in names), names
        steps = ckpt.steps()
        assert [str(s) for s in steps] == sorted(names, key=int)
        for step in steps:
            state = ckpt.restore(step)  # verified: whole
            assert_same(state, rollback_state(step, state["run"]))
        done = [s for kind, s in events if kind == "rolled back"]
        if done:
            after = events[len(events) - events[::-1].index(("rolled back", done[-1])):]
            newest = max([s for kind, s in after if kind == "saved"], default=done[-1])
            for step in steps:
                if step > done[-1]:
                    assert step <= newest + 1 and ckpt.restore(step)["run"] == run, (step, events)
