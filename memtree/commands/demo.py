"""``python -m memtree demo``: the main job, end to end, on an embedded default.

Builds a small transformer and a nested tree, memory-maps them with threads, reloads only part
of the model, preallocates a 1,000,000-item image dataset with ``memmap_like``, fills and reads a
few items, and prints what it did with sizes and timings.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..tree import TensorTree, load_memmap

__all__ = ["run_demo", "NAME", "HELP", "add_arguments", "run"]

NAME = "demo"
HELP = "build, memmap and reload a model and a dataset; print what was done and how fast"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


def _disk_usage(path: str) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of every file under ``path``."""
    apparent = allocated = 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.stat(os.path.join(root, name))
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return apparent, allocated


@contextmanager
def _timed(label: str, out: list[str]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    out.append(f"{label} ({(time.perf_counter() - start) * 1e3:,.1f} ms)")


def _model(d_model: int = 256, layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
    return nn.Sequential(nn.Embedding(1000, d_model), nn.TransformerEncoder(layer, layers, enable_nested_tensor=False))


def run_demo(workdir: str | None = None, dataset_items: int = 1_000_000, keep: bool = False) -> str:
    """Run the demo in ``workdir`` (a temporary directory by default) and return its report."""
    root = workdir or tempfile.mkdtemp(prefix="memtree-demo-")
    os.makedirs(root, exist_ok=True)
    report: list[str] = [f"memtree demo in {root}"]
    try:
        model = _model()
        weights = TensorTree(model.state_dict()).unflatten_keys(".")
        n_params = sum(t.numel() for t in model.state_dict().values())
        model_dir = os.path.join(root, "model")
        with _timed(f"saved a {n_params:,}-parameter transformer as {len(weights.keys(True, True))} leaf files", report):
            weights.memmap(model_dir, num_threads=4, existsok=True)
        apparent, _ = _disk_usage(model_dir)
        report.append(f"  on disk: {_mib(apparent)} in {model_dir}")

        with _timed("reloaded the whole model (maps files, reads no data)", report):
            full = load_memmap(model_dir)
        fresh = _model()
        with torch.no_grad():
            for key, tensor in full.flatten_keys(".").items():
                fresh.state_dict()[key].copy_(tensor)
        tokens = torch.randint(0, 1000, (2, 16))
        model.eval()
        fresh.eval()
        same = torch.equal(model(tokens), fresh(tokens))
        report.append(f"  forward of a fresh model with the loaded weights equals the original: {same}")

        with _timed("partially reloaded only the embedding and layer 0", report):
            part = load_memmap(model_dir, keys=["0", ("1", "layers", "0")], mode="r")
        report.append(f"  partial tree has {len(part.keys(True, True))} leaves (of {len(full.keys(True, True))})")

        datum = TensorTree(
            {"image": torch.zeros(3, 64, 64, dtype=torch.uint8), "label": torch.zeros((), dtype=torch.int64)}
        )
        data_dir = os.path.join(root, "dataset")
        with _timed(f"preallocated a {dataset_items:,} x (3, 64, 64) uint8 image dataset with memmap_like", report):
            data = datum.expand(dataset_items).memmap_like(data_dir, existsok=True)
        apparent, allocated = _disk_usage(data_dir)
        report.append(f"  apparent size {_mib(apparent)}, blocks allocated {_mib(allocated)} (sparse)")
        idx = torch.randint(0, dataset_items, (256,))
        with _timed("filled 256 random items by index", report):
            data[idx] = TensorTree(
                {"image": torch.full((256, 3, 64, 64), 7, dtype=torch.uint8), "label": torch.arange(256)},
                batch_size=[256],
            )
        with _timed("read them back as one batch", report):
            batch = data[idx]
        report.append(f"  batch image mean {batch['image'].float().mean().item():.1f} (expected 7.0)")
    finally:
        if not keep and workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    return "\n".join(report)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``memtree demo``."""
    parser.add_argument("--workdir", help="directory to work in (default: a temporary one, removed after)")
    parser.add_argument("--items", type=int, default=1_000_000, help="dataset size (default 1,000,000)")


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its report."""
    print(run_demo(args.workdir, args.items, keep=args.workdir is not None))
    return 0
