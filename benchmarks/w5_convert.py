"""W5 convert: a ~1 GiB ``torch.save`` checkpoint (W1's tensors, flat dotted keys) to a memory-
mapped directory: time, peak RSS, bytes on disk.

Rows:

* ``memtree convert``: ``memtree.interop.convert(ckpt, dir)`` (N/A until memtree has it);
* ``torch.load + memtree memmap`` / ``torch.load(mmap) + memtree memmap``: load the checkpoint
  (into memory, or mapped), nest the dotted keys, ``TensorTree(...).memmap(dir)``;
* ``torch.load + tensordict memmap`` / ``torch.load(mmap) + tensordict memmap``: the same with
  ``TensorDict``;
* ``torch.load(mmap) + raw write`` (the limit): the mapped checkpoint's tensors written into
  one preallocated file with ``os.write``.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch

from harness import Result, Settings, disk_usage, measure, remove
from stores import Store, flat_name, make_tensors, save
from workloads import caches, w1_layout

ROWS = [
    "memtree convert",
    "torch.load + memtree memmap",
    "torch.load(mmap) + memtree memmap",
    "torch.load + tensordict memmap",
    "torch.load(mmap) + tensordict memmap",
    "torch.load(mmap) + raw write",
]


def systems(cfg: dict[str, Any]) -> list[str]:
    return list(ROWS)


def limit_of(row: Result) -> str | None:
    return "torch.load(mmap) + raw write"


def _ckpt(cfg: dict[str, Any]) -> str:
    return os.path.join(cfg["workdir"], "w5", "ckpt.pt")


def prepare(cfg: dict[str, Any]) -> str:
    """Write the checkpoint once."""
    os.makedirs(os.path.dirname(_ckpt(cfg)), exist_ok=True)
    layout = w1_layout(cfg)
    tensors = make_tensors(layout, seed=5)
    torch.save({flat_name(k): t for (k, _, _), t in zip(layout, tensors)}, _ckpt(cfg))
    mib = os.path.getsize(_ckpt(cfg)) / 2**20
    return f"torch.save checkpoint of {len(layout)} tensors, {mib:,.1f} MiB"


def _memtree_convert() -> tuple[Callable[[str, str], Any] | None, str]:
    try:
        import memtree.interop as interop  # type: ignore[import-not-found]
    except ImportError:
        return None, "N/A: memtree.interop does not exist yet"
    fn = getattr(interop, "convert", None)
    if fn is None:
        names = sorted(n for n in dir(interop) if not n.startswith("_"))
        return None, f"N/A: memtree.interop has no convert (has {names})"
    return fn, str(inspect.signature(fn))


def _converter(name: str, ckpt: str, dst: str) -> Callable[[], Any]:
    if name == "memtree convert":
        fn, _ = _memtree_convert()
        assert fn is not None
        return lambda: fn(ckpt, dst)
    mmap = "(mmap)" in name

    def load() -> tuple[list[Any], list[torch.Tensor]]:
        sd = torch.load(ckpt, weights_only=True, mmap=mmap)
        layout = [(tuple(k.split(".")), tuple(t.shape), t.dtype) for k, t in sd.items()]
        return layout, list(sd.values())

    kind = "memtree" if "memtree" in name else "tensordict" if "tensordict" in name else "raw"
    store = Store(name, kind)
    return lambda: save(store, *load(), dst)


def run_system(name: str, cfg: dict[str, Any]) -> list[Result]:
    if name == "memtree convert":
        fn, why = _memtree_convert()
        if fn is None:
            return [Result("w5", name, "*", note=why)]
    if "tensordict" in name:
        try:
            import tensordict  # noqa: F401
        except ImportError as err:
            return [Result("w5", name, "*", note=f"N/A: {err}")]
    settings = Settings(**cfg["settings"])
    ckpt = _ckpt(cfg)
    dst = os.path.join(os.path.dirname(ckpt), "out_" + name.replace(" ", "_").replace("/", "_"))
    convert = _converter(name, ckpt, dst)
    rows: list[Result] = []

    def setup() -> None:
        remove(dst)
        os.sync()

    for cache in caches(settings):
        sec, runs, rss, anon, note = measure(
            settings,
            lambda _: convert(),
            setup=setup,
            cold_paths=(lambda: [ckpt]) if cache == "cold" else None,
        )
        app, alloc, files = disk_usage([dst])
        rows.append(
            Result(
                "w5",
                name,
                "convert",
                cache,
                sec,
                runs,
                rss,
                anon,
                app,
                alloc,
                files,
                "raw" in name,
                note,
            )
        )
    remove(dst)
    return rows
