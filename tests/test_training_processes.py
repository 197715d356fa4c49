"""Two processes on one Checkpointer root at once.

What must hold whatever the interleaving (``docs/guide/training.md``, "Retention, steps and
several writers"):

* two writers of *different* steps: each save commits, or is refused with ``StepOrderError``
  because the other writer committed a newer step first (nothing written); retention in one may
  delete the other's old steps, never the newest one; every step listed afterwards restores
  exactly what was saved;
* two writers of the *same* step: exactly one commits it, the other gets ``LockError`` or
  ``DestinationExistsError``, and the step holds the winner's state whole (never a mix);
* a reader calling ``latest()`` and ``restore()`` while another process saves with
  ``keep_last=1`` (retention deleting the step being read): ``restore()`` returns exactly the
  state of a committed step (retrying when the newest step is retired while it is read), and
  ``restore(step)`` of a retired step raises ``CheckpointNotFoundError``; never a half step,
  never "damaged".

The children are forked; they start together through a barrier and report through pipes.
Nothing is ordered by sleeping: every wait has a generous timeout for a loaded 2-core machine.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import pytest
import torch

import memtree
from memtree.errors import CheckpointNotFoundError, DestinationExistsError, LockError, StepOrderError
from test_training import assert_same

FORK = mp.get_context("fork")
TIMEOUT = 300.0  # seconds any wait may take on a loaded machine before the test fails
LEAVES = 24


def expected_state(step: int, writer: int = 0) -> dict:
    """What ``writer`` saves at ``step``: every leaf different from every other step's."""
    base = float(step * 1000 + writer * 100)
    return {
        "model": {f"l{i}": torch.full((8192,), base + i) for i in range(LEAVES)},
        "optim": {"state": {0: {"step": torch.tensor(base)}}, "param_groups": [{"betas": (0.9, 0.99)}]},
        "step": step,
        "writer": writer,
    }


def _child(target, report, *args) -> None:
    """Run ``target(report, *args)``; an exception goes to the parent as text (exit code 1)."""
    try:
        target(report, *args)
    except BaseException:  # noqa: BLE001 - everything reaches the parent
        report.send(("crash", traceback.format_exc()))
        report.close()
        os._exit(1)
    report.close()
    os._exit(0)


def _start(target, *args):
    recv, send = FORK.Pipe(duplex=False)
    p = FORK.Process(target=_child, args=(target, send, *args))
    p.start()
    send.close()
    return p, recv


def _collect(procs) -> list[list]:
    """Every message of every child, once all have exited (each join bounded)."""
    out = []
    for p, recv in procs:
        msgs = []
        while True:
            if not recv.poll(TIMEOUT):
                p.kill()
                pytest.fail(f"child {p.pid} reported nothing for {TIMEOUT} s")
            try:
                msgs.append(recv.recv())
            except EOFError:
                break
        p.join(TIMEOUT)
        crashes = [m[1] for m in msgs if m[0] == "crash"]
        assert not crashes, crashes[0]
        assert p.exitcode == 0, p.exitcode
        out.append(msgs)
    return out


def _check_root(root: str) -> list[int]:
    ckpt = memtree.Checkpointer(root)
    names = sorted(os.listdir(root))
    assert all(n.isdigit() for n in names), names  # no staging directory or lock file left
    steps = ckpt.steps()
    for step in steps:
        assert memtree.verify_tree(ckpt.path(step)).ok
    return steps


# -- two writers, their own steps --------------------------------------------------------------


def _own_steps(report, root, writer, barrier, blocking) -> None:
    ckpt = memtree.Checkpointer(root, keep_last=3)
    barrier.wait(TIMEOUT)
    for step in range(writer, 40, 2):
        try:
            out = ckpt.save(step, expected_state(step, writer), blocking=blocking)
        except StepOrderError as err:
            report.send(("refused", step, str(err)))
            continue
        if not blocking:
            out.result(TIMEOUT)
        report.send(("saved", step, ""))


def test_two_processes_saving_their_own_steps_with_retention(tmp_path):
    root = str(tmp_path / "ckpts")
    barrier = FORK.Barrier(2)
    procs = [_start(_own_steps, root, w, barrier, w == 0) for w in (0, 1)]
    msgs = [m for ms in _collect(procs) for m in ms]
    saved = sorted(s for kind, s, _ in msgs if kind == "saved")
    refused = sorted(s for kind, s, _ in msgs if kind == "refused")
    assert sorted(saved + refused) == list(range(40)) and 39 in saved
    for kind, step, message in msgs:
        if kind == "refused":  # the other writer had committed a newer step
            assert f"step {step} is below the newest step of {root}" in message, message
    # the last pruning pass saw every step: the three newest saved remain (a save racing it may
    # add its own, never deleted by its own retention), each exactly as saved
    steps = _check_root(root)
    assert steps[-3:] == saved[-3:] and set(steps) <= set(saved)
    ckpt = memtree.Checkpointer(root)
    for step in steps:
        assert_same(ckpt.restore(step), expected_state(step, step % 2))


# -- two writers, the same steps ---------------------------------------------------------------


def _same_steps(report, root, writer, barrier) -> None:
    ckpt = memtree.Checkpointer(root)
    for step in range(12):
        barrier.wait(TIMEOUT)  # both start each step together
        try:
            ckpt.save(step, expected_state(step, writer))
        except (LockError, DestinationExistsError) as err:
            report.send(("lost", step, type(err).__name__, str(err)))
        else:
            report.send(("won", step))


def test_two_processes_saving_the_same_steps(tmp_path):
    root = str(tmp_path / "ckpts")
    barrier = FORK.Barrier(2)
    procs = [_start(_same_steps, root, w, barrier) for w in (0, 1)]
    results = _collect(procs)
    winners: dict[int, list[int]] = {}
    for writer, msgs in enumerate(results):
        for m in msgs:
            if m[0] == "won":
                winners.setdefault(m[1], []).append(writer)
            else:
                assert m[0] == "lost" and root in m[3], m  # a clear error, naming where
    assert sorted(winners) == list(range(12)) and all(len(w) == 1 for w in winners.values()), winners
    assert _check_root(root) == list(range(12))
    ckpt = memtree.Checkpointer(root)
    for step, (writer,) in winners.items():
        assert_same(ckpt.restore(step), expected_state(step, writer))  # the winner's, whole


# -- a reader while a writer saves and retires steps ----------------------------------------------


def _writer(report, root, barrier, steps) -> None:
    ckpt = memtree.Checkpointer(root, keep_last=1)
    ckpt.save(0, expected_state(0))
    barrier.wait(TIMEOUT)
    for step in range(1, steps):
        ckpt.save(step, expected_state(step), blocking=step % 2 == 0)
    ckpt.wait()
    report.send(("done", steps - 1))


def _reader(report, root, barrier, stop) -> None:
    ckpt = memtree.Checkpointer(root)
    barrier.wait(TIMEOUT)
    latest_restored = explicit = retired = 0
    while True:
        done = stop.poll(0)  # the writer finished: one last round, which must see its last step
        step = ckpt.latest()
        assert step is not None
        state = ckpt.restore()  # the newest step, retried if it is retired while read
        assert_same(state, expected_state(state["step"]))
        assert state["step"] >= step
        latest_restored += 1
        try:
            assert_same(ckpt.restore(step), expected_state(step))
            explicit += 1
        except CheckpointNotFoundError as err:
            assert f"step {step}" in str(err) and root in str(err)
            retired += 1
        if done:
            report.send(("last", state["step"]))
            break
    report.send(("counts", latest_restored, explicit, retired))


def test_a_reader_restores_while_another_process_saves_and_retires_steps(tmp_path):
    root = str(tmp_path / "ckpts")
    barrier = FORK.Barrier(2)
    stop_recv, stop_send = FORK.Pipe(duplex=False)
    writer = _start(_writer, root, barrier, 60)
    reader = _start(_reader, root, barrier, stop_recv)
    (wmsgs,) = _collect([writer])
    last = wmsgs[-1][1]
    stop_send.send("stop")
    (rmsgs,) = _collect([reader])
    assert ("last", last) in rmsgs
    _, latest_restored, explicit, retired = next(m for m in rmsgs if m[0] == "counts")
    assert latest_restored >= 1 and explicit >= 1  # at least the final round read the newest step
    assert _check_root(root) == [last]


# -- the same races, made deterministic in one process -------------------------------------------


def test_a_listing_in_which_a_step_was_retired_midway_is_taken_again(tmp_path, monkeypatch):
    """``os.listdir`` answers, then another writer commits step 2 and retires step 1 before
    ``steps()`` checks the names: the stale listing (only "1") is not the answer."""
    import memtree.training.checkpointer as module

    ckpt = memtree.Checkpointer(tmp_path, keep_last=1)
    ckpt.save(1, expected_state(1))
    real = os.listdir
    calls = []

    def stale_listdir(path):
        names = real(path)
        calls.append(names)
        if len(calls) == 1:
            memtree.Checkpointer(tmp_path, keep_last=1).save(2, expected_state(2))
        return names

    monkeypatch.setattr(module.os, "listdir", stale_listdir)
    assert ckpt.steps() == [2] and ckpt.latest() == 2
    assert "1" in calls[0] and "2" not in calls[0]  # the first listing was the stale one


@pytest.mark.parametrize("how", ["retired", "replaced"])
def test_a_step_retired_or_replaced_while_restore_reads_it(tmp_path, monkeypatch, how):
    """Another writer acts right after ``restore`` opened the step's root ``meta.json``: the
    rest of the read fails on files that are gone, and ``restore`` tells it from damage."""
    import memtree.training.checkpointer as module

    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, expected_state(1))
    real_open = module.open_tree
    other = memtree.Checkpointer(tmp_path, keep_last=1)
    opened = []
    actions = []  # what the other writer does after the next open, one per open

    def open_then_interfere(path, options):
        root = real_open(path, options)
        opened.append(path)
        if actions:
            actions.pop(0)()
        return root

    monkeypatch.setattr(module, "open_tree", open_then_interfere)
    # the other writer stands for another process, whose retention cannot load this process's
    # opened trees first (memtree.store.reading.read.load_pending_at does, for trees of this process)
    monkeypatch.setattr(module, "load_pending_at", lambda path: None)
    if how == "retired":
        actions.append(lambda: other.save(2, expected_state(2)))  # step 1 deleted by retention
        assert_same(ckpt.restore(), expected_state(2))  # the newest step, read again
        assert opened == [ckpt.path(1), ckpt.path(2)]
        actions.append(lambda: other.save(3, expected_state(3)))
        with pytest.raises(CheckpointNotFoundError, match="step 2 .*deleted while it was read"):
            ckpt.restore(2)
        assert ckpt.steps() == [3]
    else:
        actions.append(lambda: other.save(1, expected_state(1, writer=1), overwrite=True))
        state = ckpt.restore(1)
        # the old tree read whole before its files went, or the new one read again: never a mix
        assert_same(state, expected_state(1, writer=state["writer"]))
        assert_same(ckpt.restore(1), expected_state(1, writer=1))


def test_damage_of_a_step_that_stays_is_raised_not_retried(tmp_path, monkeypatch):
    import memtree.training.checkpointer as module

    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, expected_state(1))
    os.unlink(os.path.join(ckpt.path(1), "model", "l3.memmap"))
    calls = []
    real_open = module.open_tree
    monkeypatch.setattr(module, "open_tree", lambda *a: calls.append(a) or real_open(*a))
    with pytest.raises(memtree.MissingLeafError, match="l3.memmap"):
        ckpt.restore()
    assert len(calls) == 1
