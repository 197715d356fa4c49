"""The benchmark suite cannot rot: each workload's quick mode runs end to end in a subprocess,
exits 0, checks every timed run, verifies its cold runs cold, and measures the rows that its
targets name. No timing is asserted (``--quick`` sizes are never results)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytestmark = pytest.mark.slow  # a benchmark subprocess per workload

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"
WORKLOADS = ["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8", "w9", "w10", "w11", "gpu"]


@pytest.fixture(autouse=True, scope="module")
def _bench_on_path() -> Iterator[None]:
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))


def _quick(workload: str, tmp: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp / "run.json"
    extra = ["--device", "cpu"] if workload == "gpu" else []
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run.py"), workload, "--quick", "--json", str(out), "--workdir", str(tmp),
         *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    doc = json.loads(out.read_text()) if out.exists() else {"run": {}, "rows": []}
    return proc, doc


def _library_failure(row: dict[str, Any]) -> bool:
    """A library that fails here (a result, not a failure of the suite): never memtree or a limit."""
    return not row["limit"] and not row["system"].startswith("memtree")


@pytest.mark.parametrize("workload", WORKLOADS)
def test_quick_run_checks_every_timed_run(workload: str, tmp_path: Path) -> None:
    import pagecache
    from results import Row, Run
    from targets import TARGETS, judge

    proc, doc = _quick(workload, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"## {workload.upper()}:" in proc.stdout
    rows = [Row(**r) for r in doc["rows"]]
    assert rows and doc["run"]["quick"] is True and doc["run"]["load_start"] is not None
    cold_ok = not pagecache.is_tmpfs(str(tmp_path))
    for r in rows:
        assert f"| {r.system} |" in proc.stdout, r.system  # every system is in the printed table
        if r.error is not None:
            assert r.error.startswith("N/A") or _library_failure(r.__dict__), r
            continue
        assert r.runs and r.checked == len(r.runs), r  # every timed run checked
        if r.cache == "cold" and cold_ok:
            assert r.cold_verified, r
    run = Run(doc["run"], rows)
    for t in TARGETS:
        if t.workload != workload:
            continue
        mine = [r for r in rows if (r.op, r.cache, r.system) in {(t.op, t.cache, n) for n in t.mine}]
        refs = [r for r in rows if (r.op, r.cache, r.system) in {(t.op, t.cache, n) for n in t.ref}]
        if t.op.startswith("write ") or (t.op.startswith("fresh process") and t.cache == "cold"):
            continue  # a quick run writes W3's items fewer times, and spawns W4's processes warm only
        if not mine and "fresh process" in t.op and any((r.op, r.cache) == (t.op, t.cache) for r in rows):
            continue  # a quick run spawns fresh processes for a few systems only
        assert mine, f"{t.text}: no row of {t.mine} in {workload}'s quick run"
        if workload == "gpu" or all(r.error for r in mine) or (refs and all(r.error for r in refs)):
            continue  # a GPU target needs a GPU; systems that cannot run here are N/A
        j = judge(t, run)
        assert j.verdict == "not judged" and "quick" in j.why, (t.text, j.verdict, j.measured)


def test_a_quick_run_is_never_stored_as_a_result() -> None:
    from results import stored_runs

    assert not [r.path for r in stored_runs() if r.info.get("quick")]
