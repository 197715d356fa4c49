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

``--adapters``: fine-tuning with adapters instead. A frozen base model (``layers`` square
``Linear`` weights, ``--gib`` GiB of float32, no optimizer state) with a LoRA-style pair of
adapter matrices per layer (``rank x d`` and ``d x rank``), and AdamW over the adapters only; one
AdamW step on the adapters between two checkpoints (so the adapters and their moments change, the
base does not), 10 checkpoints. Reported: bytes written, and the disk of all the checkpoints
over the disk of the first (the issue's target: <= 1.2x for ten).

Disk use is measured as ``memtree du`` counts it (:func:`memtree.cli.du.disk_usage`: allocated
blocks, a hard-linked file once); directories that are not memtree trees (the other systems')
are walked with its file walk and counted the same way.

Usage::

    python benchmarks/w7_checkpoints.py                 # ~1 GiB of state (0.34 GiB of weights)
    python benchmarks/w7_checkpoints.py --gib 0.25 --workdir /tmp/w7
    python benchmarks/w7_checkpoints.py --quick         # a smoke test: tiny state, 4 layers, 2 checkpoints
    python benchmarks/w7_checkpoints.py --adapters      # 1 GiB frozen base + rank-8 adapters, 10 checkpoints
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
from memtree.cli.du import disk_usage  # noqa: E402
from memtree.errors import NotAMemtreeError  # noqa: E402
from memtree.store.primitives.files import regular_files  # noqa: E402
from memtree.store.primitives.checksums import default_checksum, new_digest  # noqa: E402


def wchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    return 0


def allocated(root: str) -> int:
    """Allocated bytes below ``root`` as ``memtree du`` counts them (``st_blocks``, a file with
    several names once); other systems' directories (not memtree trees) through du's file walk."""
    try:
        return disk_usage(root).allocated_bytes
    except NotAMemtreeError:
        files = {(st.st_dev, st.st_ino): st.st_blocks for st in regular_files(root)}
        return 512 * sum(files.values())


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


class Adapted(torch.nn.Module):
    """A frozen stack of square ``Linear`` weights with a LoRA-style adapter pair per layer."""

    def __init__(self, d: int, layers: int, rank: int) -> None:
        super().__init__()
        self.base = torch.nn.Sequential(*(torch.nn.Linear(d, d, bias=False) for _ in range(layers)))
        self.base.requires_grad_(False)
        self.lora_a = torch.nn.ParameterList(torch.randn(rank, d) / d**0.5 for _ in range(layers))
        self.lora_b = torch.nn.ParameterList(torch.zeros(d, rank) for _ in range(layers))


def build_adapters(gib: float, layers: int, rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A ``gib`` GiB frozen base (float32, no optimizer state) + adapters with AdamW over them."""
    d = int((gib * 2**30 / 4 / layers) ** 0.5)
    torch.manual_seed(0)
    model = Adapted(d, layers, rank)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    step_adapters(model, opt, 0)
    return model, opt


def step_adapters(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    """One AdamW step on the adapters: they and their moments change, the base does not."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


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


Workload = tuple[Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]],
                 Callable[[torch.nn.Module, torch.optim.Optimizer, int], None]]


def run_system(name: str, make: Callable[[str], Saver], workdir: str, workload: Workload, n: int) -> dict:
    """``n`` checkpoints of ``workload`` (build, change between two checkpoints) by one system."""
    root = os.path.join(workdir, name.split()[0] + "-" + str(abs(hash(name)) % 10**6))
    os.makedirs(root)
    build_fn, change = workload
    model, opt = build_fn()
    save = make(root)
    pauses, durables, written = [], [], []
    disk_first = 0
    for step in range(n):
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        gc.collect()
        done: list[float] = []
        w0 = wchar()
        t0 = time.perf_counter()
        wait = save(os.path.join(root, str(step)), step, state)
        pause = time.perf_counter() - t0
        if wait is not None:
            change(model, opt, step)  # the loop goes on while the save is written
            wait()
            done.append(time.perf_counter())
        else:
            done.append(time.perf_counter())
            change(model, opt, step)
        durables.append(done[0] - t0)
        pauses.append(pause)
        written.append(wchar() - w0)
        if step == 0:
            disk_first = allocated(root)
    disk = allocated(root)
    del model, opt, state
    shutil.rmtree(root, ignore_errors=True)
    gc.collect()
    return {"name": name, "pause": pauses, "durable": durables, "written": written, "disk": disk,
            "disk_first": disk_first}


def reference(build_fn: Callable[[], tuple[torch.nn.Module, torch.optim.Optimizer]]) -> dict:
    model, opt = build_fn()
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


def load_line() -> str:
    """Load averages and the other busy processes (whether another benchmark overlapped)."""
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    import subprocess

    ps = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True, text=True).stdout
    busy = [line.strip()[:90] for line in ps.splitlines()[1:6]
            if line.split()[0] != str(os.getpid()) and float(line.split()[1]) >= 20]
    return f"load average {load}; other busy processes: {busy or 'none'}"


def main_adapters(args: argparse.Namespace, workdir: str) -> None:
    """The fine-tuning series: frozen base + adapters, every system in one run."""
    workload: Workload = (lambda: build_adapters(args.gib, args.layers, args.rank), step_adapters)
    ref = reference(workload[0])
    model, _ = workload[0]()
    adapter = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    del model
    print(f"W7 adapters: {ref['tensors']} tensors, {fmt_mib(ref['nbytes'])} MiB of state: frozen base, "
          f"rank-{args.rank} adapters {fmt_mib(adapter)} MiB + 2x that of AdamW moments; "
          f"{args.checkpoints} checkpoints; workdir {workdir}; torch {torch.__version__}")
    print(f"start: {load_line()}\n", flush=True)
    head = ("system", "pause next", "durable next", "MiB written 1st", "MiB written next",
            "MiB written all", "disk MiB 1st", f"disk MiB all {args.checkpoints}", "all / 1st")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head), flush=True)
    for name, make in SYSTEMS.items():
        if args.systems and not any(s.strip() in name for s in args.systems.split(",")):
            continue
        if not args.systems and name.startswith("memtree") and name.endswith("full"):
            continue  # memtree writing full checkpoints: the main table has them
        r = run_system(name, make, workdir, workload, args.checkpoints)
        nxt = lambda k: statistics.median(r[k][1:]) if len(r[k]) > 1 else float("nan")  # noqa: E731
        print(f"| {r['name']} | {nxt('pause'):.3f} | {nxt('durable'):.3f} | {fmt_mib(r['written'][0])} | "
              f"{fmt_mib(nxt('written'))} | {fmt_mib(sum(r['written']))} | {fmt_mib(r['disk_first'])} | "
              f"{fmt_mib(r['disk'])} | {r['disk'] / r['disk_first']:.3f}x |", flush=True)
    print(f"\nend: {load_line()}")
    print("(seconds; 'next' = median of checkpoints 2..N; disk: allocated bytes as memtree du counts them)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="GiB of state (weights + AdamW moments)")
    ap.add_argument("--layers", type=int, default=21, help="layers (one changes per checkpoint: 1/layers of the bytes)")
    ap.add_argument("--checkpoints", type=int, default=None, help="5 (10 with --adapters)")
    ap.add_argument("--adapters", action="store_true", help="frozen base + adapters changing (fine-tuning)")
    ap.add_argument("--rank", type=int, default=8, help="adapter rank with --adapters")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--systems", default=None, help="comma-separated substrings of row names")
    ap.add_argument("--quick", action="store_true", help="tiny state, 4 layers, 2 checkpoints unless given (smoke test)")
    args = ap.parse_args()
    if args.adapters and args.layers == 21:
        args.layers = 16
    if args.quick:
        args.gib, args.layers = 0.01, 4
        args.checkpoints = args.checkpoints or 2
    args.checkpoints = args.checkpoints or (10 if args.adapters else 5)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    workdir = args.workdir or tempfile.mkdtemp(prefix="w7-")
    os.makedirs(workdir, exist_ok=True)
    if args.adapters:
        main_adapters(args, workdir)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        return
    workload: Workload = (lambda: build(args.gib, args.layers), change_one_layer)
    ref = reference(workload[0])
    print(f"W7: {ref['tensors']} tensors, {fmt_mib(ref['nbytes'])} MiB of model + AdamW state, "
          f"{args.checkpoints} checkpoints, {100 / args.layers:.1f}% of the bytes changing between them; "
          f"workdir {workdir}; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print(f"one in-memory copy of the state: clone {ref['clone']:.3f} s, copy_ into existing memory "
          f"{ref['copy']:.3f} s; hashing it once ({ref['algo']}): {ref['hash']:.3f} s")
    print(f"start: {load_line()}\n", flush=True)
    head = ("system", "pause 1st", "pause next", "next / clone", "next / copy_", "durable 1st",
            "durable next", "MiB written 1st", "MiB written next", "disk MiB (all)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head), flush=True)
    for name, make in SYSTEMS.items():
        if args.systems and not any(s.strip() in name for s in args.systems.split(",")):
            continue
        r = run_system(name, make, workdir, workload, args.checkpoints)
        nxt = lambda k: statistics.median(r[k][1:]) if len(r[k]) > 1 else float("nan")  # noqa: E731
        print(f"| {r['name']} | {r['pause'][0]:.3f} | {nxt('pause'):.3f} | {nxt('pause') / ref['clone']:.2f}x | "
              f"{nxt('pause') / ref['copy']:.2f}x | {r['durable'][0]:.3f} | {nxt('durable'):.3f} | "
              f"{fmt_mib(r['written'][0])} | {fmt_mib(nxt('written'))} | {fmt_mib(r['disk'])} |", flush=True)
    print("\n(seconds; 'next' = median of checkpoints 2..N; next / clone and next / copy_: those pauses "
          "over one plain copy of the state, into new memory and into memory that exists already)")
    print(f"end: {load_line()}")
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
