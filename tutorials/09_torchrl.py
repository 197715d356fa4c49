"""Tutorial 9 — torchrl replay buffers on memtree: MemtreeStorage and its checkpointer.

Run it:  python tutorials/09_torchrl.py   (MEMTREE_TUTORIAL_FAST=1 for a small run)

What you will see:
1. ``ReplayBuffer(storage=MemtreeStorage(capacity, path))``: extend and sample as with any
   torchrl storage; the data is a memtree tree that grows with the rows written, and
   ``memtree.load_memmap(path)`` (from any process) returns exactly those rows;
2. two worker processes fill one buffer by index at once;
3. ``rb.dumps(path)`` writes the storage as one atomic, checksummed memtree tree of the valid
   rows (the next dump hard-links what did not change); ``rb.loads`` restores it, checked;
4. a dump of torchrl's own ``LazyMemmapStorage`` read with ``memtree.load_memmap``: only the
   rows torchrl wrote, not its whole capacity.
The last line starts with "OK" (the test suite checks it).
"""

from __future__ import annotations

# --8<-- [start:setup]
import atexit
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile

import torch

try:
    import torchrl  # noqa: F401
except ImportError:
    print("OK torchrl: skipped, the torchrl package is not installed")
    sys.exit(0)

logging.getLogger("torchrl").setLevel(logging.ERROR)
FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
CAPACITY = 1_000 if FAST else 100_000
work = tempfile.mkdtemp(prefix="memtree-tutorial-09-")
atexit.register(shutil.rmtree, work, ignore_errors=True)
# --8<-- [end:setup]

# --8<-- [start:buffer]
from tensordict import TensorDict
from torchrl.data import LazyMemmapStorage, ReplayBuffer

import memtree
from memtree.integrations.torchrl import MemtreeStorage


def transitions(n: int, start: int = 0) -> TensorDict:
    obs = torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, 4)
    return TensorDict({"obs": obs, "action": torch.arange(start, start + n) % 3,
                       ("next", "reward"): torch.ones(n)}, batch_size=[n])


rb = ReplayBuffer(storage=MemtreeStorage(CAPACITY, os.path.join(work, "buffer")), batch_size=32)
for i in range(5):
    rb.extend(transitions(100, 100 * i))
print(len(rb), rb.sample()["obs"].shape)
print(memtree.load_memmap(os.path.join(work, "buffer")).batch_size)   # the rows written
# --8<-- [end:buffer]
assert len(rb) == 500 and memtree.load_memmap(os.path.join(work, "buffer")).batch_size == torch.Size([500])
print("1. a growing memtree tree holds the buffer: 500 rows on disk, no more")


# --8<-- [start:workers]
def fill(storage: MemtreeStorage, first: int) -> None:
    for start in range(first, 1000, 200):           # rows 0-99, 200-299... or 100-199, 300-399...
        storage.set(torch.arange(start, start + 100), transitions(100, start), set_cursor=False)


shared = MemtreeStorage(CAPACITY, os.path.join(work, "shared"))
shared.set(torch.arange(10), transitions(10), set_cursor=False)      # creates the tree
workers = [mp.get_context("fork").Process(target=fill, args=(shared, first)) for first in (0, 100)]
for w in workers:
    w.start()
for w in workers:
    w.join()
filled = memtree.load_memmap(os.path.join(work, "shared"))
print(filled.batch_size, filled["obs"][::100, 0].tolist())
# --8<-- [end:workers]
assert all(w.exitcode == 0 for w in workers)
assert torch.equal(filled["obs"][:, 0], torch.arange(1000, dtype=torch.float32))
print("2. two processes filled one buffer by index while it grew")

# --8<-- [start:dump]
rb.dumps(os.path.join(work, "dump"))
print(memtree.verify_tree(os.path.join(work, "dump", "storage")).ok)
again = ReplayBuffer(storage=MemtreeStorage(CAPACITY, os.path.join(work, "restored")), batch_size=32)
again.loads(os.path.join(work, "dump"))
assert len(again) == 500 and torch.equal(again.storage.get(slice(0, 500))["obs"], rb.storage.get(slice(0, 500))["obs"])
# --8<-- [end:dump]
print("3. dumps: one checksummed memtree tree of the valid rows; loads restores it")

# --8<-- [start:lazy]
theirs = ReplayBuffer(storage=LazyMemmapStorage(CAPACITY))
theirs.extend(transitions(300))
theirs.dumps(os.path.join(work, "torchrl-dump"))
rows = memtree.load_memmap(os.path.join(work, "torchrl-dump", "storage"))
print(rows.batch_size)     # the 300 rows written, not the capacity
# --8<-- [end:lazy]
assert rows.batch_size == torch.Size([300])
print("4. torchrl's own dump, read by memtree: its valid rows only")
print("OK torchrl: MemtreeStorage grows, fills from processes, dumps atomically; valid rows of torchrl dumps")
