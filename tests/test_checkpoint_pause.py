"""What a save makes the training loop wait for does not grow with the steps a root keeps
(issue 25, W7's pause): ``save`` checks the steps above the new one, the new one and the newest
step below it, never every step's ``meta.json``."""

from __future__ import annotations

import os

import pytest
import torch

import memtree
from memtree.store.reading import steps as steps_module


@pytest.fixture
def reads(monkeypatch):
    """The step names whose root ``meta.json`` was read, in order."""
    names: list[str] = []
    original = steps_module.read_step

    def counting(root_fd, root, name):
        names.append(name)
        return original(root_fd, root, name)

    monkeypatch.setattr(steps_module, "read_step", counting)
    return names


@pytest.mark.parametrize("blocking", [True, False])
def test_a_save_reads_the_newest_step_below_it_not_every_step(tmp_path, reads, blocking):
    ckpt = memtree.Checkpointer(tmp_path)  # keeps every step
    for step in range(0, 100, 10):
        ckpt.save(step, {"w": torch.full((2,), float(step))})
    reads.clear()
    out = ckpt.save(100, {"w": torch.zeros(2)}, blocking=blocking)
    if not blocking:
        out.result(timeout=120)
    assert reads[:1] == ["90"]  # link_from: the newest step below
    assert "0" not in reads and len(reads) <= 2
    assert ckpt.steps() == list(range(0, 101, 10))
    assert torch.equal(ckpt.restore(100)["w"], torch.zeros(2))


def test_steps_that_are_not_steps_are_passed_over_down_to_the_newest_step(tmp_path, reads):
    ckpt = memtree.Checkpointer(tmp_path)
    w = torch.arange(4.0)
    ckpt.save(10, {"w": w})
    os.mkdir(tmp_path / "20")  # a stray directory with a step name: not a step
    (tmp_path / "30").mkdir()
    (tmp_path / "30" / "meta.json").write_bytes(b"{broken")
    reads.clear()
    ckpt.save(40, {"w": w})  # incremental: links from 10, the newest step below 40
    assert reads == ["30", "20", "10"]
    assert os.stat(ckpt.path(40) + "/w.memmap").st_ino == os.stat(ckpt.path(10) + "/w.memmap").st_ino
    assert ckpt.steps() == [10, 40]


def test_the_steps_above_are_all_checked_before_a_save_below_them(tmp_path, reads):
    ckpt = memtree.Checkpointer(tmp_path)
    for step in (10, 20, 30):
        ckpt.save(step, {"x": step})
    os.mkdir(tmp_path / "50")  # not a step: never named as newer
    reads.clear()
    with pytest.raises(memtree.StepOrderError, match="newest step of .*, 30 .*20, 30"):
        ckpt.save(15, {"x": 15})
    assert sorted(reads) == ["10", "20", "30", "50"]
    ckpt.save(15, {"x": 15}, discard_newer=True)
    assert ckpt.steps() == [10, 15]
