"""What checksums (on by default, format version 2) add to W1's save, side by side in one run.

A W1-shaped tree (195 float32 tensors of a 16-block transformer, 1,000.7 MiB of random data) is
saved with ``memmap(num_threads=THREADS)`` over itself, with each ``checksum=`` setting in turn
(``None``, ``"xxh3"``, ``"crc32c"``, ``"crc32"``; rounds interleaved so that page-cache writeback
and the machine's load hit every setting alike), then once more incrementally
(``WriteOptions(link_from=previous)`` with 5% of the bytes changed). Prints the median of the
rounds after the first, and each setting's cost relative to ``checksum=None``.

Usage, from a checkout:

    PYTHONPATH=. .venv/bin/python benchmarks/checksum_cost.py DEST_DIR [ROUNDS] [THREADS]
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

import torch

import memtree
import memtree.format.level
from memtree.store.files import available_checksums
from memtree.store.options import WriteOptions
from memtree.store.write import WriteStats, wait_for_removals, write_tree

SHAPES = [(1088, 1088)] * 64 + [(1088, 4352)] * 64 + [(4352, 1088)] * 32 + [(1088,)] * 34 + [(32000, 1088)]


def main() -> None:
    dest = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    g = torch.Generator().manual_seed(0)
    tree = memtree.TensorTree({f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)})
    nbytes = sum(t.nbytes for t in tree.values())
    settings = [None] + [a for a in ("xxh3", "crc32c", "crc32") if a in available_checksums()]
    times: dict[str | None, list[float]] = {s: [] for s in settings}
    os.makedirs(dest, exist_ok=True)
    for _ in range(rounds):
        for s in settings:
            t0 = time.perf_counter()
            tree.memmap(os.path.join(dest, "w1"), num_threads=threads, checksum=s)
            times[s].append(time.perf_counter() - t0)
            wait_for_removals()
    base = statistics.median(times[None][1:])
    print(f"W1 save, {nbytes / 2**20:,.1f} MiB, num_threads={threads}, median of rounds 2-{rounds}:")
    for s in settings:
        med = statistics.median(times[s][1:])
        runs = " ".join(f"{1000 * t:.0f}" for t in times[s])
        print(f"  checksum={s!s:7} {1000 * med:7.1f} ms  {med / base:5.2f}x   runs {runs}")

    # incremental: 5% of the bytes change between two checkpoints
    level = memtree.format.level.as_level(tree)
    changed = 0
    for key in sorted(level.entries, key=lambda k: int(k[1:])):
        if changed >= 0.05 * nbytes:
            break
        level.entries[key] = level.entries[key] + 1
        changed += level.entries[key].nbytes
    algo = settings[1] if len(settings) > 1 else "crc32"
    full, incr = [], []
    for r in range(rounds):
        shutil.rmtree(os.path.join(dest, "prev"), ignore_errors=True)
        t0 = time.perf_counter()
        write_tree(os.path.join(dest, "prev"), tree, WriteOptions.of(num_threads=threads, checksum=algo))
        full.append(time.perf_counter() - t0)
        stats = WriteStats()
        t0 = time.perf_counter()
        write_tree(
            os.path.join(dest, "next"), level,
            WriteOptions.of(num_threads=threads, checksum=algo, link_from=os.path.join(dest, "prev")), stats=stats,
        )
        incr.append(time.perf_counter() - t0)
        wait_for_removals()
    f, i = statistics.median(full[1:]), statistics.median(incr[1:])
    print(
        f"incremental ({algo}, link_from, {changed / nbytes:.1%} of the bytes changed): {1000 * i:.1f} ms "
        f"vs full {1000 * f:.1f} ms ({i / f:.2f}x); written {stats.bytes_written / 2**20:.1f} MiB, "
        f"linked {stats.bytes_linked / 2**20:.1f} MiB ({stats.bytes_written / nbytes:.1%} of a full save)"
    )
    shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    main()
