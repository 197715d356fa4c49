"""Tutorial 10 — quantized models and low-bit optimizer states (torchao), on disk without pickle.

Run it:  python tutorials/10_quantized_models.py       (MEMTREE_TUTORIAL_FAST=1 for a small run)

Needs torchao (``pip install torchao``: it installs on a CPU and depends only on torch).

What you will see:
1. a model quantized with torchao (int8 weight-only) saved with
   ``TensorTree.from_module(model).memmap(d)``: each quantized weight is a group of raw files
   (its int8 data, scales and zero points) and its class and settings as JSON, a quarter of the
   float model's bytes;
2. the model rebuilt in a fresh process's way: the float architecture under
   ``memtree.empty_init()`` (no memory), then ``load_into_module``: the weights come back as
   torchao's ``Int8Tensor``, mapped from the files, and the outputs are bit-identical; no
   ``quantize_`` call, no pickle;
3. the same load into a model that is already quantized fills its tensors in place;
4. training with torchao's 8-bit AdamW, checkpointed by ``memtree.Checkpointer`` and resumed:
   the optimizer states are stored 8-bit (not dequantized) and the resumed run matches the
   uninterrupted one exactly;
5. an export in torchao's safetensors convention (what transformers and vLLM load), converted
   back into a tree.
The last line starts with "OK" (the test suite checks it).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import warnings

import torch
from torch import nn

import memtree

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)  # torchao mentions its optional CUDA kernels
    from torchao.optim import AdamW8bit
    from torchao.quantization import Int8WeightOnlyConfig, quantize_
    logging.disable(logging.NOTSET)

FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
WIDTH, DEPTH = (256, 2) if FAST else (1024, 8)


def build(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 16))


def files_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    work = tempfile.mkdtemp(prefix="memtree-quantized-")
    try:
        x = torch.randn(4, WIDTH)

        # 1. quantize and save
        float_model = build()
        model = build()
        quantize_(model, Int8WeightOnlyConfig())
        expected = model(x)
        memtree.TensorTree.from_module(float_model).memmap(f"{work}/float")
        memtree.TensorTree.from_module(model).memmap(f"{work}/int8")
        ratio = files_bytes(f"{work}/int8") / files_bytes(f"{work}/float")
        print(f"1. saved: {type(model[0].weight).__name__} weights, {sorted(os.listdir(f'{work}/int8/0/weight'))}, "
              f"{ratio:.2f}x the float model's bytes")
        assert ratio < 0.3

        # 2. load into a skeleton: the class comes from the tree
        with memtree.empty_init():
            fresh = build()
        result = memtree.load_into_module(fresh, f"{work}/int8")
        weight = fresh[0].weight
        print(f"2. {result}: {type(weight).__name__} with {weight.qdata.dtype} data, outputs bit-identical")
        assert type(weight) is type(model[0].weight) and torch.equal(fresh(x), expected)

        # 3. load into a quantized model: filled in place
        live = build(seed=1)
        quantize_(live, Int8WeightOnlyConfig())
        before = live[0].weight
        memtree.load_into_module(live, f"{work}/int8")
        print(f"3. filled in place: same parameter object: {live[0].weight is before}")
        assert live[0].weight is before and torch.equal(live(x), expected)

        # 4. 8-bit optimizer states through the Checkpointer
        def step(net: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
            torch.manual_seed(seed)
            net(torch.randn(8, WIDTH)).square().mean().backward()
            opt.step()
            opt.zero_grad()

        net = build()
        opt = AdamW8bit(net.parameters())
        ckpt = memtree.Checkpointer(f"{work}/ckpts")
        for i in range(3):
            step(net, opt, i)
        ckpt.save(3, {"model": net.state_dict(), "optim": opt.state_dict()})
        state = opt.state[net[0].weight]["exp_avg"]
        stored = files_bytes(f"{work}/ckpts/3/optim")
        print(f"4. optimizer state: {type(state).__name__}, {stored:,} bytes on disk "
              f"({stored / (2 * 4 * sum(p.numel() for p in net.parameters())):.2f}x of float32 states)")
        resumed = build(seed=5)
        resumed_opt = AdamW8bit(resumed.parameters())
        ckpt.restore(into={"model": resumed, "optim": resumed_opt})
        for i in range(3, 5):
            step(net, opt, i)
            step(resumed, resumed_opt, i)
        assert all(torch.equal(a, b) for a, b in zip(net.parameters(), resumed.parameters()))
        print("   resumed training matches the uninterrupted run exactly")

        # 5. torchao's safetensors convention
        memtree.convert(f"{work}/int8", f"{work}/int8.safetensors")
        keys = sorted(memtree.open_checkpoint(f"{work}/int8.safetensors"))[:3]
        memtree.convert(f"{work}/int8.safetensors", f"{work}/back")
        back = memtree.load_memmap(f"{work}/back")["0", "weight"]
        print(f"5. safetensors keys {keys} ... converted back: {type(back).__name__}")
        assert type(back) is type(model[0].weight)
        print(f"OK quantized models: {DEPTH + 1} int8 layers saved, reloaded bit-identically, 8-bit AdamW resumed")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
