"""``python -m memtree demo``: the main job, end to end, on an embedded default, in seconds.

Builds a small transformer, saves it with ``TensorTree.from_module(model).memmap`` (threads),
binds the files into a fresh model built under ``empty_init`` (no weight copied: the weights are
the files; the peak resident memory growth of that reload is reported), compares that load with
``torch.load`` and safetensors' ``load_file`` of the same weights, reloads only part of the model,
preallocates a 1,000,000-item image dataset with ``memmap_like``, fills and reads a few items,
kills a training process (``kill -9``) while its ``Checkpointer`` saves and resumes from the last
committed step, and ends with the commands to look at what it wrote. Each line is printed as its
step ends.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..nn.empty_init import empty_init
from ..training.checkpointer import Checkpointer
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
def _timed(label: str, say: Callable[[str], None]) -> Iterator[None]:
    start = time.perf_counter()
    yield
    say(f"{label} ({_ms(start)})")


def _ms(start: float) -> str:
    return f"{(time.perf_counter() - start) * 1e3:,.1f} ms"


def _load_times(state: dict[str, torch.Tensor], model_dir: str) -> str:
    """One line: ``load_memmap`` of the tree at ``model_dir`` against ``torch.load`` and
    safetensors' ``load_file`` (when installed) of the same tensors (their files are written to a
    temporary directory: safetensors takes only UTF-8 paths)."""
    start = time.perf_counter()
    load_memmap(model_dir)
    line = f"  loading the same weights: memtree load_memmap {_ms(start)} (mapped)"
    with tempfile.TemporaryDirectory(prefix="memtree-demo-") as scratch:
        path = os.path.join(scratch, "model.pt")
        torch.save(state, path)
        start = time.perf_counter()
        torch.load(path, weights_only=True)
        line += f", torch.load {_ms(start)}"
        try:
            from safetensors.torch import load_file, save_file
        except ImportError:
            return line + ", safetensors not installed"
        path = os.path.join(scratch, "model.safetensors")
        save_file(state, path)
        start = time.perf_counter()
        load_file(path)
        return line + f", safetensors load_file {_ms(start)} (read into memory)"


#: The training run the demo kills: it resumes from the newest step if there is one (a demo run
#: again in the same --workdir), then saves one Checkpointer step per update and prints its number.
_TRAINER = """
import sys, torch, memtree
from torch import nn
torch.manual_seed(0)
model = nn.Linear(256, 256)
optim = torch.optim.AdamW(model.parameters())
ckpt = memtree.Checkpointer(sys.argv[1], keep_last=2)
start = 0
if ckpt.latest() is not None:
    start = ckpt.restore(into={"model": model, "optim": optim})["step"] + 1
for step in range(start, start + 1_000_000):
    model(torch.randn(8, 256)).square().mean().backward()
    optim.step()
    optim.zero_grad()
    ckpt.save(step, {"model": model.state_dict(), "optim": optim.state_dict(), "step": step})
    print(step, flush=True)
"""


def _killed_and_resumed(root: str, say: Callable[[str], None]) -> None:
    """Train in a subprocess, ``kill -9`` it once it saved 4 steps (while it saves the next), then
    resume from the newest committed step, restored and verified."""
    ckpt_dir = os.path.join(root, "checkpoints")
    say("training in a subprocess that saves a Checkpointer step after every update...")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root, os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _TRAINER, ckpt_dir], stdout=subprocess.PIPE, text=True, env=env)
    saved: list[int] = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            saved.append(int(line))
            if len(saved) == 4:
                break
    finally:
        child.kill()
        child.wait()
    if len(saved) < 4:
        raise RuntimeError(f"the demo's training subprocess exited with status {child.returncode} before 4 saves")
    model = nn.Linear(256, 256)
    optim = torch.optim.AdamW(model.parameters())
    ckpt = Checkpointer(ckpt_dir)
    state = ckpt.restore(into={"model": model, "optim": optim})
    say(
        f"  killed it (kill -9) after it saved step {saved[-1]}; resumed from step {state['step']} "
        f"(latest committed: {ckpt.steps()}), every leaf verified against its checksum"
    )


def _model(d_model: int = 256, layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, batch_first=True)
    return nn.Sequential(nn.Embedding(1000, d_model), nn.TransformerEncoder(layer, layers, enable_nested_tensor=False))


def run_demo(
    workdir: str | None = None,
    dataset_items: int = 1_000_000,
    keep: bool = False,
    echo: Callable[[str], None] | None = None,
) -> str:
    """Run the demo in ``workdir`` (a temporary directory by default) and return its report;
    ``echo`` is called with each line of it as soon as its step ends."""
    root = workdir or tempfile.mkdtemp(prefix="memtree-demo-")
    os.makedirs(root, exist_ok=True)
    report: list[str] = []

    def say(line: str) -> None:
        report.append(line)
        if echo is not None:
            echo(line)

    say(f"memtree demo in {root}")
    try:
        model = _model()
        weights = TensorTree.from_module(model)
        n_params = sum(p.numel() for p in model.parameters())
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model_dir = os.path.join(root, "model")
        with _timed(f"saved a {n_params:,}-parameter transformer as {len(weights.keys(True, True))} leaf files", say):
            weights.memmap(model_dir, num_threads=4, existsok=True)
        apparent, _ = _disk_usage(model_dir)
        say(f"  on disk: {_mib(apparent)} in {model_dir}")

        with empty_init():
            _model()  # warm-up: torch imports its meta-device kernels once (tens of MiB)
        measured = _reset_peak_rss()
        before = _memory("VmRSS")
        with _timed("reloaded the whole model into one built under empty_init (maps the files, copies nothing)", say):
            with empty_init():
                fresh = _model()
            full = load_memmap(model_dir)
            full.to_module(fresh)
        peak = _memory("VmHWM")
        if measured and before is not None and peak is not None:
            say(
                f"  peak resident memory grew by {_mib(peak - before)} while binding "
                f"{_mib(model_bytes)} of weights"
            )
        tokens = torch.randint(0, 1000, (2, 16))
        model.eval()
        fresh.eval()
        with torch.no_grad():
            same = torch.equal(model(tokens), fresh(tokens))
        say(f"  forward of the reloaded model equals the original: {same}")
        say(_load_times(dict(model.state_dict()), model_dir))

        with _timed("partially reloaded only the embedding and layer 0", say):
            part = load_memmap(model_dir, keys=["0", ("1", "layers", "0")], mode="r")
        say(f"  partial tree has {len(part.keys(True, True))} leaves (of {len(full.keys(True, True))})")

        datum = TensorTree(
            {"image": torch.zeros(3, 64, 64, dtype=torch.uint8), "label": torch.zeros((), dtype=torch.int64)}
        )
        data_dir = os.path.join(root, "dataset")
        with _timed(f"preallocated a {dataset_items:,} x (3, 64, 64) uint8 image dataset with memmap_like", say):
            data = datum.expand(dataset_items).memmap_like(data_dir, existsok=True)
        apparent, allocated = _disk_usage(data_dir)
        say(f"  apparent size {_mib(apparent)}, blocks allocated {_mib(allocated)} (sparse)")
        idx = torch.randint(0, dataset_items, (256,))
        with _timed("filled 256 random items by index", say):
            data[idx] = TensorTree(
                {"image": torch.full((256, 3, 64, 64), 7, dtype=torch.uint8), "label": torch.arange(256)},
                batch_size=[256],
            )
        with _timed("read them back as one batch", say):
            batch = data[idx]
        say(f"  batch image mean {batch['image'].float().mean().item():.1f} (expected 7.0)")
        _killed_and_resumed(root, say)
        if keep or workdir is not None:
            say(f"next: memtree info {model_dir}; memtree info {os.path.join(root, 'checkpoints')}")
        else:
            say("next: memtree demo --workdir DIR keeps the files; then memtree info DIR/model")
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
    keep = args.workdir is not None
    if args.json:
        emit_json({"report": run_demo(args.workdir, args.items, keep=keep).splitlines()})
    else:
        run_demo(args.workdir, args.items, keep=keep, echo=emit_text)
    return 0
