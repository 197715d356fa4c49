"""What checksums (on by default, format version 2) add to W1's save, side by side in one run.

W1's tree (``benchmarks/stores.py``: 195 float32 tensors of a 16-block transformer,
1,000.7 MiB, here of random data) is
saved with ``memmap(num_threads=THREADS)`` over itself, with each ``checksum=`` setting in turn
(``None``, ``"xxh3"``, ``"crc32c"``, ``"crc32"``; rounds interleaved so that page-cache writeback
and the machine's load hit every setting alike; the process's CPU time too, which other processes
do not inflate), alternating with each algorithm hashing the same bytes alone (no write, the
same number of threads: the floor a one-pass checksum adds to the write alone, ``checksum=None``),
then once more incrementally
(``WriteOptions(link_from=previous)`` with 5% of the bytes changed). Prints the median of the
rounds after the first, and each setting's cost relative to ``checksum=None``: wall time (the
targets' measure; three decimals, unrounded), then CPU time. The targets themselves are judged
from ``run.py w1`` (``memtree t2 xxh3`` / ``crc32`` against ``memtree t2 no checksum``, every
save read back and checked); this script is the diagnosis beside it.

Usage, from a checkout:

    PYTHONPATH=. .venv/bin/python benchmarks/checksum_cost.py DEST_DIR [ROUNDS] [THREADS]
"""

from __future__ import annotations

import os
import resource
import subprocess
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import memtree
from memtree.store.primitives.checksums import available_checksums, tensor_checksum
from memtree.store.reading.options import WriteOptions
from memtree.store.writing.write import WriteStats, wait_for_removals, write_tree

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stores import w1_layout  # noqa: E402


def w1_tree() -> memtree.TensorTree:
    """W1 (``benchmarks/stores.py``, full size): 195 float32 tensors, random data."""
    g = torch.Generator().manual_seed(0)
    tree = memtree.TensorTree({})
    for key, shape, dtype in w1_layout({"quick": False, "size_gib": 1}):
        tree[key] = torch.randn(shape, generator=g, dtype=dtype)
    return tree


def _cpu() -> float:
    """CPU seconds of this process, all threads (user + system): what a save costs, whatever the
    other processes of a busy machine take meanwhile."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _load() -> str:
    """``uptime``'s load averages, and the other processes using a CPU now (runs that overlap)."""
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    ps = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    busy = [line.strip()[:100] for line in ps.splitlines()[1:6] if str(os.getpid()) != line.split()[0]
            and float(line.split()[1]) >= 20]
    return f"load average {load}; busy: {busy or 'none'}"


def _hash_alone(pool: ThreadPoolExecutor, leaves: list[torch.Tensor], algo: str) -> None:
    """Every leaf hashed as the writer threads hash it, without writing: the checksum's floor."""
    list(pool.map(lambda t: tensor_checksum(t, algo), leaves))


def main() -> None:
    dest = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    tree = w1_tree()
    nbytes = sum(t.nbytes for t in tree.values(include_nested=True, leaves_only=True))
    settings = [None] + [a for a in ("xxh3", "crc32c", "crc32") if a in available_checksums()]
    times: dict[str | None, list[float]] = {s: [] for s in settings}
    cpu: dict[str | None, list[float]] = {s: [] for s in settings}
    alone: dict[str, list[tuple[float, float]]] = {s: [] for s in settings[1:]}
    leaves = [t for t in tree.values(include_nested=True, leaves_only=True)]
    pool = ThreadPoolExecutor(threads)
    os.makedirs(dest, exist_ok=True)
    print(f"start: {_load()}", flush=True)
    for _ in range(rounds):
        for s in settings:
            wait_for_removals()
            c0, t0 = _cpu(), time.perf_counter()
            tree.memmap(os.path.join(dest, "w1"), num_threads=threads, checksum=s)
            times[s].append(time.perf_counter() - t0)
            cpu[s].append(_cpu() - c0)
            if s is not None:
                wait_for_removals()  # the old copy this save replaced: deleted before, not during
                c0, t0 = _cpu(), time.perf_counter()
                _hash_alone(pool, leaves, s)
                alone[s].append((time.perf_counter() - t0, _cpu() - c0))
    wait_for_removals()
    print(f"after the saves: {_load()}", flush=True)
    base, low = statistics.median(times[None][1:]), min(times[None][1:])
    print(f"W1 save, {nbytes / 2**20:,.1f} MiB, num_threads={threads}, rounds 2-{rounds}: median, min")
    for s in settings:
        med, best = statistics.median(times[s][1:]), min(times[s][1:])
        runs = " ".join(f"{1000 * t:.0f}" for t in times[s])
        c = statistics.median(cpu[s][1:])
        print(
            f"  checksum={s!s:7} wall median {1000 * med:7.1f} ms {med / base:6.3f}x   min {1000 * best:7.1f} ms "
            f"{best / low:6.3f}x   (CPU {1000 * c:7.1f} ms {c / statistics.median(cpu[None][1:]):6.3f}x)   runs {runs}"
        )
    none_cpu = statistics.median(cpu[None][1:])
    for s in settings[1:]:  # the floor, measured in the same rounds: the write alone + the hash alone
        wall = statistics.median(t for t, _ in alone[s][1:])
        c = statistics.median(c for _, c in alone[s][1:])
        print(
            f"  hashing alone, {threads} threads: {s:7} median {1000 * wall:7.1f} ms "
            f"({nbytes / wall / 1e9:.1f} GB/s) = {wall / base:.3f} of the write alone; CPU {1000 * c:7.1f} ms "
            f"= {c / none_cpu:.3f}; write alone + hash alone: wall {(base + wall) / base:.3f}x, "
            f"CPU {(none_cpu + c) / none_cpu:.3f}x"
        )

    # incremental: 5% of the bytes change between two checkpoints
    level = tree.clone()  # the next checkpoint: the first leaves changed, 5% of the bytes
    changed = 0
    for key in level.keys(include_nested=True, leaves_only=True):
        if changed + level[key].nbytes <= 0.05 * nbytes:
            level[key] = level[key] + 1
            changed += level[key].nbytes
    algo = settings[1] if len(settings) > 1 else "crc32"
    prev, nxt = os.path.join(dest, "prev"), os.path.join(dest, "next")
    write_tree(prev, tree, WriteOptions.of(num_threads=threads, checksum=algo))
    runs: dict[str, list[tuple[float, float]]] = {"full": [], "link_verify=True": [], "link_verify=False": []}
    stats = WriteStats()
    for _ in range(rounds):
        for name in runs:
            wait_for_removals()
            opts = {} if name == "full" else {"link_from": prev, "link_verify": name.endswith("True")}
            stats = WriteStats()
            c0, t0 = _cpu(), time.perf_counter()
            write_tree(nxt, level, WriteOptions.of(num_threads=threads, checksum=algo, **opts), stats=stats)
            runs[name].append((time.perf_counter() - t0, _cpu() - c0))
    wait_for_removals()
    full = statistics.median(t for t, _ in runs["full"][1:])
    full_cpu = statistics.median(c for _, c in runs["full"][1:])
    print(
        f"next checkpoint, {changed / nbytes:.1%} of the bytes changed ({algo}): written "
        f"{stats.bytes_written / 2**20:.1f} MiB, linked {stats.bytes_linked / 2**20:.1f} MiB "
        f"({stats.bytes_written / nbytes:.1%} of a full save)"
    )
    for name, got in runs.items():
        wall = statistics.median(t for t, _ in got[1:])
        c = statistics.median(c for _, c in got[1:])
        print(
            f"  {'full save' if name == 'full' else 'link_from, ' + name:26} median {1000 * wall:7.1f} ms "
            f"{wall / full:5.2f}x   CPU {1000 * c:7.1f} ms {c / full_cpu:5.2f}x"
        )
    print(f"end: {_load()}")
    shutil.rmtree(dest, ignore_errors=True)


if __name__ == "__main__":
    main()
