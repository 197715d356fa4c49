"""Back-to-back save timing of one memtree checkout (run it alternately against two checkouts).

A W1-shaped tree (195 float32 tensors, 1.0 GiB) is written over itself six times with
``memmap(num_threads=N)``; prints the median of runs 2-6. Usage, from a checkout:

    PYTHONPATH=. .venv/bin/python benchmarks/ab_save.py LABEL DEST_DIR THREADS

Run it in alternating processes for the two checkouts being compared (RESULTS.md, "Layout
refactor"): page-cache writeback on a small VM swings single save timings by 2x and more.
"""

import statistics
import sys
import time

import torch, memtree
try:  # the layouts of the checkouts compared: store/ in rooms, store/ flat, before store/
    from memtree.store.writing.write import wait_for_removals
except ImportError:
    try:
        from memtree.store.write import wait_for_removals
    except ImportError:
        from memtree.write import wait_for_removals
torch.manual_seed(0)
# W1-like: 195 float32 tensors, ~1 GiB
shapes = [(1088, 1088)] * 64 + [(1088, 4352)] * 64 + [(4352, 1088)] * 32 + [(1088,)] * 34 + [(32000, 1088)]
tree = memtree.TensorTree({f"t{i}": torch.ones(s) for i, s in enumerate(shapes)})
d = sys.argv[2]
threads = int(sys.argv[3])
times = []
for i in range(6):
    t0 = time.perf_counter()
    tree.memmap(d, num_threads=threads)
    times.append(time.perf_counter() - t0)
    wait_for_removals()
print(sys.argv[1], threads, "median ms %.1f" % (1000 * statistics.median(times[1:])), "runs", " ".join("%.0f" % (1000 * t) for t in times))
