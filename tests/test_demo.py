"""``memtree demo``: quick, talkative, and showing the pitch: a Checkpointer killed with ``kill -9``
and resumed, one line against ``torch.load``/safetensors, and what to run next."""

from __future__ import annotations

import re

import memtree
from memtree.cli.demo import run_demo


def test_the_demo_prints_each_line_as_it_goes_and_resumes_a_killed_run(tmp_path):
    echoed: list[str] = []
    report = run_demo(str(tmp_path), dataset_items=8, echo=echoed.append)
    assert echoed == report.splitlines()
    assert echoed[0] == f"memtree demo in {tmp_path}"
    assert any(line.startswith("  loading the same weights: memtree load_memmap ") for line in echoed)
    killed = next(line for line in echoed if "kill -9" in line)
    match = re.search(r"after it saved step (\d+); resumed from step (\d+)", killed)
    assert match and int(match.group(1)) >= 3 and int(match.group(2)) >= int(match.group(1)), killed
    steps = memtree.Checkpointer(tmp_path / "checkpoints").steps()
    assert steps[-1] == int(match.group(2))  # the newest committed step is the one resumed
    assert echoed[-1] == f"next: memtree info {tmp_path / 'model'}; memtree info {tmp_path / 'checkpoints'}"
    assert memtree.load_memmap(tmp_path / "model", mode="r").keys()  # the files stay for `memtree info`
    again = run_demo(str(tmp_path), dataset_items=8).splitlines()  # the same --workdir: training goes on
    resumed = re.search(r"after it saved step (\d+)", next(line for line in again if "kill -9" in line))
    assert resumed and int(resumed.group(1)) >= int(match.group(2)) + 4
