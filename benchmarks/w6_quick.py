"""W6 back to back in one process: iterate on ``load_into_module`` in seconds, warm or cold.

``run.py w6`` is the benchmark (interleaved rounds, a fresh process per measurement, memory
sampled, every load checked); this script is the workbench beside it. It writes W6's checkpoint
once (the same model, AdamW state and files, kept in ``--workdir`` between runs), builds the
live container once, then times the chosen systems warm (files read first) or ``--cold``
(evicted and checked with ``mincore`` first), interleaved, each load checked bit-exact after it
(untimed) with the tensors zeroed before it. Prints per-system medians and the speed relative to
the floor; ``--profile SYSTEM``: a ``cProfile`` of one more load; ``--overhead N``: memtree's
fixed cost (the same structure with tiny tensors, ``N`` loads).

Run::

    PYTHONPATH=. .venv/bin/python benchmarks/w6_quick.py --size-gib 0.3 --repeat 5 \\
        --systems floor,"memtree (safetensors file)","memtree (torch file)",safetensors
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import expect_digests  # noqa: E402
from pagecache import make_cold, make_warm  # noqa: E402
from w6_resume import SYSTEMS, checkpoint, files_of, live_container, loads, overhead  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=0.3)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("BENCH_TMP", "/tmp"), "w6-quick"))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from: " + ", ".join(SYSTEMS))
    ap.add_argument("--cold", action="store_true", help="evict the files before each load")
    ap.add_argument("--profile", help="a system to profile (one more load, cProfile, top 25 by cumulative time)")
    ap.add_argument("--overhead", type=int, default=0, help="loads of a tree of the same structure, tiny tensors")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {SYSTEMS}")
    wd, info = checkpoint({"quick": False, "size_gib": args.size_gib, "workdir": args.workdir})
    box = live_container(info["dims"])
    run = loads(box, wd)
    import memtree.nn.loading  # noqa: F401  (imports untimed)

    times: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(args.repeat):
        for system in systems:
            if args.cold and make_cold(files_of(system, wd)):
                print(f"warning: {system}'s files are still cached after eviction: not a cold load")
            elif not args.cold:
                make_warm(files_of(system, wd))
            with torch.no_grad():
                for t in box.state_dict().values():
                    t.zero_()
            t0 = time.perf_counter()
            run[system]()
            times[system].append(time.perf_counter() - t0)
            expect_digests(box.state_dict(), info["digests"], system)
    floor = statistics.median(times["floor"]) if "floor" in times else None
    print(f"{info['tensors']} tensors, {info['nbytes'] / (1 << 30):.2f} GiB, {'cold' if args.cold else 'warm'}, "
          f"{args.repeat} rounds; load {os.getloadavg()[0]:.1f}")
    for system in systems:
        med = statistics.median(times[system])
        rel = f"  {floor / med:.1%} of the floor's speed" if floor else ""
        print(f"  {system:28} median {med:.4f} s  (min {min(times[system]):.4f}){rel}  "
              f"{' '.join(f'{t:.4f}' for t in times[system])}")
    if args.overhead:
        print(overhead(wd, info["dims"], args.overhead))
    if args.profile:
        make_warm(files_of(args.profile, wd))
        prof = cProfile.Profile()
        prof.enable()
        run[args.profile]()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
