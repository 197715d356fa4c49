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

Warm and cold (the checkpoint evicted and checked with ``mincore`` before every run), in
interleaved rounds; each run writes to a fresh path (the previous output deleted and
``os.sync()`` called, untimed), and its output is read back and compared with the data.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable, Iterator

import torch

from checks import expect_digests
from harness import Comparison, System, remove, slug, wanted
from stores import Handle, Store, expected, flat_name, make_tensors, prepare_index, reading_store, save, w1_layout

ROWS = [
    "memtree convert",
    "torch.load + memtree memmap",
    "torch.load(mmap) + memtree memmap",
    "torch.load + tensordict memmap",
    "torch.load(mmap) + tensordict memmap",
    "torch.load(mmap) + raw write",
]


def _ckpt(cfg: dict[str, Any]) -> str:
    return os.path.join(cfg["workdir"], "w5", "ckpt.pt")


def describe(cfg: dict[str, Any]) -> str:
    return f"a torch.save checkpoint of W1's {len(w1_layout(cfg))} tensors"


def comparisons(cfg: dict[str, Any]) -> Iterator[Comparison]:
    """Write the checkpoint once, then convert it with every system, warm and cold."""
    os.makedirs(os.path.dirname(_ckpt(cfg)), exist_ok=True)
    layout = w1_layout(cfg)
    prepare_index(layout)
    tensors = make_tensors(layout, seed=5)
    torch.save({flat_name(k): t for (k, _, _), t in zip(layout, tensors)}, _ckpt(cfg))
    want = {flat_name(k): d for k, d in expected(layout, tensors).items()}
    del tensors
    for cache in cfg["caches"]:
        yield Comparison("convert", cache, [_system(name, cfg, want) for name in ROWS if wanted(name, cfg)])


def _kind(name: str) -> str:
    return "memtree" if "memtree" in name else "tensordict" if "tensordict" in name else "raw"


def _system(name: str, cfg: dict[str, Any], want: dict[str, Any]) -> System:
    ckpt = _ckpt(cfg)
    dst = os.path.join(os.path.dirname(ckpt), "out_" + slug(name))
    missing = Store(name, _kind(name)).missing()
    if name == "memtree convert" and missing is None:
        fn, why = _memtree_convert()
        missing = why if fn is None else None
    convert = _converter(name, ckpt, dst) if missing is None else None
    layout = w1_layout(cfg)

    def setup() -> None:
        remove(dst)
        os.sync()

    def check(_: Any, out: Any) -> None:
        del out
        h = Handle(reading_store(Store(name, _kind(name))), layout, dst)
        try:
            expect_digests(lambda k: h.get(tuple(k.split("."))), want, f"{name}: the converted files")
        finally:
            h.close()

    return System(
        name,
        run=lambda _: convert() if convert is not None else None,
        check=check,
        setup=setup,
        files=[ckpt],
        limit="raw" in name,
        missing=missing,
        output=[dst],
    )


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

    store = Store(name, _kind(name))
    return lambda: save(store, *load(), dst)
