"""Soak test of crash safety and of the loader: the long variant of tests/test_faults.py and
tests/test_fuzz_load.py (which CI runs with small counts).

1. every deterministic fault point of tests/test_faults.py (kill at each step of the commit);
2. ``--trials`` writers killed with SIGKILL at random times (large trees; new and overwrite;
   threaded or not; with and without ``RENAME_EXCHANGE``), each checked: the destination loads
   as the new tree, the old one, or is refused; ``memtree.recover`` then leaves nothing behind;
3. the child-process fuzzer with ``--fuzz-scale`` times its CI examples (0 skips it).

Prints the outcome counts; exit code 0 when every check passed.

Example:
    .venv/bin/python benchmarks/soak_faults.py --trials 500 --fuzz-scale 40
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import test_faults  # noqa: E402  (the test module holds the trial functions)

SCENARIOS = [("new", 0, 0), ("new", 4, 0), ("overwrite", 0, 0), ("overwrite", 4, 0), ("overwrite", 0, 2),
             ("overwrite", 4, 2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=300, help="random kill -9 trials (default 300)")
    parser.add_argument("--fuzz-scale", type=float, default=20.0,
                        help="multiply the fuzzer's CI example counts by this (default 20; 0 skips it)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    with tempfile.TemporaryDirectory(prefix="memtree-soak-") as tmp:
        tmp_path = Path(tmp)
        start = time.perf_counter()
        for i, case in enumerate(test_faults.CASES):
            d = tmp_path / f"point{i}"
            d.mkdir()
            test_faults.test_kill_at_fault_point(d, case)
        print(f"fault points: {len(test_faults.CASES)} cases passed in {time.perf_counter() - start:.1f} s")

        d = tmp_path / "calibrate"
        d.mkdir()
        seconds = max(test_faults._timed_write(d / f"t{i}", test_faults.make_tree(2, "large"), 0, 0) for i in range(3))
        counts: Counter = Counter()
        start = time.perf_counter()
        for i in range(args.trials):
            scenario, threads, no_flag = rng.choice(SCENARIOS)
            parent = tmp_path / f"trial{i}"
            parent.mkdir()
            got, code = test_faults.kill_trial(parent, scenario, threads, no_flag, rng.uniform(0, 1.2 * seconds))
            counts[(scenario, got, "killed" if code == -signal.SIGKILL else "finished")] += 1
        print(f"random kills: {args.trials} trials passed in {time.perf_counter() - start:.1f} s "
              f"(one write takes {seconds * 1e3:.0f} ms here)")
        for key, n in sorted(counts.items()):
            print(f"  {' / '.join(key)}: {n}")

    if args.fuzz_scale > 0:
        env = dict(os.environ, MEMTREE_FUZZ_SCALE=str(args.fuzz_scale))
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--hypothesis-show-statistics",
               str(ROOT / "tests" / "test_fuzz_load.py")]
        print("fuzzer:", " ".join(cmd), f"(MEMTREE_FUZZ_SCALE={args.fuzz_scale})", flush=True)
        return subprocess.run(cmd, env=env, cwd=ROOT).returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
