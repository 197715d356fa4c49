"""memtree benchmark suite: every system of a workload in one run, ratios to the raw limit.

Usage (from the repository root):

    .venv/bin/python benchmarks/run.py w1 --size-gib 1      # one workload
    .venv/bin/python benchmarks/run.py all                 # W1..W5, full size
    .venv/bin/python benchmarks/run.py all --quick         # tiny sizes: a smoke test (seconds)

Each system is measured in a fresh subprocess (``--inline`` measures in this process; the
default with ``--quick``). Times are medians of ``--repeat`` runs after ``--warmup`` runs.
Cold-cache rows evict the files read with ``--cold fadvise`` (default; no privileges needed)
or ``--cold global`` (``/proc/sys/vm/drop_caches``, root only, disturbs other processes);
``--cold none`` measures warm only. See harness.py for how RSS is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from harness import Result, Settings, can_drop_global, emit, run_worker, table  # noqa: E402

WORKLOADS = ["w1", "w2", "w3", "w4", "w5"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("workload", choices=WORKLOADS + ["all"])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 run, inline: a smoke test")
    p.add_argument("--size-gib", type=float, default=1.0, help="W1/W5 data size (default 1)")
    p.add_argument("--repeat", type=int, default=None, help="timed runs (default 3; quick 1)")
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed runs first (default 1; quick 0)"
    )
    p.add_argument("--cold", choices=["fadvise", "global", "none"], default="fadvise")
    p.add_argument("--inline", action="store_true", help="measure in this process")
    p.add_argument("--isolate", action="store_true", help="one subprocess per system (default)")
    p.add_argument("--systems", default="", help="comma-separated substrings: only these rows")
    p.add_argument("--workdir", default=None, help="where files go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", default=None, help="also write all rows to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_worker":  # internal: one system in a fresh process
        import workloads

        emit(workloads.run_system(argv[1], argv[2], json.loads(argv[3])))
        return 0
    args = _parser().parse_args(argv)
    if args.cold == "global" and not can_drop_global():
        print(
            "--cold global needs a writable /proc/sys/vm/drop_caches (root); use fadvise",
            file=sys.stderr,
        )
        return 2
    import workloads

    settings = Settings(
        repeat=args.repeat if args.repeat is not None else (1 if args.quick else 3),
        warmup=args.warmup if args.warmup is not None else (0 if args.quick else 1),
        cold=args.cold,
        quick=args.quick,
    )
    inline = args.inline or (args.quick and not args.isolate)
    workdir = args.workdir or tempfile.mkdtemp(
        prefix="memtree-bench-", dir=os.environ.get("BENCH_TMP")
    )
    cfg: dict[str, Any] = {
        "quick": args.quick,
        "size_gib": args.size_gib,
        "workdir": workdir,
        "settings": asdict(settings),
    }
    print(_header(settings, inline, workdir))
    reg = workloads.registry()
    all_rows: list[Result] = []
    chosen = WORKLOADS if args.workload == "all" else [args.workload]
    wanted = [w for w in args.systems.split(",") if w]
    try:
        for name in chosen:
            wl = reg[name]
            t0 = time.perf_counter()
            print(f"\n## {name.upper()}: {wl.prepare(cfg)}\n", flush=True)
            rows: list[Result] = []
            for system in wl.systems(cfg):
                if wanted and not any(w in system for w in wanted):
                    continue
                rows += run_worker(name, system, cfg, inline)
            print(table(rows, wl.limit_of))
            print(f"\n({name} took {time.perf_counter() - t0:.0f} s)", flush=True)
            all_rows += rows
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    import targets

    print("\n## Targets of the issue\n\n" + targets.markdown([asdict(r) for r in all_rows]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in all_rows], f, indent=1)
    failed = [r for r in all_rows if r.note.startswith("FAILED")]
    return 1 if failed else 0


def _header(settings: Settings, inline: bool, workdir: str) -> str:
    import torch

    cold = {
        "fadvise": "fadvise(DONTNEED) of the files read",
        "global": "drop_caches",
        "none": "off",
    }
    return (
        f"# memtree benchmarks  ({time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, torch {torch.__version__})\n"
        f"median of {settings.repeat} run(s) after {settings.warmup} warm-up; cold cache: "
        f"{cold[settings.cold]}; drop_caches writable: {can_drop_global()}; "
        f"{'in this process' if inline else 'one subprocess per system'}; files in {workdir}"
    )


if __name__ == "__main__":
    sys.exit(main())
