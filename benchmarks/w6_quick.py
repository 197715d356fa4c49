"""W6 back to back in one process: iterate on ``load_into_module`` in seconds, warm or cold.

``w6_resume.py`` is the benchmark (a fresh process per measurement, cold and warm, memory
sampled); this script is the workbench beside it. It writes W6's checkpoint once (the same
model, AdamW state and files, kept in ``--workdir`` between runs), builds the live container
once, then times the chosen systems warm (files read first) or ``--cold`` (evicted from the
page cache first, as ``w6_resume.py`` does), interleaved (``floor``, A, B, ... repeated
``--repeat`` times), each load checked bit-exact (untimed). Prints per-system medians and the
speed relative to the floor, and with ``--profile SYSTEM`` a ``cProfile`` of one more load.

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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import evict  # noqa: E402
from w6_resume import SYSTEMS, crcs, files_of, layers_for, live_container, loads, prepare, warm_up  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=0.3)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--workdir", default=os.path.join(os.environ.get("BENCH_TMP", "/tmp"), "w6-quick"))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, from: " + ", ".join(SYSTEMS))
    ap.add_argument("--cold", action="store_true", help="evict the files before each load")
    ap.add_argument("--profile", help="a system to profile (one more load, cProfile, top 25 by cumulative time)")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; choose from {SYSTEMS}")
    layers = layers_for(args.size_gib)
    wd = os.path.join(args.workdir, f"{layers}-layers")
    if not os.path.isfile(os.path.join(wd, "expected.json")):
        os.makedirs(wd, exist_ok=True)
        prepare(wd, layers)
    import json

    with open(os.path.join(wd, "expected.json")) as f:
        info = json.load(f)
    box = live_container(layers)
    run = loads(box, wd)
    import memtree.nn.loading  # noqa: F401  (imports untimed)

    times: dict[str, list[float]] = {s: [] for s in systems}
    for _ in range(args.repeat):
        for system in systems:
            if args.cold:
                evict(files_of(system, wd), "fadvise")
            else:
                warm_up(files_of(system, wd))
            with torch.no_grad():
                for t in box.state_dict().values():
                    t.zero_()
            t0 = time.perf_counter()
            run[system]()  # type: ignore[operator]
            times[system].append(time.perf_counter() - t0)
            if crcs(box) != info["crc"]:
                raise SystemExit(f"{system}: wrong bytes")
    floor = statistics.median(times["floor"]) if "floor" in times else None
    print(f"{info['tensors']} tensors, {info['nbytes'] / (1 << 30):.2f} GiB, {'cold' if args.cold else 'warm'}, {args.repeat} rounds; load {os.getloadavg()[0]:.1f}")
    for system in systems:
        med = statistics.median(times[system])
        rel = f"  {floor / med:.0%} of the floor's speed" if floor else ""
        print(f"  {system:28} median {med:.3f} s  (min {min(times[system]):.3f}){rel}  "
              f"{' '.join(f'{t:.3f}' for t in times[system])}")
    if args.profile:
        warm_up(files_of(args.profile, wd))
        prof = cProfile.Profile()
        prof.enable()
        run[args.profile]()  # type: ignore[operator]
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
