"""Every ``tutorials/*.py`` runs, in a subprocess, with fast settings, and reports success.

The contract for tutorial authors (also in docs/getting-started.md):

* a tutorial is a script ``tutorials/NN_name.py`` that runs top to bottom with
  ``python tutorials/NN_name.py`` and prints what it does;
* with ``MEMTREE_TUTORIAL_FAST=1`` in the environment it uses small sizes so that it finishes in
  seconds (this suite sets it);
* it exits with status 0, prints no traceback, and the **last line it prints starts with
  ``OK``** (for example ``OK quickstart: ...``), printed only once everything it demonstrates
  has been checked;
* it works from any current directory (this suite runs it in a fresh temporary directory) and
  cleans up the files it creates outside that directory.

New tutorials are picked up automatically: the tests are parametrized over the glob.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TUTORIALS = sorted((REPO / "tutorials").glob("*.py"))


def test_there_are_tutorials() -> None:
    assert any(p.name.startswith("01_") for p in TUTORIALS), TUTORIALS


@pytest.mark.slow
@pytest.mark.parametrize("script", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs_and_ends_with_ok(script: Path, tmp_path: Path) -> None:
    env = dict(os.environ)
    env["MEMTREE_TUTORIAL_FAST"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["TMPDIR"] = str(tmp_path)  # files a tutorial leaves behind go away with tmp_path
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    report = f"{script.name} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, report
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, report
    assert lines[-1].startswith("OK"), report
    assert "Traceback" not in proc.stderr, report
