"""W6 resume: a model and its AdamW state loaded into live modules, cold and warm, side by side.

The usual resume order: build the model, build the optimizer (its state tensors allocated), then
load the checkpoint into them. Every system fills the *same* live tensors: the model's
parameters and buffers and the AdamW ``exp_avg``/``exp_avg_sq``/``step`` tensors (gathered in
one container module whose buffers are the optimizer's own state tensors).

Systems (each measurement in a fresh process, which first builds and touches the live model
and state, untimed):

* ``floor``: a bare ``preadv`` of the memtree leaf files into the same tensors, 4 threads
  taking whole files, no checks (the physical limit of reading these bytes into this memory);
* ``memtree``: ``memtree.load_into_module(container, memtree_dir)``;
* ``memtree (safetensors file)``, ``memtree (torch file)``: the same call on the other files;
* ``safetensors``: ``container.load_state_dict(safetensors.torch.load_file(f))``;
* ``torch mmap``: ``container.load_state_dict(torch.load(f, mmap=True, weights_only=True))``.

Rounds alternate cold and warm, and rotate the order of the systems. *Cold*: the parent
``fdatasync``s and ``posix_fadvise(DONTNEED)``s the files the system reads and checks with
``mincore`` that at most 1% is left cached (no root needed); *warm*: it reads them first and
checks that at least 99% is cached. Peak anonymous memory beyond the model: the highest
``RssAnon`` (sampled every 5 ms) minus ``RssAnon`` before the load, in the measuring process;
peak RSS growth (``VmHWM``) also counts file pages a mapping touched. Each load is checked
bit-exact (CRC-32 of every tensor, untimed).

Run::

    .venv/bin/python benchmarks/w6_resume.py [--size-gib 1] [--rounds 3] [--workdir DIR]

``--systems floor,"memtree (safetensors file)",safetensors`` measures only those (comma-separated
names from the list above; the floor is always measured, the ratios need it).
Back to back in one process (``pairs``): the same live tensors and the same warm files, the
floor then memtree, ``--pairs`` times (after one untimed pair), each pair's ratio (floor time
over memtree time) and their median; ``--profile N`` then profiles ``N`` more memtree loads
(``cProfile``, the top functions by own time and by cumulative time). With ``--workdir DIR
--keep`` the checkpoint is written once and reused by later runs::

    .venv/bin/python benchmarks/w6_resume.py pairs [--size-gib 1] [--pairs 9] [--profile 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from typing import Any, Callable

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import _AnonSampler, evict, malloc_trim, mem_kib, remove, reset_peak_rss, resident_fraction  # noqa: E402

SYSTEMS = ["floor", "memtree", "memtree (safetensors file)", "memtree (torch file)", "safetensors", "torch mmap"]
MiB = 1 << 20


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


def layers_for(size_gib: float) -> int:
    per_layer = 12 * 1024 * 1024 + 13 * 1024  # parameters of one block
    return max(1, round((size_gib * (1 << 30) / 4 - 32000 * 1024) / per_layer))


def live_container(layers: int) -> nn.Module:
    """The model, an AdamW over it with its state allocated, and a module holding both."""
    with torch.device("meta"):
        model = Model(layers)
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


def crcs(box: nn.Module) -> dict[str, int]:
    return {k: zlib.crc32(v.contiguous().view(-1).view(torch.uint8).numpy()) for k, v in box.state_dict().items()}


# -- the parent: write the checkpoint once, then alternate the measurements ---------------------
def prepare(wd: str, layers: int) -> dict[str, Any]:
    import memtree
    from safetensors.torch import save_file

    box = live_container(layers)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in box.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32))
    sd = {k: v.detach() for k, v in box.state_dict().items()}
    memtree.TensorTree.from_module(box).memmap(os.path.join(wd, "tree"), num_threads=4)
    save_file(sd, os.path.join(wd, "ckpt.safetensors"))
    torch.save(sd, os.path.join(wd, "ckpt.pt"))
    info = {"crc": crcs(box), "nbytes": sum(v.nbytes for v in sd.values()), "tensors": len(sd)}
    with open(os.path.join(wd, "expected.json"), "w") as f:
        json.dump(info, f)
    return info


def files_of(system: str, wd: str) -> list[str]:
    if system in ("floor", "memtree"):
        return [os.path.join(wd, "tree")]
    if system in ("safetensors", "memtree (safetensors file)"):
        return [os.path.join(wd, "ckpt.safetensors")]
    return [os.path.join(wd, "ckpt.pt")]


def warm_up(paths: list[str]) -> None:
    from harness import iter_files

    buf = bytearray(16 * MiB)
    for path in iter_files(paths):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def measure_one(system: str, cache: str, wd: str, layers: int) -> dict[str, Any]:
    paths = files_of(system, wd)
    if cache == "cold":
        evict(paths, "fadvise")
        left = resident_fraction(paths, max_files=10_000)
    else:
        warm_up(paths)
        left = resident_fraction(paths, max_files=10_000)
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "_worker", system, wd, str(layers)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{system} ({cache}) failed:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.update(system=system, cache=cache, cached_before=left)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=1.0, help="model size (the AdamW state is twice that)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default=os.environ.get("BENCH_TMP"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset of: " + ", ".join(SYSTEMS))
    args = ap.parse_args()
    systems = ["floor"] + [s for s in (x.strip() for x in args.systems.split(",")) if s and s != "floor"]
    if not set(systems) <= set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(set(systems) - set(SYSTEMS))}; choose from {SYSTEMS}")
    layers = layers_for(args.size_gib)
    wd = tempfile.mkdtemp(prefix="w6-", dir=args.workdir)
    try:
        info = prepare(wd, layers)
        print(f"W6 resume: {info['tensors']} tensors, {info['nbytes'] / (1 << 30):.2f} GiB (model + AdamW state), "
              f"{args.rounds} rounds", flush=True)
        rows: list[dict[str, Any]] = []
        for r in range(args.rounds):
            order = systems[r % len(systems):] + systems[: r % len(systems)]
            for cache in ("cold", "warm") if r % 2 == 0 else ("warm", "cold"):
                for system in order:
                    row = measure_one(system, cache, wd, layers)
                    rows.append(row)
                    print(f"  round {r} {cache:4} {system:27} {row['seconds']:.3f} s  anon +{row['anon'] / MiB:.0f} MiB  "
                          f"rss +{row['rss'] / MiB:.0f} MiB  cached before {row['cached_before']:.0%}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        print(summary(rows, info["nbytes"], systems))
    finally:
        if not args.keep:
            remove(wd)


def summary(rows: list[dict[str, Any]], nbytes: int, systems: list[str] = SYSTEMS) -> str:
    med: dict[tuple[str, str], dict[str, float]] = {}
    for system in systems:
        for cache in ("cold", "warm"):
            mine = [r for r in rows if r["system"] == system and r["cache"] == cache]
            med[system, cache] = {
                "s": statistics.median(r["seconds"] for r in mine),
                "anon": max(r["anon"] for r in mine),
                "rss": statistics.median(r["rss"] for r in mine),
            }
    lines = [
        "| system | cold s | cold GB/s | warm s | warm GB/s | speed vs floor cold / warm | max anon beyond model | peak RSS growth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system in systems:
        c, w = med[system, "cold"], med[system, "warm"]
        fc, fw = med["floor", "cold"]["s"], med["floor", "warm"]["s"]
        lines.append(
            f"| {system} | {c['s']:.3f} | {nbytes / c['s'] / 1e9:.2f} | {w['s']:.3f} | {nbytes / w['s'] / 1e9:.2f} | "
            f"{fc / c['s']:.0%} / {fw / w['s']:.0%} | {c['anon'] / MiB:.0f} MiB | {c['rss'] / MiB:.0f} MiB |"
        )
    m = "memtree"
    for other in ("safetensors", "torch mmap"):
        if (m, "cold") not in med or (other, "cold") not in med:
            continue
        lines.append(
            f"\n{m} vs {other}: {med[other, 'cold']['s'] / med[m, 'cold']['s']:.2f}x cold, "
            f"{med[other, 'warm']['s'] / med[m, 'warm']['s']:.2f}x warm (>1: memtree faster)"
        )
    return "\n".join(lines)


# -- the worker: one measurement in a fresh process ----------------------------------------------
def floor_load(box: nn.Module, tree: str) -> None:
    """4 threads, each taking the next leaf file: open, preadv into the tensor, close."""

    jobs = []
    for name, t in box.state_dict().items():
        *dirs, leaf = name.split(".")
        jobs.append((os.path.join(tree, *dirs, leaf + ".memmap"), t))
    jobs.sort(key=lambda j: -j[1].nbytes)
    it = iter(jobs)

    def work() -> None:
        for path, t in it:
            view = memoryview(t.view(-1).view(torch.uint8).numpy())
            fd = os.open(path, os.O_RDONLY)
            try:
                done = 0
                while done < len(view):
                    n = os.preadv(fd, [view[done : done + 64 * MiB]], done)
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
    return {
        "floor": lambda: floor_load(box, tree),
        "memtree": lambda: memtree.load_into_module(box, tree),
        "memtree (safetensors file)": lambda: memtree.load_into_module(box, st),
        "memtree (torch file)": lambda: memtree.load_into_module(box, pt),
        "safetensors": lambda: box.load_state_dict(load_file(st)),
        "torch mmap": lambda: box.load_state_dict(torch.load(pt, mmap=True, weights_only=True)),
    }


def worker(system: str, wd: str, layers: int) -> None:
    import memtree.nn.loading  # noqa: F401  (imported untimed, as safetensors.torch is)
    import safetensors.torch  # noqa: F401

    with open(os.path.join(wd, "expected.json")) as f:
        expected = json.load(f)["crc"]
    box = live_container(layers)
    tree = os.path.join(wd, "tree")
    if not os.path.isfile(os.path.join(tree, "optim", "0", "exp_avg.memmap")):
        raise SystemExit("unexpected leaf file layout: the floor reads tree/<dotted path>.memmap")
    load = loads(box, wd)[system]
    import gc

    gc.collect()
    malloc_trim()
    reset_peak_rss()
    base_rss = mem_kib("VmRSS")
    sampler = _AnonSampler()
    base_anon = sampler.peak
    sampler.start()
    t0 = time.perf_counter()
    load()
    seconds = time.perf_counter() - t0
    anon = sampler.stop()
    rss = mem_kib("VmHWM")
    got = crcs(box)
    if got != expected:
        bad = [k for k in expected if got.get(k) != expected[k]]
        raise SystemExit(f"{system}: wrong bytes in {bad[:5]}")
    print(json.dumps({"seconds": seconds, "anon": max(0, anon - base_anon) * 1024, "rss": max(0, rss - base_rss) * 1024}))


def overhead(wd: str, layers: int, runs: int) -> str:
    """Wall and CPU time of ``load_into_module`` from a tree of the same structure (the same 370
    levels and 924 leaves) with tiny tensors: the cost that does not depend on the bytes."""
    import memtree

    small = Model.__init__.__defaults__
    Model.__init__.__defaults__ = (4, 10)  # d=4, vocab=10: the same names and levels
    try:
        box = live_container(layers)
    finally:
        Model.__init__.__defaults__ = small
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


# -- back to back in one process -----------------------------------------------------------------
def pairs_main(argv: list[str]) -> None:
    import cProfile
    import pstats

    import memtree
    import memtree.nn.loading  # noqa: F401

    ap = argparse.ArgumentParser(prog="w6_resume.py pairs")
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--profile", type=int, default=0, help="memtree loads to profile after the pairs")
    ap.add_argument("--overhead", type=int, default=0,
                    help="loads of a tree of the same structure with tiny tensors (memtree's fixed cost)")
    ap.add_argument("--workdir", help="reuse (or create) the checkpoint here; kept")
    args = ap.parse_args(argv)
    layers = layers_for(args.size_gib)
    wd = args.workdir or tempfile.mkdtemp(prefix="w6-", dir=os.environ.get("BENCH_TMP"))
    try:
        if not os.path.isfile(os.path.join(wd, "expected.json")):
            os.makedirs(wd, exist_ok=True)
            prepare(wd, layers)
        with open(os.path.join(wd, "expected.json")) as f:
            expected = json.load(f)["crc"]
        tree = os.path.join(wd, "tree")
        box = live_container(layers)
        loads = {"floor": lambda: floor_load(box, tree), "memtree": lambda: memtree.load_into_module(box, tree)}

        def timed(system: str) -> float:
            warm_up([tree])  # the files stay cached (another process may have pushed some out)
            with torch.no_grad():
                for t in box.state_dict().values():
                    t.zero_()
            t0 = time.perf_counter()
            loads[system]()
            return time.perf_counter() - t0

        for system in loads:  # one untimed pair, checked bit-exact
            timed(system)
            if crcs(box) != expected:
                raise SystemExit(f"{system}: wrong bytes")
        print(f"uptime: {os.getloadavg()}", flush=True)
        rows = []
        for i in range(args.pairs):
            order = ("floor", "memtree") if i % 2 == 0 else ("memtree", "floor")
            got = {s: timed(s) for s in order}
            rows.append(got)
            print(f"  pair {i} floor {got['floor']:.3f} s  memtree {got['memtree']:.3f} s  "
                  f"{got['floor'] / got['memtree']:.0%}", flush=True)
        if rows:
            f_med = statistics.median(r["floor"] for r in rows)
            m_med = statistics.median(r["memtree"] for r in rows)
            ratio = statistics.median(r["floor"] / r["memtree"] for r in rows)
            print(f"median floor {f_med:.3f} s, memtree {m_med:.3f} s; median of per-pair ratios {ratio:.0%}; "
                  f"uptime: {os.getloadavg()}")
        if args.overhead:
            print(overhead(wd, layers, args.overhead))
        if args.profile:
            prof = cProfile.Profile()
            for _ in range(args.profile):
                warm_up([tree])
                prof.enable()
                loads["memtree"]()
                prof.disable()
            stats = pstats.Stats(prof)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
    finally:
        if not args.workdir:
            remove(wd)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "pairs":
        pairs_main(sys.argv[2:])
    else:
        main()
