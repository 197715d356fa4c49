"""``python -m memtree demo``: the main job, end to end, on an embedded default.

Builds a small transformer, saves it with ``TensorTree.from_module(model).memmap`` (threads),
binds the files into a fresh model built under ``empty_init`` (no weight copied: the weights are
the files; the peak resident memory growth of that reload is reported), reloads only part of the
model, preallocates a 1,000,000-item image dataset with ``memmap_like``, fills and reads a few
items, and prints what it did with sizes and timings.
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

from ..nn.empty_init import empty_init
from ..tree.tensortree import TensorTree, load_memmap
from .output import add_json_flag, emit_json, emit_text

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


def _memory(field: str) -> int | None:
    """``VmRSS``/``VmHWM`` of this process in bytes, or None without Linux's /proc."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration, ValueError):
        return None


def _reset_peak_rss() -> bool:
    """Restart the peak resident size (``VmHWM``) from the current one (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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
        weights = TensorTree.from_module(model)
        n_params = sum(p.numel() for p in model.parameters())
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model_dir = os.path.join(root, "model")
        with _timed(f"saved a {n_params:,}-parameter transformer as {len(weights.keys(True, True))} leaf files", report):
            weights.memmap(model_dir, num_threads=4, existsok=True)
        apparent, _ = _disk_usage(model_dir)
        report.append(f"  on disk: {_mib(apparent)} in {model_dir}")

        with empty_init():
            _model()  # warm-up: torch imports its meta-device kernels once (tens of MiB)
        measured = _reset_peak_rss()
        before = _memory("VmRSS")
        with _timed("reloaded the whole model into one built under empty_init (maps the files, copies nothing)", report):
            with empty_init():
                fresh = _model()
            full = load_memmap(model_dir)
            full.to_module(fresh)
        peak = _memory("VmHWM")
        if measured and before is not None and peak is not None:
            report.append(
                f"  peak resident memory grew by {_mib(peak - before)} while binding "
                f"{_mib(model_bytes)} of weights"
            )
        tokens = torch.randint(0, 1000, (2, 16))
        model.eval()
        fresh.eval()
        with torch.no_grad():
            same = torch.equal(model(tokens), fresh(tokens))
        report.append(f"  forward of the reloaded model equals the original: {same}")

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
    add_json_flag(parser)


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its report (with ``--json``: ``{"report": [line, ...]}``)."""
    report = run_demo(args.workdir, args.items, keep=args.workdir is not None)
    if args.json:
        emit_json({"report": report.splitlines()})
    else:
        emit_text(report)
    return 0
