"""What ``verify=True`` (the default of ``Checkpointer.restore``) costs, side by side in one run.

A ~500 MB training state (``TENSORS`` float32 tensors of random data under ``"model"``, an
optimizer-like ``"optim"`` of the same size would double it: left out) is saved twice in one
root: step 1 with the default checksum (``xxh3`` where ``xxhash`` is installed) and step 2 with
``crc32``. Each is then restored with ``verify=True`` and ``verify=False``, rounds interleaved
so that the machine's load hits every setting alike, from the page cache (the steps were just
written: this measures what verifying adds, not the disk), two ways: each restore in a fresh
process (what resuming a run does: the memory the state is read into is new), and repeated in
one process (the rounds after the first: memory reused). Prints the median wall and process CPU
time of each, and the cost of verifying relative to not verifying.

Usage, from a checkout:

    PYTHONPATH=. .venv/bin/python benchmarks/restore_verify.py DEST_DIR [ROUNDS] [MIB]
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time

import torch

import memtree
from memtree.store.primitives.checksums import default_checksum
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import write_tree
from memtree.training.state import state_to_level

TENSORS = 125


def _one(dest: str, step: int, verify: bool) -> None:
    """In a fresh process: time one restore, print ``wall cpu``."""
    ckpt = memtree.Checkpointer(dest)
    wall, cpu = time.perf_counter(), time.process_time()
    ckpt.restore(step, verify=verify)
    print(time.perf_counter() - wall, time.process_time() - cpu)


def _fresh(dest: str, step: int, verify: bool) -> tuple[float, float]:
    out = subprocess.run([sys.executable, __file__, "--one", dest, str(step), str(int(verify))],
                         check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def _report(label: str, nbytes: int, algorithms: dict[int, str], times: dict[tuple[int, bool], list[tuple[float, float]]]) -> None:
    print(label)
    for step, algorithm in algorithms.items():
        med = {v: tuple(statistics.median(x[i] for x in times[(step, v)]) for i in (0, 1)) for v in (True, False)}
        (wall_v, cpu_v), (wall_n, cpu_n) = med[True], med[False]
        print(f"  {algorithm:>6}: verify=False {wall_n:.3f} s ({nbytes / wall_n / 1e9:.2f} GB/s), "
              f"verify=True {wall_v:.3f} s ({nbytes / wall_v / 1e9:.2f} GB/s): +{(wall_v / wall_n - 1) * 100:.0f}% "
              f"wall; CPU {cpu_n:.3f} s -> {cpu_v:.3f} s")


def main() -> None:
    if sys.argv[1] == "--one":
        return _one(sys.argv[2], int(sys.argv[3]), bool(int(sys.argv[4])))
    dest = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    mib = int(sys.argv[3]) if len(sys.argv) > 3 else 500
    shutil.rmtree(dest, ignore_errors=True)
    gen = torch.Generator().manual_seed(0)
    per = mib * (1 << 20) // 4 // TENSORS
    state = {"model": {f"layer{i}.weight": torch.randn(per, generator=gen) for i in range(TENSORS)}, "step": 1}
    nbytes = sum(t.nbytes for t in state["model"].values())
    algorithms = {1: default_checksum(), 2: "crc32"}
    for step, algorithm in algorithms.items():
        write_tree(os.path.join(dest, str(step)), state_to_level(state), WriteOptions.of(checksum=algorithm))
    ckpt = memtree.Checkpointer(dest)
    keys = [(s, v) for s in algorithms for v in (True, False)]
    fresh: dict[tuple[int, bool], list[tuple[float, float]]] = {k: [] for k in keys}
    warm: dict[tuple[int, bool], list[tuple[float, float]]] = {k: [] for k in keys}
    for _ in range(rounds):
        for step, verify in keys:
            fresh[(step, verify)].append(_fresh(dest, step, verify))
    for r in range(rounds + 1):
        for step, verify in keys:
            wall, cpu = time.perf_counter(), time.process_time()
            restored = ckpt.restore(step, verify=verify)
            if r:  # the first round allocates the memory the next ones reuse
                warm[(step, verify)].append((time.perf_counter() - wall, time.process_time() - cpu))
            del restored
    load = os.getloadavg()
    print(f"restore of a {nbytes / 1e6:.0f} MB state ({TENSORS} tensors), page cache warm, "
          f"{os.cpu_count()} CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}, medians of {rounds} rounds")
    _report("each restore in a fresh process (resuming a run):", nbytes, algorithms, fresh)
    _report("repeated in one process (memory reused):", nbytes, algorithms, warm)
    shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    main()
