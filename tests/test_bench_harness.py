"""The benchmark harness measures what it claims (issue 25): every timed run is checked against
the expected bytes with the target reset before it, a cold run is verified cold, a loaded or
unchecked run cannot call a target met, targets are computed from raw times, and RESULTS.md's
table is generated from the stored runs. Fast: tiny sizes, no timing asserted."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "benchmarks"


@pytest.fixture(autouse=True, scope="module")
def _bench_on_path() -> Iterator[None]:
    sys.path.insert(0, str(BENCH))
    yield
    sys.path.remove(str(BENCH))


def _settings(rounds: int = 2, warmup: int = 0) -> Any:
    import harness

    return harness.Settings(rounds=rounds, warmup=warmup)


# -- the import graph --------------------------------------------------------------------------
def _graph() -> dict[str, set[str]]:
    mods = {p.stem for p in BENCH.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for path in BENCH.glob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        deps: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps.add(node.module.split(".")[0])
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "WORKLOADS" for t in node.targets):
                deps |= {module for module, _ in ast.literal_eval(node.value).values()}  # run.py imports them
        graph[path.stem] = {d for d in deps if d in mods and d != path.stem}
    return graph


def test_benchmark_modules_import_one_way() -> None:
    """No import circle among benchmarks/*.py (the old harness <-> workloads <-> w3/w4/w5 one),
    and the bottom modules import no workload."""
    graph = _graph()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                pytest.fail(f"import circle in benchmarks/: {' -> '.join(path + [m, d])}")
            if d not in state:
                visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    for low in ("results", "pagecache", "checks", "harness", "targets", "report"):
        assert graph[low] <= {"results", "pagecache", "checks", "targets"}, (low, graph[low])
    assert "run" in graph and graph["run"] >= {"store_workloads", "w4_model", "w6_resume", "gpu_load"}


def test_the_circle_checker_finds_a_circle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "_graph", lambda: {"a": {"b"}, "b": {"a"}})
    with pytest.raises(pytest.fail.Exception, match="import circle"):
        test_benchmark_modules_import_one_way()


# -- every timed run checked, the target reset before it --------------------------------------------
@pytest.fixture(scope="module")
def w6(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    import w6_resume

    cfg = {"quick": True, "workdir": str(tmp_path_factory.mktemp("w6"))}
    return w6_resume.checkpoint(cfg)


def _w6_system(w6: tuple[str, dict[str, Any]], load: Any, name: str = "memtree") -> tuple[Any, Any]:
    import w6_resume

    wd, info = w6
    box = w6_resume.live_container(info["dims"])
    loads = w6_resume.loads(box, wd)
    return box, w6_resume._in_process(name, box, load(box, loads), wd, info)


def test_a_correct_load_passes_every_check(w6: tuple[str, dict[str, Any]]) -> None:
    import harness

    _, system = _w6_system(w6, lambda box, loads: loads["memtree"])
    [row] = harness.compare("w6", "load, one process", "warm", [system], _settings(3))
    assert row.error is None and row.checked == 3 == len(row.runs) and row.valid


def test_a_load_that_writes_nothing_fails_its_check(w6: tuple[str, dict[str, Any]]) -> None:
    """The target is zeroed before every run, so a load that writes nothing cannot pass on the
    bytes an earlier run left: the first rounds load, the third writes nothing and fails."""
    import harness

    calls = [0]

    def load(box: Any, loads: dict[str, Any]) -> Any:
        def go() -> None:
            calls[0] += 1
            if calls[0] < 3:
                loads["memtree"]()

        return go

    _, system = _w6_system(w6, load)
    [row] = harness.compare("w6", "load, one process", "warm", [system], _settings(4))
    assert row.error is not None and row.error.startswith("check failed in round 2"), row.error
    assert "wrong bytes" in row.error and not row.valid
    assert len(row.runs) == 2  # the runs before it count, none after


def test_a_load_in_the_wrong_order_fails_its_check(w6: tuple[str, dict[str, Any]]) -> None:
    """The right bytes under the wrong names (two tensors of one shape swapped) fail: the check
    is per key, not a sum over everything."""
    import harness

    def load(box: Any, loads: dict[str, Any]) -> Any:
        def go() -> None:
            loads["memtree"]()
            sd = box.state_dict()
            a, b = sd["optim.0.exp_avg"], sd["optim.0.exp_avg_sq"]
            tmp = a.clone()
            a.copy_(b)
            b.copy_(tmp)

        return go

    _, system = _w6_system(w6, load)
    [row] = harness.compare("w6", "load, one process", "warm", [system], _settings(1))
    assert row.error is not None and "optim.0.exp_avg" in row.error and not row.valid


def test_gpu_load_resets_its_target_and_checks_every_run(tmp_path: Path) -> None:
    """gpu_load.py's comparisons, on the CPU (its plumbing): a loader that writes nothing after a
    good first run fails, because the module's tensors are zeroed before every run."""
    import gpu_load
    import harness

    cfg = {"quick": True, "workdir": str(tmp_path), "device": "cpu", "caches": ["warm"]}
    comps = list(gpu_load.comparisons(cfg))
    fill = next(c for c in comps if c.op == "load into existing tensors")
    system = next(s for s in fill.systems if s.name == "memtree load_into_module")
    good = system.run
    calls = [0]

    def sometimes(state: Any) -> Any:
        calls[0] += 1
        return good(state) if calls[0] == 1 else None

    system.run = sometimes
    rows = harness.compare("gpu", fill.op, "warm", fill.systems, _settings(2))
    mine = next(r for r in rows if r.system == "memtree load_into_module")
    assert mine.error is not None and mine.error.startswith("check failed in round 1"), mine.error
    other = next(r for r in rows if r.system == "memtree load_into_module (safetensors file)")
    assert other.valid and other.checked == 2


def test_a_save_is_read_back_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W1's save comparison reads every save back: a save that drops a tensor fails."""
    import harness
    import store_workloads
    import stores

    cfg = {"quick": True, "size_gib": 1.0, "workdir": str(tmp_path), "caches": ["warm"], "systems": "memtree t0,raw"}
    comps = store_workloads.W1.comparisons(cfg)
    save = next(comps)
    real = stores.save

    def lossy(store: Any, layout: Any, tensors: Any, path: str) -> Any:
        return real(store, layout[:-1], tensors[:-1], path) if store.kind == "memtree" else real(
            store, layout, tensors, path)

    monkeypatch.setattr(store_workloads, "save", lossy)
    rows = harness.compare("w1", save.op, save.cache, save.systems, _settings(1))
    by = {r.system: r for r in rows}
    assert by["raw"].valid
    assert by["memtree t0"].error is not None and by["memtree t0"].error.startswith("check failed"), by
    comps.close()


# -- cold means cold ----------------------------------------------------------------------------------
def _reader(path: str) -> Any:
    import harness

    def run(_: Any) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    return harness.System("read", run=run, check=lambda s, out: None, files=[path])


def test_cold_runs_are_checked_cold_before_every_run(tmp_path: Path) -> None:
    import harness
    import pagecache

    if pagecache.is_tmpfs(str(tmp_path)):
        pytest.skip("the test directory is on tmpfs: nothing there can be evicted")
    f = tmp_path / "data"
    f.write_bytes(os.urandom(1 << 20))
    [row] = harness.compare("t", "read", "cold", [_reader(str(f))], _settings(3))
    assert row.resident == [0.0, 0.0, 0.0] and row.cold_verified and "NOT COLD" not in row.note


def test_a_file_that_stays_cached_is_not_called_cold() -> None:
    """tmpfs keeps its pages: mincore finds them, and the row is not cold."""
    import harness
    import pagecache

    if not os.path.isdir("/dev/shm") or not pagecache.is_tmpfs("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    d = Path(__import__("tempfile").mkdtemp(dir="/dev/shm"))
    try:
        f = d / "data"
        f.write_bytes(os.urandom(1 << 20))
        [row] = harness.compare("t", "read", "cold", [_reader(str(f))], _settings(2))
        assert not row.cold_verified and row.resident and all(r > 0 for r in row.resident)
        assert "NOT COLD" in row.note
    finally:
        shutil.rmtree(d)


def test_run_refuses_a_tmpfs_work_directory_for_cold_runs() -> None:
    import pagecache

    if not os.path.isdir("/dev/shm") or not pagecache.is_tmpfs("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm")
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "w3", "--quick", "--workdir", "/dev/shm"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "memory file system" in proc.stderr, proc.stderr


# -- verdicts ------------------------------------------------------------------------------------------
def _run(load: float | None, mine: list[float], ref: list[float], *, others: float | None = None,
         checked: bool = True, cache: str = "", quick: bool = False) -> Any:
    from results import Row, Run

    rows = [
        Row("w1", "save", cache, "memtree t2", runs=mine, checked=len(mine) if checked else None,
            others_load=others, resident=[0.0] * len(mine) if cache == "cold" else []),
        Row("w1", "save", cache, "raw", runs=ref, checked=len(ref) if checked else None, limit=True,
            others_load=others, resident=[0.0] * len(ref) if cache == "cold" else []),
    ]
    return Run({"date": "2026-01-01T00:00Z", "load_start": load, "command": "test", "quick": quick}, rows)


def _target(bound: float = 1.15, cache: str = "") -> Any:
    from targets import Target

    return Target("test target", "w1", "save", cache, ("memtree t2",), ("raw",), bound)


def test_a_loaded_run_cannot_meet_a_target() -> None:
    from targets import judge

    t = _target()
    assert judge(t, _run(0.5, [1.0] * 5, [1.0] * 5)).verdict == "met"
    loaded = judge(t, _run(3.2, [1.0] * 5, [1.0] * 5))
    assert loaded.verdict == "not judged" and "load 3.20 > 1.5" in loaded.why
    others = judge(t, _run(0.5, [1.0] * 5, [1.0] * 5, others=2.0))  # others busy during the run
    assert others.verdict == "not judged" and "load 2.00" in others.why
    unknown = judge(t, _run(None, [1.0] * 5, [1.0] * 5))
    assert unknown.verdict == "not judged" and "not recorded" in unknown.why
    missed = judge(t, _run(3.2, [2.0] * 5, [1.0] * 5))  # a miss stays a miss, and says it was loaded
    assert missed.verdict == "missed" and "load 3.20" in missed.why


def test_a_reported_ratio_is_shown_and_never_met_or_missed() -> None:
    """A ratio an issue asks for without a bound (issue 26's GPT-2-sized save and load)."""
    from dataclasses import replace

    from targets import judge

    t = replace(_target(), kind="report")
    for mine in ([2.0] * 5, [0.5] * 5):
        j = judge(t, _run(0.5, mine, [1.0] * 5))
        assert j.verdict == "reported" and j.measured.startswith(f"{mine[0]:.4f}")
    loaded = judge(t, _run(3.2, [2.0] * 5, [1.0] * 5))
    assert loaded.verdict == "not judged" and "load 3.20" in loaded.why


def test_a_target_is_computed_from_raw_times_without_rounding() -> None:
    """1.105× against a 1.10 bound is a miss (it was once reported as 1.10×, met)."""
    from targets import judge

    t = _target(bound=1.10)
    j = judge(t, _run(0.5, [1.105] * 5, [1.0] * 5))
    assert j.verdict == "missed" and j.measured.startswith("1.1050")
    assert judge(t, _run(0.5, [1.1] * 5, [1.0] * 5)).verdict == "met"


def test_the_ratio_is_the_median_of_paired_rounds() -> None:
    """Rounds pair up by index: a drift that hits both systems of a round cancels out."""
    from targets import judge

    j = judge(_target(bound=1.0), _run(0.5, [1.0, 2.0, 4.0, 8.0, 16.0], [1.1, 2.2, 4.4, 8.8, 17.6]))
    assert j.verdict == "met" and j.measured.startswith("0.9091")


def test_unchecked_quick_or_short_runs_cannot_meet_a_target() -> None:
    from targets import judge

    t = _target()
    legacy = judge(t, _run(0.5, [1.0] * 5, [1.0] * 5, checked=False))
    assert legacy.verdict == "not judged" and "not checked" in legacy.why
    quick = judge(t, _run(0.5, [1.0] * 5, [1.0] * 5, quick=True))
    assert quick.verdict == "not judged" and "quick" in quick.why
    short = judge(t, _run(0.5, [1.0] * 2, [1.0] * 2))
    assert short.verdict == "not judged" and "2 rounds" in short.why


def test_a_cold_target_needs_every_run_verified_cold() -> None:
    from targets import judge

    t = _target(cache="cold")
    run = _run(0.5, [1.0] * 5, [1.0] * 5, cache="cold")
    assert judge(t, run).verdict == "met"
    run.rows[0].resident[3] = 0.2
    j = judge(t, run)
    assert j.verdict == "not judged" and "not verified cold" in j.why and "memtree t2" in j.why


def test_never_slower_means_every_round_against_each_library() -> None:
    from results import Row, Run
    from targets import Target, judge

    t = Target("never slower", "w6", "load", "warm", ("memtree",), ("a", "b"), 1.0, stat="max", vs="each")
    rows = [Row("w6", "load", "warm", "memtree", runs=[1.0] * 5, checked=5),
            Row("w6", "load", "warm", "a", runs=[2.0] * 5, checked=5),
            Row("w6", "load", "warm", "b", runs=[2.0, 2.0, 0.9, 2.0, 2.0], checked=5)]
    j = judge(t, Run({"date": "x", "load_start": 0.1}, rows))
    assert j.verdict == "missed" and "1 beyond" in j.measured


def test_the_w6_warm_target_needs_nine_pairs() -> None:
    from results import Row, Run
    from targets import TARGETS, judge

    t = next(t for t in TARGETS if t.text.startswith("W6 warm"))
    def rows(n: int) -> list[Row]:
        return [Row("w6", "load, one process", "warm", "memtree", runs=[1.0] * n, checked=n),
                Row("w6", "load, one process", "warm", "floor", runs=[0.95] * n, checked=n, limit=True)]
    assert judge(t, Run({"date": "x", "load_start": 0.1}, rows(9))).verdict == "met"
    assert judge(t, Run({"date": "x", "load_start": 0.1}, rows(8))).verdict == "not judged"


def test_a_memory_bound_on_several_systems_is_judged_on_the_worst() -> None:
    from results import Row, Run
    from targets import TARGETS, judge

    t = next(t for t in TARGETS if t.text.startswith("W6 anonymous memory") and t.cache == "warm")
    rows = [Row("w6", t.op, "warm", name, runs=[1.0 + i] * 5, checked=5, metrics={"anon beyond model": anon})
            for i, (name, anon) in enumerate(zip(t.mine, (1 << 20, 80 << 20, 2 << 20)))]
    j = judge(t, Run({"date": "x", "load_start": 0.1}, rows))
    assert j.verdict == "missed" and "80.00 MiB" in j.measured and t.mine[1] in j.measured


def test_w4_first_forward_is_judged_against_the_fastest_library() -> None:
    """The target once compared memtree with the *slowest* anchor; it is the best one again."""
    from results import Row, Run
    from targets import TARGETS, judge

    t = next(t for t in TARGETS if t.text.startswith("W4 first forward"))
    rows = [Row("w4", "first forward", "warm", "memtree to_module", runs=[1.0] * 5, checked=5),
            Row("w4", "first forward", "warm", "safetensors + assign", runs=[0.5] * 5, checked=5),
            Row("w4", "first forward", "warm", "tensorizer", runs=[3.0] * 5, checked=5)]
    j = judge(t, Run({"date": "x", "load_start": 0.1}, rows))
    assert j.verdict == "missed" and "safetensors + assign" in j.measured


def test_w7_pause_is_judged_against_a_copy_into_preallocated_memory() -> None:
    from targets import TARGETS

    pauses = [t for t in TARGETS if t.text.startswith("W7 async checkpoint pause ≤ 1.1×")]
    assert {t.op for t in pauses} == {"save, 50 MB state", "save, 500 MB state", "save, 2 GB state"}
    assert all(t.ref == ("copy_ into preallocated",) and t.bound == 1.1 for t in pauses)


# -- the generated table -----------------------------------------------------------------------------
def test_report_regenerates_the_table_from_stored_json(tmp_path: Path) -> None:
    import report
    from results import save_run

    store = tmp_path / "results"
    run = _run(0.4, [1.0, 1.02, 0.98, 1.01, 0.99], [1.0] * 5)
    run.rows[0].system, run.rows[1].system = "memtree t2 xxh3", "memtree t2 no checksum"
    save_run(run, str(store / "run.json"))
    md = tmp_path / "RESULTS.md"
    md.write_text(f"# results\n\n{report.BEGIN}\nstale\n{report.END}\n\n## notes\nkept\n")
    assert report.update(str(md), check=True, folder=str(store)) is False  # stale: --check says so
    assert "stale" in md.read_text()
    assert report.update(str(md), folder=str(store)) is False  # rewritten
    text = md.read_text()
    line = next(x for x in text.splitlines() if "fast-hash extra" in x)
    assert "| met |" in line and "1.0000" in line and "2026-01-01 00:00" in line and "| 0.40 |" in line
    assert "`test`" in line and text.endswith("## notes\nkept\n") and "stale" not in text
    assert report.update(str(md), check=True, folder=str(store)) is True  # now current


def test_results_md_opens_with_the_current_generated_table() -> None:
    import report

    text = (BENCH / "RESULTS.md").read_text()
    assert text.splitlines()[2] == report.BEGIN  # the title, then the table: what a reader sees first
    assert report.update(check=True), "RESULTS.md is stale: run `python benchmarks/run.py report`"
    proc = subprocess.run([sys.executable, str(BENCH / "run.py"), "report", "--check"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "up to date" in proc.stdout, proc.stdout + proc.stderr


def test_stored_runs_are_valid_documents() -> None:
    from results import FORMAT, stored_runs

    runs = stored_runs()
    assert runs
    for run in runs:
        assert json.loads(Path(run.path).read_text())["format"] == FORMAT
        assert run.date and "command" in run.info and run.rows


def test_every_target_names_a_known_workload_and_an_existing_op() -> None:
    import targets

    run_py = (BENCH / "run.py").read_text()
    for t in targets.TARGETS:
        assert t.workload == "*" or f'"{t.workload}"' in run_py, t
        assert t.kind in ("ratio", "speed", "seconds", "metric", "metric_ratio", "rss_flat", "rss_of_model",
                          "memory", "report"), t
        assert t.stat in ("median", "max") and t.vs in ("best", "each", "slowest"), t


def test_checks_catch_what_a_sum_misses() -> None:
    """An order-insensitive check (a sum of bit patterns, as gpu_load.py once had) passes a
    permuted tensor; the digest and the element-wise check do not."""
    from checks import CheckFailed, digest, expect_equal

    t = torch.randn(1000)
    perm = t.flip(0)
    assert int(t.view(torch.int32).long().sum()) == int(perm.view(torch.int32).long().sum())
    assert digest(t) != digest(perm)
    with pytest.raises(CheckFailed):
        expect_equal(perm, t, "permuted")
    with pytest.raises(CheckFailed):
        expect_equal(torch.tensor([-0.0]), torch.tensor([0.0]), "signed zero")
    expect_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]), "same NaN")
