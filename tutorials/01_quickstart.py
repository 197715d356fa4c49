"""Tutorial 1 — quickstart: a nested tree of tensors, written to disk and mapped back.

Run it:  python tutorials/01_quickstart.py            (MEMTREE_TUTORIAL_FAST=1 for a small run)

What you will see:
1. a TensorTree built from nested dicts, and how it prints;
2. ``memmap``: one raw ``.memmap`` file per leaf and one ``meta.json`` per level;
3. ``load_memmap``: the files are mapped, not read; ``keys=`` loads only part of the tree;
4. writes through a memory-mapped tree land in the files;
5. ``memmap_like``: a dataset preallocated on disk without writing its bytes (sparse files);
6. ``memtree info``: inspecting a directory from the shell.
Every tutorial ends with a line starting with "OK" (the test suite checks it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import torch

import memtree

FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
N_ITEMS = 1_000 if FAST else 1_000_000  # dataset size in step 5

workdir = tempfile.mkdtemp(prefix="memtree-quickstart-")
print(f"working in {workdir}\n")

# 1. A tree: nested str keys -> tensors, sub-trees and small non-tensor values.
torch.manual_seed(0)
tree = memtree.TensorTree(
    {
        "encoder": {"weight": torch.randn(256, 128), "bias": torch.zeros(256)},
        "head": {"weight": torch.randn(10, 256)},
        "step": torch.tensor(1200),
        "run_name": "quickstart",  # kept as JSON in meta.json
    }
)
print("1. the tree:")
print(tree)
print()

# 2. Write it: atomic (staging directory + rename), leaves written by 4 threads.
ckpt = os.path.join(workdir, "ckpt")
tree.memmap(ckpt, num_threads=4)
print(f"2. files written under {ckpt}:")
for root, _, files in sorted(os.walk(ckpt)):
    for name in sorted(files):
        path = os.path.join(root, name)
        print(f"   {os.path.relpath(path, ckpt):24s} {os.path.getsize(path):>8,} bytes")
print()

# 3. Load it back: leaves are MemoryMappedTensors over the files (no data read yet).
loaded = memtree.load_memmap(ckpt)
assert (loaded == tree).all(), "the loaded tree differs from the original"
print(f"3. loaded: is_memmap={loaded.is_memmap()}, equal to the original: {(loaded == tree).all()}")
print(f"   encoder.weight lives in {loaded['encoder', 'weight'].filename}")
part = memtree.load_memmap(ckpt, keys=[("head", "weight")], mode="r")  # read-only, one leaf
print(f"   partial load of ('head', 'weight') only: keys {part.keys(include_nested=True)}\n")

# 4. Writes through a memory-mapped tree go to the files (mode="r+" is the default).
loaded["encoder", "bias"][:3] = 7.0
again = memtree.load_memmap(ckpt, mode="r")
print(f"4. after writing through the mapping, a fresh load sees {again['encoder', 'bias'][:4].tolist()}\n")
assert again["encoder", "bias"][:3].eq(7.0).all()

# 5. A dataset preallocated on disk: shapes and dtypes only, no bytes written.
datum = memtree.TensorTree(
    {"image": torch.zeros(3, 32, 32, dtype=torch.uint8), "label": torch.zeros((), dtype=torch.int64)}
)
dataset = datum.expand(N_ITEMS).memmap_like(os.path.join(workdir, "dataset"))
dataset[5] = {"image": torch.full((3, 32, 32), 255, dtype=torch.uint8), "label": torch.tensor(9)}
batch = dataset[torch.tensor([4, 5, 6])]  # indexing a tree indexes every leaf
image_file = dataset["image"].filename
allocated = os.stat(image_file).st_blocks * 512
print(f"5. dataset of {N_ITEMS:,} items: batch_size {list(dataset.batch_size)}, "
      f"labels of items 4..6 = {batch['label'].tolist()}")
print(f"   image file: {os.path.getsize(image_file):,} bytes apparent, {allocated:,} bytes allocated (sparse)\n")

# 6. The command line: what is in a directory, from its meta.json files only.
print("6. $ memtree info ckpt")
info = subprocess.run([sys.executable, "-m", "memtree", "info", ckpt], capture_output=True, text=True)
print(info.stdout)
assert info.returncode == 0, info.stderr

shutil.rmtree(workdir)
print(f"OK quickstart: wrote, loaded and edited {len(tree.keys(include_nested=True, leaves_only=True))} "
      f"leaves and preallocated {N_ITEMS:,} items")
