"""GPU load: memtree's pinned-ring loads onto a CUDA device against safetensors and the limits.

Run (from the repository root; it needs nothing from the network)::

    python benchmarks/gpu_load.py [--size-gib 2] [--rounds 5] [--workdir DIR] [--json PATH]
    python benchmarks/run.py gpu --store ...       # the same, stored for the results table

What it needs installed: ``torch`` with CUDA and a CUDA device, ``safetensors``, and memtree's
own dependencies (``numpy``, ``orjson``); memtree itself is imported from this checkout. Without
a CUDA device it says so and exits 0 (``--device cpu`` runs the same comparisons on the CPU: a
check of the plumbing, never a result). With the defaults (2 GiB, 5 rounds after 1 warm-up,
cold and warm) it takes 2-4 minutes on an H100 machine. The work directory must be on a disk
for the cold rounds (tmpfs is refused).

Comparisons, each in interleaved rounds (``harness.compare``), cold (the files evicted and
checked with ``mincore`` before every run) and warm, on the same bytes (a 2 GiB state shaped
like a transformer's: 64 MiB matrices, small vectors, one large embedding):

* ``load into existing tensors``: a module whose buffers live on the device, filled in place:
  ``memtree load_into_module`` (from the memtree directory; threaded ``preadv`` into a bounded
  ring of pinned buffers, host-to-device copies overlapping the reads), ``memtree
  load_into_module (safetensors file)``, and ``safetensors load_file + load_state_dict``
  (``module.load_state_dict(safetensors.torch.load_file(f, device="cuda"))``). Before every
  run the module's tensors are zeroed (the target reset: a load that writes nothing fails);
* ``allocate and load``: new device tensors: ``memtree load_memmap`` (``device=..., mmap=False``)
  and ``safetensors load_file`` (``load_file(f, device="cuda")``);
* in both, the limits of the same rounds: ``disk read`` (a bare 4-thread ``preadv`` of the
  leaf files into host memory) and ``PCIe`` (pinned host-to-device copies of the same number of
  bytes, no disk); ``min(disk read, PCIe)`` as a bandwidth is the slower of the two each round.

Every run ends with ``torch.cuda.synchronize()`` inside the timing; ``empty_cache()`` runs in
the setup, outside it. After every run every tensor is compared with the expected one on the
device, element by element (bit patterns, key by key: order-sensitive).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from typing import Any, Callable, Iterator

import torch

from checks import CheckFailed, expect_equal
from harness import Comparison, System

MiB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))


def make_state(size_gib: float) -> dict[str, torch.Tensor]:
    """Tensors like a transformer's: 64 MiB matrices, a few small vectors, one large embedding."""
    total = int(size_gib * (1 << 30))
    g = torch.Generator().manual_seed(0)
    out: dict[str, torch.Tensor] = {"embed": torch.randn(max(1, total // 8 // 4096), 4096, generator=g)}
    left, i = total - out["embed"].nbytes, 0
    while left > 0:
        n = max(1, min(left, 64 * MiB) // 4)
        out[f"layer{i}_weight"] = torch.randn(n, generator=g)
        out[f"layer{i}_bias"] = torch.randn(1024, generator=g)
        left -= n * 4 + 4096
        i += 1
    return out


def module_like(state: dict[str, torch.Tensor], device: str) -> torch.nn.Module:
    """A module with one empty buffer per tensor of ``state``, on ``device``."""
    m = torch.nn.Module()
    for k, v in state.items():
        m.register_buffer(k, torch.empty(v.shape, dtype=v.dtype, device=device))
    return m


def disk_read(tree: str) -> Callable[[Any], None]:
    """A bare 4-thread ``preadv`` of every leaf file into host memory (64 MiB buffers, made once)."""
    views = [memoryview(bytearray(64 * MiB)) for _ in range(4)]
    return lambda _: _read_all(tree, views)


def _read_all(tree: str, views: list[memoryview]) -> None:
    files = [os.path.join(r, f) for r, _, fs in os.walk(tree) for f in fs if f.endswith(".memmap")]
    it = iter(files)
    lock = threading.Lock()

    def work(view: memoryview) -> None:
        while True:
            with lock:
                path = next(it, None)
            if path is None:
                return
            fd = os.open(path, os.O_RDONLY)
            try:
                off = 0
                while n := os.preadv(fd, [view], off):
                    off += n
            finally:
                os.close(fd)

    threads = [threading.Thread(target=work, args=(v,)) for v in views]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _pcie(nbytes: int) -> Callable[[Any], None]:
    """Pinned host-to-device copies of ``nbytes`` in 256 MiB pieces (buffers made once)."""
    piece = min(nbytes, 256 * MiB)
    host = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(piece, dtype=torch.uint8, device="cuda")

    def copy(_: Any) -> None:
        done = 0
        while done < nbytes:
            n = min(piece, nbytes - done)
            dev[:n].copy_(host[:n], non_blocking=True)
            done += n
        torch.cuda.synchronize()

    return copy


def describe(cfg: dict[str, Any]) -> str:
    return f"{_size(cfg)} GiB of float32 onto {cfg.get('device', 'cuda')}"


def _size(cfg: dict[str, Any]) -> float:
    return 0.01 if cfg["quick"] else float(cfg.get("size_gib", 2.0))


def comparisons(cfg: dict[str, Any]) -> Iterator[Comparison]:
    device = cfg.get("device", "cuda")
    on_gpu = device.startswith("cuda")
    if on_gpu and not torch.cuda.is_available():
        why = "N/A: no CUDA device here (torch.cuda.is_available() is False)"
        for op in ("load into existing tensors", "allocate and load"):
            yield Comparison(op, "warm", [System(n, run=lambda _: None, check=lambda s, o: None, missing=why)
                                          for n in ("memtree load_into_module", "disk read")])
        return
    import memtree
    from safetensors.torch import load_file, save_file

    wd = os.path.join(cfg["workdir"], "gpu")
    os.makedirs(wd, exist_ok=True)
    state = make_state(_size(cfg))
    nbytes = sum(v.nbytes for v in state.values())
    tree, st = os.path.join(wd, "tree"), os.path.join(wd, "model.safetensors")
    memtree.TensorTree(state).memmap(tree, num_threads=4)
    save_file(state, st)
    want = {k: v.to(device) for k, v in state.items()}  # compared on the device
    target = module_like(state, device)
    del state

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def reset() -> None:  # outside the timing: the target zeroed, the allocator's cache emptied
        with torch.no_grad():
            for t in target.buffers():
                t.zero_()
        sync()
        if on_gpu:
            torch.cuda.empty_cache()

    def fresh() -> None:
        sync()
        if on_gpu:
            torch.cuda.empty_cache()

    def check(what: str) -> Callable[[Any, Any], None]:
        def go(_: Any, got: Any) -> None:
            tensors = dict(target.named_buffers()) if got is None else got
            for k, v in want.items():
                if k not in tensors:
                    raise CheckFailed(f"{what}: {k} missing")
                expect_equal(tensors[k], v, f"{what}: {k}")

        return go

    def timed(fn: Callable[[], Any]) -> Callable[[Any], Any]:
        def run(_: Any) -> Any:
            out = fn()
            sync()
            return out

        return run

    limits = [System("disk read", run=disk_read(tree), check=lambda s, o: None, files=[tree],
                     limit=True)]
    limits.append(System("PCIe", run=_pcie(nbytes), check=lambda s, o: None, limit=True) if on_gpu else
                  System("PCIe", run=lambda _: None, check=lambda s, o: None, missing="N/A: no device link"))

    def into(src: str) -> Callable[[], None]:
        return lambda: (memtree.load_into_module(target, src), None)[1]

    fill = [
        System("memtree load_into_module", run=timed(into(tree)), check=check("memtree load_into_module"),
               setup=reset, files=[tree]),
        System("memtree load_into_module (safetensors file)", run=timed(into(st)),
               check=check("memtree load_into_module (safetensors file)"), setup=reset, files=[st]),
        System("safetensors load_file + load_state_dict",
               run=timed(lambda: (target.load_state_dict(load_file(st, device=device)), None)[1]),
               check=check("safetensors load_file + load_state_dict"), setup=reset, files=[st]),
    ]
    alloc = [
        System("memtree load_memmap", run=timed(lambda: memtree.load_memmap(tree, device=device, mmap=False)
                                                .to_dict()),
               check=check("memtree load_memmap"), setup=fresh, files=[tree]),
        System("safetensors load_file", run=timed(lambda: load_file(st, device=device)),
               check=check("safetensors load_file"), setup=fresh, files=[st]),
    ]
    for cache in cfg["caches"]:
        yield Comparison("load into existing tensors", cache, fill + limits)
        yield Comparison("allocate and load", cache, alloc + limits)


if __name__ == "__main__":
    if "--device" not in sys.argv and not torch.cuda.is_available():
        print("gpu_load: no CUDA device here (torch.cuda.is_available() is False): nothing to measure")
        sys.exit(0)
    sys.exit(subprocess.call([sys.executable, os.path.join(HERE, "run.py"), "gpu", *sys.argv[1:]]))
