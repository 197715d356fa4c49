"""W1 (big tensors) and W2 (many small leaves): save, open, touch every byte, read one tensor.

The systems are ``stores.store_systems``. Comparisons, each in interleaved rounds
(``harness.compare``), every timed run checked against the digests of the data:

* ``save``: every saving system writes the same tensors to a fresh path (the previous output
  deleted and ``os.sync()`` called first, untimed: no system pays another's writeback); no
  system fsyncs (the same durability: the page cache). Each save is read back with the
  format's reader and compared key by key.
* ``open``, ``open+touch`` (a float sum over every tensor: the same work for every system),
  ``open+read one`` (one tensor copied out), warm and cold: each reading system opens the
  files its producer saved; after each run every tensor it hands out (or the one read) is
  compared with the data.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import torch

from checks import CheckFailed, digest, expect_digests
from harness import Comparison, System, Unsupported, remove, slug, wanted
from stores import (
    Handle,
    Key,
    Layout,
    Store,
    expected,
    make_tensors,
    prepare_index,
    read_one,
    reading_store,
    save,
    store_systems,
    touch_all,
    w1_layout,
    w2_layout,
)


def _one_key(name: str, layout: Layout) -> Key:
    if name == "w1":  # the middle block's first MLP weight
        blocks = {k[1] for k, _, _ in layout if k[0] == "layers"}
        return ("layers", str(len(blocks) // 2), "mlp", "fc1", "weight")
    return layout[len(layout) // 2][0]


def _wait_for_removals() -> None:
    """memtree deletes an overwritten tree's old copy in the background: never during a run."""
    import memtree.store.writing.write

    memtree.store.writing.write.wait_for_removals()


class StoreWorkload:
    """W1 or W2: ``describe(cfg)`` and ``comparisons(cfg)``, like every workload module."""

    def __init__(self, name: str, layout: Callable[[dict[str, Any]], Layout]) -> None:
        self.name = name
        self.layout = layout

    def stores(self) -> list[Store]:
        return store_systems(many_files=self.name != "w1")  # W2, W11: the bare file creation too

    def describe(self, cfg: dict[str, Any]) -> str:
        layout = self.layout(cfg)
        total = sum(torch.Size(s).numel() * 4 for _, s, _ in layout)
        return f"{len(layout)} tensors, {total / 2**20:,.1f} MiB float32"

    def comparisons(self, cfg: dict[str, Any]) -> Iterator[Comparison]:
        layout = self.layout(cfg)
        prepare_index(layout)
        wd = os.path.join(cfg["workdir"], self.name)
        os.makedirs(wd, exist_ok=True)
        stores = [s for s in self.stores() if wanted(s.name, cfg)]
        tensors = make_tensors(layout)
        want = expected(layout, tensors)
        yield Comparison("save", "", [self._saver(s, layout, tensors, want, wd) for s in stores if s.saves])
        sources: dict[str, str | None] = {}  # path of each producer's files, or why there is none
        for s in stores:
            if s.reader is None:
                continue
            src = next(x for x in self.stores() if x.name == (s.source or s.name))
            path = os.path.join(wd, slug(src.name))
            if src.name not in sources:
                sources[src.name] = _ensure_source(src, layout, tensors, path)
        del tensors
        one = _one_key(self.name, layout)
        ops: list[tuple[str, Callable[[Handle], Any]]] = [
            ("open", lambda h: None),
            ("open+touch", touch_all),
            ("open+read one", lambda h: read_one(h, one)),
        ]
        for cache in cfg["caches"]:
            for op, fn in ops:
                systems = []
                for s in stores:
                    if s.reader is None:
                        continue
                    producer = s.source or s.name
                    systems.append(self._reader(s, layout, os.path.join(wd, slug(producer)), sources[producer], op,
                                                fn, want, one))
                yield Comparison(op, cache, systems)

    def _saver(self, s: Store, layout: Layout, tensors: list[torch.Tensor], want: dict[Key, Any], wd: str) -> System:
        path = os.path.join(wd, slug(s.name))

        def setup() -> None:
            remove(path)
            _wait_for_removals()
            os.sync()  # the previous run's dirty pages must not slow this one

        def check(_: Any, out: Any) -> None:
            del out  # what the API returned (memtree: the tree, opened lazily)
            h = Handle(reading_store(s), layout, path)
            try:
                expect_digests(h.get, want, f"{s.name}: the saved files read back")
            finally:
                h.close()

        def run(_: Any) -> Any:
            try:
                return save(s, layout, tensors, path)
            except Exception as err:
                remove(path)  # no half-written source for the readers
                if s.kind in ("memtree", "raw", "raw-noprealloc", "raw-files"):
                    raise
                raise Unsupported(f"{s.name} cannot save this data ({type(err).__name__}: {err})") from err

        return System(
            s.name,
            run=run,
            check=check,
            setup=setup,
            limit=s.limit,
            missing=s.missing(),
            output=[path],
        )

    def _reader(
        self,
        s: Store,
        layout: Layout,
        path: str,
        why_not: str | None,
        op: str,
        fn: Callable[[Handle], Any],
        want: dict[Key, Any],
        one: Key,
    ) -> System:
        def run(_: Any) -> tuple[Handle, Any]:
            h = Handle(s, layout, path)
            return h, fn(h)

        def check(_: Any, out: tuple[Handle, Any]) -> None:
            h, got = out
            if op == "open+read one":
                if digest(got) != tuple(want[one]):
                    raise CheckFailed(f"{s.name}: {'.'.join(one)} read back wrong")
            else:  # every tensor the handle hands out
                expect_digests(h.get, want, f"{s.name}: {op}")

        def teardown(_: Any, out: tuple[Handle, Any] | None) -> None:
            if out is not None:
                out[0].close()

        return System(
            s.name,
            run=run,
            check=check,
            teardown=teardown,
            files=[path],
            limit=s.limit,
            missing=s.missing() or why_not,
        )


def _ensure_source(src: Store, layout: Layout, tensors: list[torch.Tensor], path: str) -> str | None:
    """Write ``src``'s files at ``path`` unless its save comparison left them; why not, or None."""
    if os.path.exists(path):
        return None
    if src.missing() is not None:
        return src.missing()
    try:
        save(src, layout, tensors, path)
    except Exception as err:  # noqa: BLE001 - an incumbent's limit is a result too
        remove(path)
        return f"N/A: {src.name} cannot save this data ({type(err).__name__}: {err})"
    return None


W1 = StoreWorkload("w1", w1_layout)
W2 = StoreWorkload("w2", w2_layout)
