"""Tutorial 4 — checkpoints and interop: torch.save, safetensors, tensordict, ``memtree convert``.

Run it:  python tutorials/04_checkpoints_and_interop.py   (MEMTREE_TUTORIAL_FAST=1 for a small run)

What you will see:
1. ``open_checkpoint`` on a ``torch.save`` file: keys, shapes and dtypes without reading data,
   then one tensor read on its own;
2. a hostile pickle inside a checkpoint is refused, and nothing runs;
3. ``memtree convert``: a checkpoint streamed into a memtree directory (cast to bfloat16), one
   tensor at a time, then into a ``.safetensors`` file;
4. ``save_safetensors`` / ``open_checkpoint`` on safetensors: bit-exact, zero-copy;
5. a directory in tensordict's ``memmap`` layout loaded by ``memtree.load_memmap``;
6. ``load_into_module`` straight from the checkpoint file.
Every tutorial ends with a line starting with "OK" (the test suite checks it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

import memtree
from memtree.cli import main as memtree_cli

FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
WIDTH = 64 if FAST else 1024  # hidden size of the toy model: 8 × WIDTH² floats per block
BLOCKS = 2 if FAST else 4

workdir = tempfile.mkdtemp(prefix="memtree-interop-")
print(f"working in {workdir}\n")


def make_model() -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for _ in range(BLOCKS):
        layers += [
            torch.nn.Linear(WIDTH, 4 * WIDTH),
            torch.nn.GELU(),
            torch.nn.Linear(4 * WIDTH, WIDTH),
        ]
    return torch.nn.Sequential(*layers)


# 1. A torch.save checkpoint, opened lazily: the listing reads the zip directory and data.pkl only.
torch.manual_seed(0)
model = make_model()
ckpt_path = os.path.join(workdir, "model.pt")
torch.save({"model": model.state_dict(), "epoch": 12, "lr": 3e-4}, ckpt_path)
size = os.path.getsize(ckpt_path)
with memtree.open_checkpoint(ckpt_path) as ckpt:
    print(f"1. {ckpt!r} ({size / 2**20:.1f} MiB)")
    for key in list(ckpt)[:3]:
        shape, dtype = ckpt.tensor_spec(key)
        print(f"   {key:<22} {str(dtype):<14} {list(shape)}")
    print(f"   ... non-tensor values: {ckpt.non_tensors}")
    first = ckpt["model.0.weight"]  # read on access: a zero-copy view of the mapped file
    assert torch.equal(first, model[0].weight.detach())
    print(f"   read one tensor on its own: model.0.weight sum = {first.sum().item():.4f}\n")


# 2. Pickles can run code. memtree's unpickler refuses anything that is not tensors and plain data.
class Hostile:
    def __reduce__(self):
        return (os.system, (f"touch {os.path.join(workdir, 'pwned')}",))


evil_path = os.path.join(workdir, "evil.pt")
torch.save({"w": torch.ones(2), "payload": Hostile()}, evil_path)
try:
    memtree.open_checkpoint(evil_path)
    raise AssertionError("the hostile checkpoint was accepted")
except memtree.UnsafePickleError as err:
    print(f"2. refused: {str(err)[:110]}...")
assert not os.path.exists(os.path.join(workdir, "pwned"))
print("   and the command in the pickle never ran\n")

# 3. Convert, streaming: peak memory is about one tensor, not the checkpoint.
tree_dir = os.path.join(workdir, "model_bf16")
st_path = os.path.join(workdir, "model.safetensors")
for args in (
    ["convert", ckpt_path, tree_dir, "--dtype", "bfloat16"],
    ["convert", tree_dir, st_path],
):
    print(f"3. $ memtree {' '.join(os.path.basename(a) if os.sep in a else a for a in args)}")
    assert memtree_cli(args) == 0  # the command line's entry point, called in this process
tree = memtree.load_memmap(tree_dir, mode="r")
print(f"   memtree directory: {tree['model', '0', 'weight'].dtype}, epoch = {tree['epoch']}")
print(
    f"   safetensors file: {os.path.getsize(st_path) / 2**20:.1f} MiB "
    f"(bfloat16: about half of {size / 2**20:.1f} MiB)\n"
)

# 4. safetensors both ways, bit-exact for every dtype it supports; reads are zero-copy.
exact = memtree.TensorTree(
    {
        "bf16": torch.randn(3, 3).to(torch.bfloat16),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "u16": torch.tensor([0, 65535], dtype=torch.uint16),
    }
)
exact_path = os.path.join(workdir, "exact.safetensors")
memtree.save_safetensors(exact, exact_path)
with memtree.open_checkpoint(exact_path) as st:
    for key in st:
        a, b = st[key], exact[key]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
print(f"4. {sorted(exact.keys())} written to safetensors and read back bit-exact\n")

# 5. tensordict's memmap layout (written here by hand, as tensordict would) loads read-only.
td_dir = os.path.join(workdir, "td")
os.makedirs(os.path.join(td_dir, "cfg"))
with open(os.path.join(td_dir, "meta.json"), "w") as f:
    json.dump(
        {
            "obs": {
                "device": "cpu",
                "shape": [4, 2],
                "dtype": "torch.bfloat16",
                "is_nested": False,
            },
            "cfg": {"type": "NonTensorData"},
            "shape": [4],
            "device": "cpu",
            "_type": "<class 'tensordict._td.TensorDict'>",
        },
        f,
    )
with open(os.path.join(td_dir, "cfg", "meta.json"), "w") as f:
    json.dump(
        {"_type": "<class 'tensordict.tensorclass.NonTensorData'>", "data": {"env": "cartpole"}}, f
    )
torch.arange(8, dtype=torch.float32).to(torch.bfloat16).view(torch.uint8).numpy().tofile(
    os.path.join(td_dir, "obs.memmap")
)
td = memtree.load_memmap(td_dir, mode="r")
print(
    f"5. tensordict directory: batch_size {list(td.batch_size)}, obs {td['obs'].dtype} "
    f"{td['obs'][1].tolist()}, cfg = {td['cfg']}\n"
)

# 6. A fresh (bfloat16) model loads straight from a checkpoint file, tensor by tensor.
weights = os.path.join(workdir, "weights.safetensors")
memtree.save_safetensors(tree["model"], weights)  # the state_dict part: keys "0.weight", ...
fresh = make_model().to(torch.bfloat16)
result = memtree.load_into_module(fresh, weights)
same = all(
    torch.equal(p.detach(), tree[("model", *name.split("."))])
    for name, p in fresh.named_parameters()
)
print(
    f"6. load_into_module(model, {os.path.basename(weights)!r}): {len(result.missing)} missing, "
    f"{len(result.unexpected)} unexpected; weights equal the converted ones: {same}"
)
assert same and not result.missing and not result.unexpected

shutil.rmtree(workdir)
print(
    f"OK checkpoints and interop: {BLOCKS * 4} tensors converted torch.save -> memtree -> "
    "safetensors, a hostile pickle refused, a tensordict directory loaded"
)
