"""Tutorial 5 — offloaded inference: run a model whose weights stay on disk.

Run it:  python tutorials/05_offloading.py          (MEMTREE_TUTORIAL_FAST=1 for a small run)

What you will see:
1. a model saved with ``TensorTree.from_module(model).memmap(d)``;
2. ``memtree.offload(model, d, device=...)`` on a model built under ``empty_init``: every weight
   becomes an ``OffloadedTensor`` that is read from its file for the one operation that needs
   it and released right after, so the model runs layer by layer: the memory it takes while
   running (device memory on a GPU, resident memory on the CPU) stays a small fraction of its
   size, and the output equals the in-memory model's;
3. offloaded weights compose with the rest of torch: indexing stays on disk, ``.to(dtype)``
   casts on the fly, ``state_dict()`` works, writes are refused;
4. a ``device_map`` keeps some sub-modules resident and the rest on disk.
The last line starts with "OK" (the test suite checks it).
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile

import torch
from torch import nn

import memtree
from memtree import OffloadedTensor, TensorTree, empty_init, offload

FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
WIDTH, DEPTH = (256, 6) if FAST else (1536, 16)  # full size: 16 blocks, about 1.2 GB of float32
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build() -> nn.Sequential:
    return nn.Sequential(*[Block() for _ in range(DEPTH)], nn.LayerNorm(WIDTH)).eval()


def status(field: str) -> int:
    """A memory figure of this process from /proc (bytes; 0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak (VmHWM) starts again from the current resident size
    except OSError:
        pass


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


workdir = tempfile.mkdtemp(prefix="memtree-offload-")
print(f"working in {workdir}; compute device: {DEVICE}\n")

# 1. A model, saved; its reference output computed in memory, then the model dropped.
torch.manual_seed(0)
model = build()
size = sum(p.numel() * p.element_size() for p in model.parameters())
ckpt = os.path.join(workdir, "model")
TensorTree.from_module(model).memmap(ckpt, num_threads=4)
x = torch.randn(4, WIDTH)
with torch.no_grad():
    expected = model.to(DEVICE)(x.to(DEVICE)).cpu()
del model
gc.collect()
if DEVICE.type == "cuda":
    torch.cuda.empty_cache()
print(f"1. saved a {DEPTH}-block model of {mib(size)} to {ckpt}\n")

# 2. Offload: built without weights, bound to the files, run layer by layer.
with empty_init():
    lazy = build()
result = offload(lazy, ckpt, device=DEVICE)
weight = lazy[0].up.weight
print(f"2. offload -> {result}")
print(f"   lazy[0].up.weight is {weight!r}")
reset_peak()
rss_before = status("VmRSS")
if DEVICE.type == "cuda":
    torch.cuda.reset_peak_memory_stats()
    gpu_before = torch.cuda.memory_allocated()
with torch.no_grad():
    out = lazy(x.to(DEVICE)).cpu()
rss_growth = status("VmHWM") - rss_before
print(f"   peak resident memory growth during the forward: {mib(rss_growth)} ({rss_growth / size:.0%} of the model)")
if DEVICE.type == "cuda":
    gpu_peak = torch.cuda.max_memory_allocated() - gpu_before
    print(f"   peak GPU memory during the forward: {mib(gpu_peak)} ({gpu_peak / size:.0%} of the model)")
    assert gpu_peak < size / 2, "offloaded weights must not all be on the GPU at once"
same = torch.equal(out, expected)
print(f"   output equals the in-memory model's: {same}")
assert same if DEVICE.type == "cpu" else torch.allclose(out, expected, atol=1e-5)
print()

# 3. Composition with the rest of torch.
row = weight[3]  # a view: still on disk, only its bytes are read when used
half = weight.to(torch.float16)  # cast when materialised; the file is unchanged
print(f"3. weight[3] -> {type(row).__name__}{list(row.shape)}; .to(float16) -> {half.dtype}, "
      f"still {type(half).__name__}")
assert isinstance(row, OffloadedTensor) and torch.equal(row.materialize().cpu(), weight.materialize().cpu()[3])
state = lazy.state_dict()
print(f"   state_dict()['0.up.weight'] is an {type(state['0.up.weight']).__name__} (nothing read)")
try:
    with torch.no_grad():
        weight.mul_(2)
except memtree.ReadOnlyError as err:
    print(f"   writes are refused: {str(err)[:80]}...")
print()

# 4. A device_map: the first and last blocks resident, the rest on disk.
with empty_init():
    mixed = build()
device_map = {"": "disk", "0": DEVICE, str(DEPTH): DEVICE}
offload(mixed, ckpt, device=DEVICE, device_map=device_map)
kinds = {name: type(p).__name__ for name, p in mixed.named_parameters() if name.endswith("weight")}
resident = sum(k == "Parameter" for k in kinds.values())
print(f"4. device_map {{'': 'disk', '0': ..., '{DEPTH}': ...}}: {resident} weights resident, "
      f"{len(kinds) - resident} offloaded")
with torch.no_grad():
    mixed_out = mixed(x.to(DEVICE)).cpu()
assert torch.allclose(mixed_out, expected, atol=1e-5)
print(f"   output matches: {torch.allclose(mixed_out, expected, atol=1e-5)}")

shutil.rmtree(workdir)
print(f"OK offloading: ran a {mib(size)} model from disk on {DEVICE} with the same output")
