"""The benchmark suite cannot rot: its quick mode runs every workload (W1..W5) end to end in a
subprocess, exits 0, and reports every system that is installed here.

One subprocess runs ``benchmarks/run.py all --quick`` (tiny sizes, one run each, cold-cache
rows included); the tests below read its table and its JSON rows. No timing is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # one benchmark subprocess behind all four tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")
LIBRARIES = ("tensordict", "safetensors", "tensorizer")


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def _library_of(system: str) -> str | None:
    return next((lib for lib in LIBRARIES if lib in system), None)


def _memtree_feature_missing(workload: str, system: str) -> bool:
    """memtree rows that measure features other issues add (module binding, convert)."""
    import memtree

    if workload == "w4" and system == "memtree to_module":
        return not (hasattr(memtree, "empty_init") and hasattr(memtree.TensorTree, "to_module"))
    if workload == "w5" and system == "memtree convert":
        return importlib.util.find_spec("memtree.interop") is None or not hasattr(
            importlib.import_module("memtree.interop"), "convert"
        )
    return False


@pytest.fixture(scope="module")
def quick_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("bench")
    rows_file = out / "rows.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(BENCH, "run.py"),
            "all",
            "--quick",
            "--json",
            str(rows_file),
            "--workdir",
            str(out / "work"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    rows = json.loads(rows_file.read_text()) if rows_file.exists() else []
    return proc, rows


def _expected_systems() -> dict[str, list[str]]:
    sys.path.insert(0, BENCH)
    try:
        import workloads

        cfg = {"quick": True, "size_gib": 1.0, "workdir": "", "settings": {}}
        return {name: list(wl.systems(cfg)) for name, wl in workloads.registry().items()}
    finally:
        sys.path.remove(BENCH)


def test_quick_mode_of_every_workload_exits_zero(quick_run: Any) -> None:
    proc, _ = quick_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("W1", "W2", "W3", "W4", "W5"):
        assert f"## {name}:" in proc.stdout


def test_table_mentions_every_system_and_measures_every_installed_one(quick_run: Any) -> None:
    proc, rows = quick_run
    for workload, systems in _expected_systems().items():
        for system in systems:
            assert f"| {system} |" in proc.stdout, f"{workload}: {system} missing from the table"
            mine = [r for r in rows if r["workload"] == workload and r["system"] == system]
            lib = _library_of(system)
            if (lib is not None and not _installed(lib)) or _memtree_feature_missing(
                workload, system
            ):
                assert mine and mine[0]["note"].startswith("N/A"), (workload, system, mine)
                continue
            measured = [r for r in mine if r["seconds"] is not None]
            assert measured, f"{workload}: {system} installed but not measured: {mine}"


def test_every_row_has_a_raw_limit_to_compare_with(quick_run: Any) -> None:
    _, rows = quick_run
    for workload in {r["workload"] for r in rows}:
        limits = [
            r for r in rows if r["workload"] == workload and r["limit"] and r["seconds"] is not None
        ]
        assert limits, f"{workload} measured no raw limit"


def test_data_read_back_is_correct_in_every_row(quick_run: Any) -> None:
    proc, rows = quick_run
    for r in rows:
        assert "WRONG DATA" not in r["note"] and "DIFFERS" not in r["note"], r
        assert not r["note"].startswith("FAILED"), r
    w4 = [r for r in rows if r["workload"] == "w4" and r["op"] == "first forward"]
    assert w4 and all("output equal" in r["note"] for r in w4)
