"""memtree benchmark suite: every system of a comparison in interleaved rounds, every run checked.

Usage (from the repository root):

    .venv/bin/python benchmarks/run.py w1 --store          # one workload, stored in benchmarks/results/
    .venv/bin/python benchmarks/run.py all --store         # W1..W10 (the GPU workload: gpu)
    .venv/bin/python benchmarks/run.py all --quick         # tiny sizes: a smoke test, never a result
    .venv/bin/python benchmarks/run.py report              # RESULTS.md's table from the stored runs
    .venv/bin/python benchmarks/run.py report --check      # is it up to date? (exit 1 if not)

Each workload runs in a fresh subprocess (``--inline``: in this one; the default with
``--quick``), its comparisons one after the other (``harness.compare``: ``--rounds`` timed
rounds after ``--warmup`` untimed ones, systems interleaved, every run checked, cold runs
verified cold with ``mincore``; ``--drop-caches``: dropping every cache of the machine first, root
only). ``--cache warm|cold|both`` picks the cache states of the
read comparisons; cold needs a work directory on a disk (tmpfs is refused: its pages are the
files). The run's document (``results.py``) records the date, the command, the commit, the
load average before it started and the runnable tasks of other processes during each
comparison; ``--json PATH`` writes it, ``--store`` writes it where ``report`` reads it.
Exit status 1 when memtree or a raw limit failed or failed its check (a library that cannot run
here is ``N/A``; a library that fails is reported, and is a result, not a failure of the suite).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from pagecache import can_drop_all, is_tmpfs  # noqa: E402
from results import STORE, Row, Run, save_run  # noqa: E402

#: Workload name -> the module (and object) that defines it: ``describe(cfg)`` and
#: ``comparisons(cfg)``. Adding a workload is one line here and its targets in targets.py.
WORKLOADS = {
    "w1": ("store_workloads", "W1"),
    "w2": ("store_workloads", "W2"),
    "w3": ("w3_dataset", None),
    "w4": ("w4_model", None),
    "w5": ("w5_convert", None),
    "w6": ("w6_resume", None),
    "w7": ("w7_pause", None),
    "w8": ("w8_distributed", None),
    "w10": ("w10_quantized", None),
    "w9": ("w9_datasets", None),
    "w11": ("w11_small_leaves", "W11"),
    "gpu": ("gpu_load", None),
}
ALL = ["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8", "w9", "w10", "w11"]
HERE = os.path.dirname(os.path.abspath(__file__))


def workload(name: str) -> Any:
    """The object that defines workload ``name``."""
    module, attr = WORKLOADS[name]
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def measure(name: str, cfg: dict[str, Any]) -> list[Row]:
    """Every comparison of one workload, in this process."""
    from harness import Settings, compare, table

    settings = Settings(**cfg["settings"])
    rows: list[Row] = []
    for comp in workload(name).comparisons(cfg):
        s = settings if comp.rounds is None else replace(settings, rounds=comp.rounds)
        got = compare(name, comp.op, comp.cache, comp.systems, s)
        print(f"\n### {name.upper()} {comp.op} {comp.cache}\n\n{table(got)}", file=sys.stderr, flush=True)
        rows += got
    return rows


def _in_subprocess(name: str, cfg: dict[str, Any]) -> list[Row]:
    cmd = [sys.executable, os.path.join(HERE, "run.py"), "_worker", name, json.dumps(cfg)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    rows = [Row(**json.loads(line[4:])) for line in proc.stdout.splitlines() if line.startswith("ROW ")]
    if proc.returncode != 0:
        rows.append(Row(name, "*", "", "*", error=f"FAILED: the worker exited with status {proc.returncode}"))
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", choices=list(WORKLOADS) + ["all", "report"])
    p.add_argument("--check", action="store_true", help="report: exit 1 if RESULTS.md is not current")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 round, inline: a smoke test")
    p.add_argument("--size-gib", type=float, default=None, help="W1/W5/W6 data size (default 1; gpu: 2)")
    p.add_argument("--device", default="cuda", help="gpu: the device ('cpu' checks the plumbing only)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5; quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 1; quick 0)")
    p.add_argument("--cache", choices=["both", "warm", "cold"], default="both")
    p.add_argument("--drop-caches", action="store_true",
                   help="cold runs also write /proc/sys/vm/drop_caches first (root; evicts every process's "
                        "pages, dentries and inodes: only on a machine you have to yourself)")
    p.add_argument("--inline", action="store_true", help="measure in this process")
    p.add_argument("--systems", default="", help="comma-separated substrings: only these systems")
    p.add_argument("--workdir", default=None,
                   help="a new directory is made in it for the files (default: $BENCH_TMP or the temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", default=None, help="write the run's document here")
    p.add_argument("--store", action="store_true", help="write it into benchmarks/results/ too")
    return p


def _commit() -> str:
    try:
        head = subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", HERE, "status", "--porcelain", "--", "..", ":!benchmarks/results"],
                               capture_output=True, text=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for mod in ("torch", "safetensors", "tensordict", "tensorizer", "transformers"):
        try:
            out[mod] = str(importlib.import_module(mod).__version__)
        except Exception:  # noqa: BLE001 - not installed, or broken: either way not measured
            out[mod] = "missing"
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":  # internal: one workload in a fresh process
        for row in measure(argv[1], json.loads(argv[2])):
            print("ROW " + json.dumps(asdict(row)), flush=True)
        return 0
    args = _parser().parse_args(argv)
    if args.workload == "report":
        import report

        current = report.update(check=args.check)
        print("RESULTS.md is up to date" if current else
              ("RESULTS.md is out of date: run `python benchmarks/run.py report`" if args.check
               else "RESULTS.md's table regenerated"))
        return 0 if current or not args.check else 1
    load_start = os.getloadavg()[0]
    from harness import Settings, table

    settings = Settings(
        rounds=args.rounds if args.rounds is not None else (1 if args.quick else 5),
        warmup=args.warmup if args.warmup is not None else (0 if args.quick else 1),
        quick=args.quick,
        drop_all=args.drop_caches,
    )
    if args.drop_caches and not can_drop_all():
        print("--drop-caches needs a writable /proc/sys/vm/drop_caches (root)", file=sys.stderr)
        return 2
    base = args.workdir or os.environ.get("BENCH_TMP") or tempfile.gettempdir()
    caches = ["warm", "cold"] if args.cache == "both" else [args.cache]
    if "cold" in caches and is_tmpfs(base):
        print(f"{base} is on a memory file system: its pages cannot be evicted, so no run there is "
              "cold. Use --cache warm, or --workdir on a disk.", file=sys.stderr)
        return 2
    workdir = tempfile.mkdtemp(prefix="memtree-bench-", dir=base)  # removed at the end unless --keep
    size = args.size_gib if args.size_gib is not None else (2.0 if args.workload == "gpu" else 1.0)
    cfg: dict[str, Any] = {"quick": args.quick, "size_gib": size, "workdir": workdir, "device": args.device,
                           "settings": asdict(settings), "caches": caches, "systems": args.systems}
    chosen = ALL if args.workload == "all" else [args.workload]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"# memtree benchmarks {date}, {platform.node()}, {os.cpu_count()} CPUs, load average "
          f"{load_start:.2f}; {settings.rounds} rounds after {settings.warmup} warm-up; files in {workdir}",
          flush=True)
    rows: list[Row] = []
    inline = args.inline or args.quick
    try:
        for name in chosen:
            t0 = time.perf_counter()
            print(f"\n## {name.upper()}: {workload(name).describe(cfg)}", flush=True)
            got = measure(name, cfg) if inline else _in_subprocess(name, cfg)
            print(f"\n{table(got)}\n\n({name} took {time.perf_counter() - t0:.0f} s)", flush=True)
            rows += got
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    info = {
        "date": date,
        "command": "python benchmarks/run.py " + " ".join(argv),
        "commit": _commit(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "versions": _versions(),
        "quick": args.quick,
        "rounds": settings.rounds,
        "warmup": settings.warmup,
        "drop_caches": settings.drop_all,
        "load_start": load_start,
        "load_end": os.getloadavg()[0],
        "workdir_tmpfs": is_tmpfs(base),
    }
    run = Run(info, rows)
    if args.json:
        save_run(run, args.json)
    if args.store:
        stamp = date.replace(":", "").replace("-", "")
        save_run(run, os.path.join(STORE, f"{stamp}-{'-'.join(chosen)}.json"))
    failed = [r for r in rows if r.error is not None and not r.error.startswith("N/A")
              and (r.limit or r.system.startswith("memtree") or r.system == "*")]
    for r in rows:
        if r.error is not None and not r.error.startswith("N/A") and r not in failed:
            print(f"note: {r.workload} {r.op} {r.cache} {r.system}: {r.error}", file=sys.stderr)
    for r in failed:
        print(f"FAILED: {r.workload} {r.op} {r.cache} {r.system}: {r.error}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
