"""Tutorial 3: datasets and replay buffers on disk, read by DataLoader workers.

Part 1 builds a preallocated image dataset: one record type (a ``@memtree.tensorclass``),
``expand(n).memmap_like(dir)`` to create sparse files of the full size in milliseconds, items
written by index as they are produced, then read by ``DataLoader`` workers that map the files
(nothing is copied to them) and fetch each batch with one index operation per leaf.

Part 2 grows a replay buffer with ``append_``/``extend_``: the files grow in place (their
capacity doubles when full, so one item at a time is cheap), each growth is committed
atomically, a reader opened earlier keeps its view, and a learner process samples batches.

Run it:  python tutorials/03_datasets_with_dataloader.py     (MEMTREE_TUTORIAL_FAST=1: small)
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch

import memtree

FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
N_IMAGES = 512 if FAST else 50_000
SIDE = 32 if FAST else 64
N_STEPS = 300 if FAST else 20_000


@memtree.tensorclass(name="tutorial.Image")
class Image:
    """One labelled image; a batch of them is the same class with a batch size."""

    pixels: torch.Tensor  # uint8 (3, SIDE, SIDE)
    label: torch.Tensor  # int64 ()
    index: torch.Tensor  # int64 (): which source image
    source: str = "synthetic"


@memtree.tensorclass(name="tutorial.Transition")
class Transition:
    """One step of an agent: observation, action, reward, and whether the episode ended."""

    obs: torch.Tensor
    action: torch.Tensor
    reward: torch.Tensor
    done: torch.Tensor


def fake_image(i: int) -> Image:
    """Stand-in for decoding image ``i`` from a JPEG: deterministic, so we can check it later."""
    g = torch.Generator().manual_seed(i)
    pixels = torch.randint(0, 256, (3, SIDE, SIDE), dtype=torch.uint8, generator=g)
    return Image(pixels, torch.tensor(i % 10), torch.tensor(i))


def image_dataset(root: str) -> None:
    print(f"== Part 1: a preallocated dataset of {N_IMAGES:,} images of 3x{SIDE}x{SIDE}")
    path = os.path.join(root, "images")
    one = fake_image(0)
    start = time.perf_counter()
    data = one.expand(N_IMAGES).memmap_like(path)  # sparse files: no data written yet
    size = os.path.getsize(os.path.join(path, "pixels.memmap"))
    used = os.stat(os.path.join(path, "pixels.memmap")).st_blocks * 512
    print(f"memmap_like: {size / 2**20:.1f} MiB of pixels allocated in "
          f"{time.perf_counter() - start:.3f} s, {used / 2**20:.1f} MiB on disk so far")
    print(type(data).__name__, data.batch_size, "->", sorted(os.listdir(path)))

    start = time.perf_counter()
    chunk = 64
    for first in range(0, N_IMAGES, chunk):  # e.g. the output of a decoding worker pool
        ids = range(first, min(first + chunk, N_IMAGES))
        data[first : first + len(ids)] = memtree.stack([fake_image(i) for i in ids])
    print(f"filled by index in {time.perf_counter() - start:.2f} s (each write goes to the files)")

    loaded = memtree.load_memmap(path)  # what a training script does: no data read yet
    print("loaded back as", type(loaded).__name__, "- record 7:", loaded[7].label.item(), loaded[7].source)
    loader = memtree.batch_loader(loaded, 128, shuffle=True, num_workers=2)
    start = time.perf_counter()
    seen = torch.zeros(N_IMAGES, dtype=torch.int64)
    for batch in loader:  # each batch: an Image of batch_size [128], read by a worker
        assert type(batch) is Image and batch.source == "synthetic"
        seen[batch.index] += 1
        k = int(batch.index[0])  # check one item per batch against its source
        assert torch.equal(batch.pixels[0], fake_image(k).pixels) and batch.label[0] == k % 10
    elapsed = time.perf_counter() - start
    assert bool((seen == 1).all()), "every image exactly once per epoch"
    print(f"DataLoader, 2 workers, batches of 128: {N_IMAGES / elapsed:,.0f} images/s; every image "
          "seen once, checked items equal their source")


def replay_buffer(root: str) -> None:
    print(f"\n== Part 2: a replay buffer grown to {N_STEPS:,} transitions with append_")
    path = os.path.join(root, "buffer")
    empty = Transition(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                       torch.zeros(0, dtype=torch.bool), batch_size=[0])
    buf = empty.memmap(path)
    early_reader = None
    sizes = []
    start = time.perf_counter()
    for t in range(N_STEPS):
        obs = torch.full((8,), float(t))
        buf.append_(Transition(obs, torch.tensor(t % 4), torch.tensor(t / 10), torch.tensor(t % 50 == 49)))
        size = os.path.getsize(os.path.join(path, "obs.memmap"))
        if not sizes or sizes[-1] != size:
            sizes.append(size)
        if t == 99:
            early_reader = memtree.load_memmap(path, mode="r")  # e.g. an evaluation process
    elapsed = time.perf_counter() - start
    print(f"appended one at a time: {elapsed / N_STEPS * 1e6:.0f} us per transition")
    print("obs.memmap grew", len(sizes), "times:", [s // (8 * 4) for s in sizes][:6], "... rows of capacity")

    last = Transition(torch.full((8,), -1.0), torch.tensor(0), torch.tensor(0.0), torch.tensor(True))
    more = memtree.stack([last] * 5)
    buf.extend_(more)  # several at once: one commit
    with open(os.path.join(path, "meta.json")) as f:
        obs_entry = json.load(f)["entries"][0]
    print(f"after extend_: {len(buf)} transitions; meta.json: obs shape {obs_entry['shape']}, "
          f"capacity {obs_entry['capacity']} rows (the file holds the capacity)")
    assert early_reader is not None and len(early_reader) == 100
    assert torch.equal(early_reader.obs[:, 0], torch.arange(100.0))
    print("a reader opened at 100 transitions still sees exactly those 100")

    learner = memtree.load_memmap(path)  # another process would do this
    loader = memtree.batch_loader(learner, 64, shuffle=True, drop_last=True, num_workers=2)
    total = 0
    for batch in loader:
        real = batch.obs[:, 0] >= 0
        assert torch.equal(batch.reward[real], batch.obs[real, 0] / 10)  # rows are intact
        total += len(batch)
    print(f"learner sampled {total} transitions in batches of 64 from 2 workers")


def main() -> None:
    with tempfile.TemporaryDirectory() as root:
        image_dataset(root)
        replay_buffer(root)
    print("OK: dataset filled by index and read by workers; replay buffer grown with append_")


if __name__ == "__main__":
    main()
