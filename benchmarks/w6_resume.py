"""W6 resume: a model and its AdamW state loaded into live modules, cold and warm, side by side.

The usual resume order: build the model, build the optimizer (its state tensors allocated), then
load the checkpoint into them. Every system fills the *same* live tensors: the model's
parameters and buffers and the AdamW ``exp_avg``/``exp_avg_sq``/``step`` tensors (gathered in
one container module whose buffers are the optimizer's own state tensors).

Systems:

* ``floor``: a bare ``preadv`` of the memtree leaf files into the same tensors, 4 threads
  taking whole files, no checks (the physical limit of reading these bytes into this memory);
  each leaf's file and offset come from the tree's ``meta.json`` files, read before it is timed
  (small leaves share pack files: format version 3);
* ``memtree``: ``memtree.load_into_module(container, memtree_dir)``;
* ``memtree (safetensors file)``, ``memtree (torch file)``: the same call on the other files;
* ``safetensors``: ``container.load_state_dict(safetensors.torch.load_file(f))``;
* ``torch mmap``: ``container.load_state_dict(torch.load(f, mmap=True, weights_only=True))``.

Comparisons (``python benchmarks/run.py w6``), interleaved rounds:

* ``load, fresh process``, cold and warm: each run in a new process, which builds and touches
  the live model and state (untimed), times the load, and reports the digest of every tensor,
  which the parent checks against the checkpoint's; also its peak anonymous memory beyond the
  model (``RssAnon`` sampled every 5 ms, minus before the load: metric ``anon beyond model``)
  and its peak RSS growth (``VmHWM``, counts the file pages a mapping touched);
* ``load, one process``, warm, at least 9 rounds: the floor and memtree back to back into one
  live container built once; before every run the tensors are zeroed (the target reset), after
  it every tensor's digest is checked.

``w6_quick.py`` is the workbench beside it (any systems, one process, ``--profile``).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn

from checks import CheckFailed, as_digest, digests, expect_digests
from harness import AnonSampler, Comparison, System, malloc_trim, mem_kib, reset_peak_rss, wanted

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ["floor", "memtree", "memtree (safetensors file)", "memtree (torch file)", "safetensors", "torch mmap"]
MiB = 1 << 20
#: The systems of the fresh-process comparisons in a ``--quick`` run (a smoke test).
QUICK_FRESH = ("floor", "memtree", "safetensors")
#: Rounds of the one-process comparison: the issue asks for the median of at least 9 pairs.
PAIRS = 9


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class Model(nn.Module):
    """GPT-like: 32000 x 1024 embedding and ``layers`` blocks of 12.6M parameters."""

    def __init__(self, layers: int, d: int = 1024, vocab: int = 32000) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)


def dims_for(cfg: dict[str, Any]) -> dict[str, int]:
    """W6's model for ``cfg["size_gib"]`` GiB of weights (quick: 2 tiny blocks)."""
    if cfg["quick"]:
        return {"layers": 2, "d": 64, "vocab": 100}
    per_layer = 12 * 1024 * 1024 + 13 * 1024  # parameters of one block
    return {"layers": max(1, round((cfg["size_gib"] * (1 << 30) / 4 - 32000 * 1024) / per_layer)),
            "d": 1024, "vocab": 32000}


def live_container(dims: dict[str, int]) -> nn.Module:
    """The model (``dims``: ``layers``, ``d``, ``vocab``), an AdamW over it with its state
    allocated, and a module holding both, every tensor touched (a live model's pages are
    resident)."""
    with torch.device("meta"):
        model = Model(**dims)
    model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters())
    box = nn.Module()
    box.model = model
    box.optim = nn.Module()
    for i, p in enumerate(model.parameters()):
        # what AdamW allocates on its first step
        state = opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        slot = nn.Module()
        for k, v in state.items():
            slot.register_buffer(k, v)
        box.optim.add_module(str(i), slot)
    with torch.no_grad():
        for t in box.state_dict().values():
            t.zero_()  # touched: a live model's pages are resident
    box._opt = [opt]  # type: ignore[assignment]  # keep the optimizer (and its state) alive
    return box


def prepare(wd: str, dims: dict[str, int]) -> dict[str, Any]:
    """Write the checkpoint (memtree directory, safetensors file, torch.save file) once; returns
    and stores the digest of every tensor."""
    import memtree
    from safetensors.torch import save_file

    box = live_container(dims)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in box.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32))
    sd = {k: v.detach() for k, v in box.state_dict().items()}
    memtree.TensorTree.from_module(box).memmap(os.path.join(wd, "tree"), num_threads=4)
    save_file(sd, os.path.join(wd, "ckpt.safetensors"))
    torch.save(sd, os.path.join(wd, "ckpt.pt"))
    info = {"digests": digests(sd), "nbytes": sum(v.nbytes for v in sd.values()), "tensors": len(sd),
            "dims": dims}
    with open(os.path.join(wd, "expected.json"), "w") as f:
        json.dump(info, f)
    return info


def files_of(system: str, wd: str) -> list[str]:
    if system in ("floor", "memtree"):
        return [os.path.join(wd, "tree")]
    if system in ("safetensors", "memtree (safetensors file)"):
        return [os.path.join(wd, "ckpt.safetensors")]
    return [os.path.join(wd, "ckpt.pt")]


def describe(cfg: dict[str, Any]) -> str:
    dims = dims_for(cfg)
    return f"{dims['layers']} blocks of d {dims['d']}, vocab {dims['vocab']}, and their AdamW state"


def checkpoint(cfg: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The checkpoint's directory under the work directory, written if missing, and its info."""
    dims = dims_for(cfg)
    wd = os.path.join(cfg["workdir"], "w6-{layers}x{d}x{vocab}".format(**dims))
    if not os.path.isfile(os.path.join(wd, "expected.json")):
        os.makedirs(wd, exist_ok=True)
        prepare(wd, dims)
    with open(os.path.join(wd, "expected.json")) as f:
        return wd, json.load(f)


def comparisons(cfg: dict[str, Any]) -> Iterator[Comparison]:
    wd, info = checkpoint(cfg)
    systems = [s for s in SYSTEMS if wanted(s, cfg) or s == "floor"]
    fresh = [s for s in systems if s in QUICK_FRESH or not cfg["quick"]]
    for cache in cfg["caches"]:
        yield Comparison("load, fresh process", cache, [_fresh(s, wd, info) for s in fresh])
    if "warm" in cfg["caches"]:
        box = live_container(info["dims"])
        run = loads(box, wd)
        one = [s for s in ("floor", "memtree") if s in systems]
        yield Comparison("load, one process", "warm", [_in_process(s, box, run[s], wd, info) for s in one],
                         rounds=None if cfg["quick"] else max(PAIRS, cfg["settings"]["rounds"]))


def _fresh(system: str, wd: str, info: dict[str, Any]) -> System:
    def run(_: Any) -> tuple[float, dict[str, Any]]:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "_worker", system, wd],
            capture_output=True, text=True, check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{system}: the worker failed:\n{proc.stderr[-3000:]}")
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        return doc.pop("seconds"), doc

    def check(_: Any, got: dict[str, Any]) -> dict[str, float]:
        bad = [k for k, want in info["digests"].items()
               if k not in got["digests"] or as_digest(got["digests"][k]) != as_digest(want)]
        if bad:
            raise CheckFailed(f"{system}: wrong bytes in {len(bad)} of {len(info['digests'])} tensors: {bad[:5]}")
        return {"anon beyond model": got["anon"], "rss growth": got["rss"]}

    return System(system, run=run, check=check, files=files_of(system, wd), limit=system == "floor",
                  own_time=True)


def _in_process(system: str, box: nn.Module, load: Callable[[], Any], wd: str, info: dict[str, Any]) -> System:
    def setup() -> None:  # the target reset: a load that writes nothing fails its check
        with torch.no_grad():
            for t in box.state_dict().values():
                t.zero_()

    return System(
        system,
        run=lambda _: load(),
        check=lambda _, out: expect_digests(box.state_dict(), info["digests"], f"{system} (one process)"),
        setup=setup,
        files=files_of(system, wd),
        limit=system == "floor",
    )


def leaf_ranges(tree: str) -> dict[str, tuple[str, int]]:
    """Where each leaf's bytes are: its dotted name -> (file, offset), read from the tree's
    ``meta.json`` files (a leaf file of its own, or its range of a pack: format version 3). The
    floor's index, built before it is timed (memtree reads the same files in its timed load)."""
    from memtree.format.packs import leaf_location
    from memtree.format.schema import ChildMeta, LeafMeta, parse_level

    out: dict[str, tuple[str, int]] = {}
    todo: list[tuple[str, list[str]]] = [("", [])]
    while todo:
        rel, keys = todo.pop()
        with open(os.path.join(tree, rel, "meta.json"), "rb") as f:
            meta = parse_level(f.read(), os.path.join(rel, "meta.json"))
        for e in meta.entries:
            if isinstance(e, ChildMeta):
                todo.append((f"{rel}/{e.dir}" if rel else e.dir, keys + [e.key]))
            elif isinstance(e, LeafMeta):
                file, offset = leaf_location(rel, e)
                out[".".join(keys + [e.key])] = (os.path.join(tree, file), offset)
    return out


def floor_load(box: nn.Module, ranges: dict[str, tuple[str, int]]) -> None:
    """4 threads, each taking the next file: open, preadv each of its leaves into its tensor, close."""

    files: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, t in box.state_dict().items():
        path, offset = ranges[name]
        files.setdefault(path, []).append((offset, t))
    jobs = sorted(files.items(), key=lambda j: -sum(t.nbytes for _, t in j[1]))
    it = iter(jobs)

    def work() -> None:
        for path, leaves in it:
            fd = os.open(path, os.O_RDONLY)
            try:
                for offset, t in leaves:
                    view = memoryview(t.view(-1).view(torch.uint8).numpy())
                    done = 0
                    while done < len(view):
                        n = os.preadv(fd, [view[done : done + 64 * MiB]], offset + done)
                        if n <= 0:
                            raise EOFError(path)
                        done += n
            finally:
                os.close(fd)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def loads(box: nn.Module, wd: str) -> dict[str, Callable[[], Any]]:
    """Each system's load of the checkpoint in ``wd`` into the live container ``box``."""
    import memtree
    from safetensors.torch import load_file

    tree, st, pt = (os.path.join(wd, n) for n in ("tree", "ckpt.safetensors", "ckpt.pt"))
    ranges = leaf_ranges(tree)  # the floor's index, untimed
    return {
        "floor": lambda: floor_load(box, ranges),
        "memtree": lambda: memtree.load_into_module(box, tree),
        "memtree (safetensors file)": lambda: memtree.load_into_module(box, st),
        "memtree (torch file)": lambda: memtree.load_into_module(box, pt),
        "safetensors": lambda: box.load_state_dict(load_file(st)),
        "torch mmap": lambda: box.load_state_dict(torch.load(pt, mmap=True, weights_only=True)),
    }


def worker(system: str, wd: str) -> None:
    """One measurement in this fresh process: build and touch the live tensors, time the load,
    print the seconds, the memory and every tensor's digest (checked by the parent)."""
    import gc

    import memtree.nn.loading  # noqa: F401  (imported untimed, as safetensors.torch is)
    import safetensors.torch  # noqa: F401

    with open(os.path.join(wd, "expected.json")) as f:
        dims = json.load(f)["dims"]
    box = live_container(dims)
    load = loads(box, wd)[system]
    gc.collect()
    malloc_trim()
    reset_peak_rss()
    base_rss = mem_kib("VmRSS")
    sampler = AnonSampler()
    base_anon = sampler.peak
    sampler.start()
    t0 = time.perf_counter()
    load()
    seconds = time.perf_counter() - t0
    anon = sampler.stop()
    rss = mem_kib("VmHWM")
    print(json.dumps({"seconds": seconds, "anon": max(0, anon - base_anon) * 1024,
                      "rss": max(0, rss - base_rss) * 1024, "digests": digests(box.state_dict())}))


def overhead(wd: str, dims: dict[str, int], runs: int) -> str:
    """Wall and CPU time of ``load_into_module`` from a tree of the same structure (the same 370
    levels and 924 leaves) with tiny tensors: the cost that does not depend on the bytes."""
    import memtree

    box = live_container({**dims, "d": 4, "vocab": 10})  # the same names and levels
    tree = os.path.join(wd, "tiny-tree")
    if not os.path.isdir(tree):
        memtree.TensorTree.from_module(box).memmap(tree)
    for _ in range(3):
        memtree.load_into_module(box, tree)
    wall, cpu = [], []
    for _ in range(runs):
        c0, t0 = time.thread_time(), time.perf_counter()
        memtree.load_into_module(box, tree)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return (f"fixed cost (same structure, tiny tensors, {runs} loads): wall median {statistics.median(wall) * 1e3:.1f} ms "
            f"(min {min(wall) * 1e3:.1f}), CPU of the calling thread median {statistics.median(cpu) * 1e3:.1f} ms; "
            f"uptime: {os.getloadavg()}")


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "_worker":
    worker(sys.argv[2], sys.argv[3])
