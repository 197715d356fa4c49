"""W7 training checkpoints: a series of checkpoints of a model + AdamW state, every system in one run.

The state is ``{"model": model.state_dict(), "optim": AdamW.state_dict(), "step": n}`` of a stack
of square ``Linear`` layers after one AdamW step (weights, ``exp_avg``, ``exp_avg_sq``: 3 x the
parameters). Each system saves 5 checkpoints; between two of them one layer changes in place
(its weight and both moments: ~5% of the bytes, as when fine-tuning touches a few layers), outside
the timed part. Every save is durable: memtree ``fsync=True``; DCP's ``FileSystemWriter`` fsyncs by
default; ``torch.save`` and safetensors get an ``os.fsync`` of the file (inside the timing).

Per system and checkpoint:

* **pause**: how long the training loop is blocked (the whole save for a blocking system; the
  call for an async one, which snapshots the state before returning);
* **durable**: from the call until the checkpoint is committed and fsynced;
* **written**: bytes this process handed to ``write`` (``wchar`` of ``/proc/self/io``);
* **disk**: allocated bytes of the 5 checkpoints at the end (a hard-linked file counted once).

Rows: memtree ``Checkpointer`` blocking and async, each full (``incremental=False``) and
incremental (the default: unchanged leaves hard-linked from the previous step), DCP ``save`` and
``async_save`` (``FileSystemWriter``, ``no_dist``), ``torch.save``, safetensors ``save_file`` (the
flattened tensors; it cannot hold the optimizer's non-tensor values). Reference lines: one plain
in-memory copy of the state (``clone`` of every tensor, and ``copy_`` into memory that exists
already), and hashing the state once with memtree's checksum (the floor of deciding what changed).

Usage::

    python benchmarks/w7_checkpoints.py                 # ~1 GiB of state (0.34 GiB of weights)
    python benchmarks/w7_checkpoints.py --gib 0.25 --workdir /tmp/w7
    python benchmarks/w7_checkpoints.py --quick         # a smoke test: tiny state, 4 layers, 2 checkpoints
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import memtree  # noqa: E402
from memtree.store.files import default_checksum, new_digest  # noqa: E402


def wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def allocated(root: str) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def build(gib: float, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """``layers`` square Linear layers whose weights + AdamW moments take ``gib`` GiB."""
    d = int((gib * 2**30 / 12 / layers) ** 0.5)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(d, d) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def change_one_layer(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    """One layer's weight, bias and their AdamW moments change in place (~1/layers of the bytes)."""
    layer = model[i % len(model)]
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(1e-3)
            opt.state[p]["exp_avg"].mul_(0.9).add_(1e-3)
            opt.state[p]["exp_avg_sq"].mul_(0.999).add_(1e-6)


def tensors_of(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(tensors_of(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(tensors_of(v, f"{prefix}.{i}"))
    return out


# -- systems: each returns (pause seconds, a waiter returning the durable time) ----------------
Saver = Callable[[str, int, dict], Callable[[], None] | None]


def memtree_saver(blocking: bool, incremental: bool) -> Callable[[str], Saver]:
    def make(root: str) -> Saver:
        ckpt = memtree.Checkpointer(root, fsync=True, incremental=incremental)

        def save(_: str, step: int, state: dict) -> Callable[[], None] | None:
            out = ckpt.save(step, state, blocking=blocking)
            return None if blocking else out.result  # type: ignore[union-attr]

        return save

    return make


def dcp_saver(use_async: bool) -> Callable[[str], Saver]:
    import torch.distributed.checkpoint as dcp

    def make(root: str) -> Saver:
        def save(path: str, step: int, state: dict) -> Callable[[], None] | None:
            writer = dcp.FileSystemWriter(path)
            if use_async:
                fut = dcp.async_save(state, storage_writer=writer, no_dist=True)
                return fut.result
            dcp.save(state, storage_writer=writer, no_dist=True)
            return None

        return save

    return make


def torch_saver(root: str) -> Saver:
    def save(path: str, step: int, state: dict) -> None:
        os.makedirs(path)
        torch.save(state, f"{path}/ckpt.pt")
        fsync_path(f"{path}/ckpt.pt")

    return save


def safetensors_saver(root: str) -> Saver:
    from safetensors.torch import save_file

    def save(path: str, step: int, state: dict) -> None:
        os.makedirs(path)
        save_file({k: v.contiguous() for k, v in tensors_of(state).items()}, f"{path}/ckpt.safetensors")
        fsync_path(f"{path}/ckpt.safetensors")

    return save


SYSTEMS: dict[str, Callable[[str], Saver]] = {
    "memtree blocking, full": memtree_saver(True, False),
    "memtree blocking, incremental": memtree_saver(True, True),
    "memtree async, full": memtree_saver(False, False),
    "memtree async, incremental": memtree_saver(False, True),
    "DCP save (FileSystemWriter)": dcp_saver(False),
    "DCP async_save (FileSystemWriter)": dcp_saver(True),
    "torch.save": torch_saver,
    "safetensors save_file": safetensors_saver,
}


def run_system(name: str, make: Callable[[str], Saver], workdir: str, gib: float, layers: int, n: int) -> dict:
    root = os.path.join(workdir, name.split()[0] + "-" + str(abs(hash(name)) % 10**6))
    os.makedirs(root)
    model, opt = build(gib, layers)
    save = make(root)
    pauses, durables, written = [], [], []
    for step in range(n):
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        gc.collect()
        done: list[float] = []
        w0 = wchar()
        t0 = time.perf_counter()
        wait = save(os.path.join(root, str(step)), step, state)
        pause = time.perf_counter() - t0
        if wait is not None:
            change_one_layer(model, opt, step)  # the loop goes on while the save is written
            wait()
            done.append(time.perf_counter())
        else:
            done.append(time.perf_counter())
            change_one_layer(model, opt, step)
        durables.append(done[0] - t0)
        pauses.append(pause)
        written.append(wchar() - w0)
    disk = allocated(root)
    del model, opt, state
    shutil.rmtree(root, ignore_errors=True)
    gc.collect()
    return {"name": name, "pause": pauses, "durable": durables, "written": written, "disk": disk}


def reference(gib: float, layers: int) -> dict:
    model, opt = build(gib, layers)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    tensors = list(tensors_of(state).values())
    nbytes = sum(t.nbytes for t in tensors)
    clones, copies, hashes = [], [], []
    dst = [torch.empty_like(t) for t in tensors]
    algo = default_checksum()
    for _ in range(3):
        gc.collect()
        t0 = time.perf_counter()
        c = [t.clone() for t in tensors]
        clones.append(time.perf_counter() - t0)
        del c
        t0 = time.perf_counter()
        for a, b in zip(dst, tensors):
            a.copy_(b)
        copies.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in tensors:
            d = new_digest(algo)
            d.update(t.view(-1).view(torch.uint8).numpy())
            d.hexdigest()
        hashes.append(time.perf_counter() - t0)
    return {"nbytes": nbytes, "tensors": len(tensors), "clone": min(clones), "copy": min(copies),
            "hash": min(hashes), "algo": algo}


def fmt_mib(b: float) -> str:
    return f"{b / 2**20:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of state (weights + AdamW moments)")
    ap.add_argument("--layers", type=int, default=21, help="layers (one changes per checkpoint: 1/layers of the bytes)")
    ap.add_argument("--checkpoints", type=int, default=5)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--systems", default=None, help="comma-separated substrings of row names")
    ap.add_argument("--quick", action="store_true", help="tiny state, 4 layers, 2 checkpoints (smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.gib, args.checkpoints, args.layers = 0.01, 2, 4
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    workdir = args.workdir or tempfile.mkdtemp(prefix="w7-")
    os.makedirs(workdir, exist_ok=True)
    ref = reference(args.gib, args.layers)
    print(f"W7: {ref['tensors']} tensors, {fmt_mib(ref['nbytes'])} MiB of model + AdamW state, "
          f"{args.checkpoints} checkpoints, {100 / args.layers:.1f}% of the bytes changing between them; "
          f"workdir {workdir}; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"one in-memory copy of the state: clone {ref['clone']:.3f} s, copy_ into existing memory "
          f"{ref['copy']:.3f} s; hashing it once ({ref['algo']}): {ref['hash']:.3f} s\n", flush=True)
    head = ("system", "pause 1st", "pause next", "next / clone", "next / copy_", "durable 1st",
            "durable next", "MiB written 1st", "MiB written next", "disk MiB (all)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head), flush=True)
    for name, make in SYSTEMS.items():
        if args.systems and not any(s.strip() in name for s in args.systems.split(",")):
            continue
        r = run_system(name, make, workdir, args.gib, args.layers, args.checkpoints)
        nxt = lambda k: statistics.median(r[k][1:]) if len(r[k]) > 1 else float("nan")  # noqa: E731
        print(f"| {r['name']} | {r['pause'][0]:.3f} | {nxt('pause'):.3f} | {nxt('pause') / ref['clone']:.2f}x | "
              f"{nxt('pause') / ref['copy']:.2f}x | {r['durable'][0]:.3f} | {nxt('durable'):.3f} | "
              f"{fmt_mib(r['written'][0])} | {fmt_mib(nxt('written'))} | {fmt_mib(r['disk'])} |", flush=True)
    print("\n(seconds; 'next' = median of checkpoints 2..N; next / clone and next / copy_: those pauses "
          "over one plain copy of the state, into new memory and into memory that exists already)")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
