"""``scripts/dev.sh``: pip runs on the first run and again only when pyproject.toml (or the torch
pin, the extras, the interpreter) changed, and each slow step says what is running.

The script runs against a stand-in ``.venv/bin/python`` that records its calls, so nothing is
installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$(dirname "$0")/../calls"
if [ "$1" = -c ]; then echo "3.11.7 (fake)"; fi
"""


def _repo(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "dev.sh", tmp_path / "scripts" / "dev.sh")
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    return tmp_path


def _run(repo: Path, job: str) -> tuple[list[str], str]:
    calls = repo / ".venv" / "calls"
    calls.unlink(missing_ok=True)
    done = subprocess.run(["bash", "scripts/dev.sh", job], cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [c for c in calls.read_text().splitlines() if not c.startswith("-c ")], done.stderr


def test_pip_runs_once_until_pyproject_changes(tmp_path):
    repo = _repo(tmp_path)
    calls, err = _run(repo, "demo")
    assert calls[0].startswith("-m pip install") and calls[1] == "-m memtree demo"
    assert "dev.sh: installing torch==" in err
    calls, err = _run(repo, "demo")
    assert calls == ["-m memtree demo"] and "installing" not in err
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\nversion = '2'\n")
    calls, _ = _run(repo, "demo")
    assert calls[0].startswith("-m pip install")


def test_the_test_job_says_what_runs_before_pytest(tmp_path):
    repo = _repo(tmp_path)
    _run(repo, "demo")
    calls, err = _run(repo, "test")  # another extra (.[test,docs]): installed once more
    assert calls[0].startswith("-m pip install") and calls[0].endswith("-e .[test,docs]")
    assert [c.split()[1] for c in calls[1:]] == ["mkdocs", "mypy", "pytest"]
    steps = [line for line in err.splitlines() if line.startswith("dev.sh: ")]
    assert [s.split()[1] for s in steps] == ["installing", "building", "checking", "running"]
    calls, _ = _run(repo, "test")
    assert not any("pip" in c for c in calls)
