"""GPU load: memtree's pinned-ring loads onto a CUDA device against safetensors and the limits.

Runs unchanged on any machine with a CUDA GPU; without one it says so and exits 0 (it imports
without a GPU). In one run, round after round (cold and warm alternating, the order of the
systems rotated), on the same bytes:

* ``memtree load_memmap``: ``memtree.load_memmap(tree, device=device, mmap=False)`` (threaded preads into a
  bounded ring of pinned buffers, host-to-device copies on a stream overlapping the reads);
* ``memtree load_into_module``: the same bytes into the tensors of a module already on the GPU
  (filled in place), from the memtree directory;
* ``memtree load_into_module (safetensors)``: the same, from the safetensors file;
* ``safetensors load_file``: ``safetensors.torch.load_file(f, device="cuda")``;
* limits: ``disk read`` (a bare 4-thread ``preadv`` of the leaf files into host memory: cold
  rounds only mean anything) and ``PCIe`` (pinned host to device copies of 256 MiB, no disk).

It prints GB/s per system and, for memtree, the ratio to ``min(disk read, PCIe)`` of the same
cache state (target >= 70%) and to safetensors (target >= 2x). Cold: the files' pages are
dropped with ``posix_fadvise(DONTNEED)`` and the drop checked with ``mincore``.

Run::

    .venv/bin/python benchmarks/gpu_load.py [--size-gib 2] [--rounds 3] [--ring-mib 512] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Callable

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from harness import evict, remove, resident_fraction  # noqa: E402

MiB = 1 << 20


def make_state(size_gib: float) -> dict[str, torch.Tensor]:
    """Tensors like a transformer's: 64 MiB matrices, a few small vectors, one large embedding."""
    total = int(size_gib * (1 << 30))
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {"embed": torch.randn(total // 8 // 4096, 4096, generator=g)}
    left, i = total - out["embed"].nbytes, 0
    while left > 0:
        n = min(left, 64 * MiB) // 4
        out[f"layer{i}_weight"] = torch.randn(n, generator=g)
        out[f"layer{i}_bias"] = torch.randn(1024, generator=g)
        left -= n * 4 + 4096
        i += 1
    return out


def bit_sum(t: torch.Tensor) -> int:
    """An order-independent (integer) sum of a float32 tensor's bit patterns: equal on any device."""
    return int(t.view(torch.int32).to(torch.int64).sum().item())


def module_like(state: dict[str, torch.Tensor], device: str) -> torch.nn.Module:
    m = torch.nn.Module()
    for k, v in state.items():
        m.register_buffer(k, torch.empty(v.shape, dtype=v.dtype, device=device))
    return m


def disk_read(tree: str) -> float:
    """Seconds for a bare 4-thread preadv of every leaf file into host memory."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(tree) for f in fs if f.endswith(".memmap")]
    it = iter(files)
    buf_per_thread = [bytearray(64 * MiB) for _ in range(4)]

    def work(buf: bytearray) -> None:
        view = memoryview(buf)
        for path in it:
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                while True:
                    n = os.preadv(fd, [view], off)
                    if n <= 0:
                        break
                    off += n
            finally:
                os.close(fd)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(b,)) for b in buf_per_thread]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def pcie(nbytes: int) -> float:
    """Seconds to copy ``nbytes`` from pinned host memory to the device (256 MiB copies)."""
    host = torch.empty(256 * MiB, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(max(1, nbytes // (256 * MiB))):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * nbytes / (max(1, nbytes // (256 * MiB)) * 256 * MiB)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ring-mib", type=int, default=None, help="memtree.store.fill.PINNED_RING_BYTES, in MiB")
    ap.add_argument("--workdir", default=os.environ.get("BENCH_TMP"))
    ap.add_argument("--device", default="cuda", help="'cpu' checks this script's plumbing on any machine")
    args = ap.parse_args(argv)
    device = args.device
    on_gpu = device.startswith("cuda")

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    if on_gpu and not torch.cuda.is_available():
        print("gpu_load: no CUDA device here (torch.cuda.is_available() is False): nothing to measure")
        return 0
    import memtree
    import memtree.store.fill as fill_mod
    from safetensors.torch import load_file, save_file

    if args.ring_mib is not None:
        fill_mod.PINNED_RING_BYTES = args.ring_mib * MiB
    wd = tempfile.mkdtemp(prefix="gpu-load-", dir=args.workdir)
    try:
        state = make_state(args.size_gib)
        nbytes = sum(v.nbytes for v in state.values())
        tree, st = os.path.join(wd, "tree"), os.path.join(wd, "model.safetensors")
        memtree.TensorTree(state).memmap(tree, num_threads=4)
        save_file(state, st)
        expect = {k: bit_sum(v) for k, v in state.items()}
        target = module_like(state, device)
        del state

        def check(got: dict[str, torch.Tensor]) -> None:
            bad = [k for k, v in expect.items() if bit_sum(got[k]) != v]
            if bad:
                raise SystemExit(f"wrong data in {bad[:5]}")

        def from_module() -> dict[str, torch.Tensor]:
            return {k: getattr(target, k) for k in expect}

        def into_module(src: str) -> Callable[[], dict[str, torch.Tensor]]:
            def go() -> dict[str, torch.Tensor]:
                memtree.load_into_module(target, src)
                return from_module()

            return go

        # each returns what it loaded, checked bit-exact after the timing
        systems: dict[str, tuple[Callable[[], dict[str, torch.Tensor]], list[str]]] = {
            "memtree load_memmap": (lambda: memtree.load_memmap(tree, device=device, mmap=False).to_dict(), [tree]),
            "memtree load_into_module": (into_module(tree), [tree]),
            "memtree load_into_module (safetensors)": (into_module(st), [st]),
            "safetensors load_file": (lambda: load_file(st, device=device), [st]),
        }
        times: dict[tuple[str, str], list[float]] = {}
        names = list(systems) + ["disk read"]
        for r in range(args.rounds):
            for cache in ("cold", "warm") if r % 2 == 0 else ("warm", "cold"):
                order = names[r % len(names):] + names[: r % len(names)]
                for name in order:
                    paths = [tree] if name == "disk read" else systems[name][1]
                    if cache == "cold":
                        evict(paths, "fadvise")
                        left = resident_fraction(paths, max_files=10_000)
                        if left > 0.02:
                            print(f"  note: eviction left {left:.0%} of {name}'s files cached")
                    else:
                        disk_read(paths[0]) if os.path.isdir(paths[0]) else open(paths[0], "rb").read()
                    sync()
                    if name == "disk read":
                        seconds = disk_read(tree)
                    else:
                        t0 = time.perf_counter()
                        got = systems[name][0]()
                        sync()
                        seconds = time.perf_counter() - t0
                        check(got)
                        del got
                    times.setdefault((name, cache), []).append(seconds)
                    print(f"  round {r} {cache} {name:40} {nbytes / seconds / 1e9:6.2f} GB/s", flush=True)
        link = pcie(nbytes) if on_gpu else 0.0
        where = torch.cuda.get_device_name() if on_gpu else device
        print(f"\n{where}: {nbytes / (1 << 30):.2f} GiB, {args.rounds} rounds, "
              f"ring {fill_mod.PINNED_RING_BYTES // MiB} MiB; PCIe (pinned, 256 MiB copies) {nbytes / link / 1e9 if link else float('nan'):.2f} GB/s\n")
        print("| system | cold GB/s | warm GB/s | vs min(disk, PCIe) cold / warm | vs safetensors cold / warm |")
        print("|---|---|---|---|---|")
        med = {k: statistics.median(v) for k, v in times.items()}
        for name in names:
            row = [f"{nbytes / med[name, c] / 1e9:.2f}" for c in ("cold", "warm")]
            ratios = ["", ""]
            if name.startswith("memtree"):
                lim = [max(med["disk read", c], link) for c in ("cold", "warm")]
                ratios = [
                    " / ".join(f"{lim[i] / med[name, c]:.0%}" for i, c in enumerate(("cold", "warm"))),
                    " / ".join(f"{med['safetensors load_file', c] / med[name, c]:.2f}x" for c in ("cold", "warm")),
                ]
            print(f"| {name} | {row[0]} | {row[1]} | {ratios[0]} | {ratios[1]} |")
        return 0
    finally:
        remove(wd)


if __name__ == "__main__":
    raise SystemExit(main())
