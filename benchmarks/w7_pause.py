"""W7 training checkpoints, measured by the harness: the async pause, incremental saves, adapters.

The state is ``{"model": model.state_dict(), "optim": AdamW.state_dict(), "step": n}`` of a stack
of square ``Linear`` layers after one AdamW step (``w7_checkpoints.build``: weights and both
moments). Before every run one layer and its moments change in place (untimed: 1/21 of the bytes,
the training loop's step), and the digests of the state are taken (untimed): what the checkpoint
must hold. Every save is durable (memtree ``fsync=True``; ``torch.save`` + ``os.fsync``); after
every run the checkpoint is read back and compared with those digests.

Comparisons (``python benchmarks/run.py w7``):

* ``save, {50 MB, 500 MB, 2 GB} state``: the time the training loop is blocked.
  ``copy_ into preallocated`` (the floor of any snapshot: the state copied into memory that
  exists already, what the Checkpointer's reused staging buffer does), ``clone`` (into new
  memory), ``memtree async`` (``Checkpointer(fsync=True, incremental=False).save(step, state,
  blocking=False)``: the call; right after it returns the state changes again, as training goes
  on, and the checkpoint must not see that change), ``memtree blocking`` (the same save,
  ``blocking=True``), ``torch.save`` (+ fsync). The async row's ``durable s`` metric is the time
  from the call until its future resolved.
* ``next checkpoint, 5% changed`` (1 GiB state): ``memtree blocking, full`` and ``... ,
  incremental`` (unchanged leaves hard-linked from the previous step, the Checkpointer's
  default); metric ``bytes written`` (``wchar`` of ``/proc/self/io``).
* ``10 adapter checkpoints`` (a 1 GiB frozen base + rank-8 adapters and their AdamW state):
  ``memtree incremental`` saves ten steps, one AdamW step on the adapters between two; metric
  ``disk all / disk first`` (allocated bytes as ``memtree du`` counts them).

``w7_checkpoints.py`` prints the older series table (every system, DCP included).
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any, Iterator

import torch

from checks import CheckFailed, Digest, digests, expect_digests
from harness import Comparison, System, remove, wanted
from w7_checkpoints import (
    allocated,
    build,
    build_adapters,
    change_one_layer,
    fsync_path,
    step_adapters,
    tensors_of,
    wchar,
)

#: The state sizes the issue names, in bytes (quick: tiny ones with the same names).
SIZES = {"50 MB": 50e6, "500 MB": 500e6, "2 GB": 2e9}
LAYERS = 21


def describe(cfg: dict[str, Any]) -> str:
    return "model + AdamW state of 50 MB, 500 MB and 2 GB; 1 GiB for incremental saves; adapters"


class _Training:
    """A model and its optimizer whose state changes one layer at a time."""

    def __init__(self, nbytes: float, layers: int = LAYERS) -> None:
        self.model, self.opt = build(nbytes / 2**30, layers)
        self.i = 0

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.i}

    def step(self) -> dict[str, Digest]:
        """One layer changes; returns the digests of the state now (what a save must hold)."""
        change_one_layer(self.model, self.opt, self.i)
        self.i += 1
        return digests(tensors_of(self.state()))


def _restored(root: str, step: int) -> dict[str, torch.Tensor]:
    import memtree

    return tensors_of(memtree.Checkpointer(root).restore(step))


def _checkpointer(root: str, **kw: Any) -> Any:
    """A durable Checkpointer on an empty ``root``."""
    import memtree

    remove(root)
    return memtree.Checkpointer(root, fsync=True, **kw)


def comparisons(cfg: dict[str, Any]) -> Iterator[Comparison]:
    wd = os.path.join(cfg["workdir"], "w7")
    os.makedirs(wd, exist_ok=True)
    scale = 1e-3 if cfg["quick"] else 1.0
    for size, nbytes in SIZES.items():
        training = _Training(nbytes * scale)
        systems = [s for s in _pause_systems(training, os.path.join(wd, size.replace(" ", ""))) if wanted(s.name, cfg)]
        yield Comparison(f"save, {size} state", "", systems)
        del training, systems
    # each system its own state: between two of its checkpoints exactly one layer changes
    yield Comparison("next checkpoint, 5% changed", "", [
        _series_save("memtree blocking, full", _Training(2**30 * scale), os.path.join(wd, "full"), incremental=False),
        _series_save("memtree blocking, incremental", _Training(2**30 * scale), os.path.join(wd, "incr"),
                     incremental=True),
    ])
    yield Comparison("10 adapter checkpoints", "", [_adapters(os.path.join(wd, "adapters"), scale)], rounds=1)
    shutil.rmtree(wd, ignore_errors=True)


def _pause_systems(training: _Training, wd: str) -> list[System]:
    tensors = list(tensors_of(training.state()).values())
    dst = [torch.empty_like(t) for t in tensors]
    names = list(tensors_of(training.state()))
    steps = {"async": 0, "blocking": 0}

    def copy_into(_: Any) -> list[torch.Tensor]:
        for a, b in zip(dst, tensors):
            a.copy_(b)
        return dst

    def check_copy(want: dict[str, Digest], out: list[torch.Tensor]) -> None:
        expect_digests(dict(zip(names, out)), want, "the copy of the state")

    roots = {kind: os.path.join(wd, kind) for kind in steps}
    ckpts = {kind: _checkpointer(roots[kind], incremental=False, keep_last=1) for kind in steps}

    def memtree_save(kind: str) -> System:
        ckpt = ckpts[kind]

        def run(want: dict[str, Digest]) -> Any:
            steps[kind] += 1
            t0 = time.perf_counter()
            out = ckpt.save(steps[kind], training.state(), blocking=kind == "blocking")
            return out, t0

        def check(want: dict[str, Digest], got: Any) -> dict[str, float]:
            out, t0 = got
            measured = {}
            if kind == "async":
                training.step()  # the loop goes on at once: the snapshot must not see this
                out.result()
                measured["durable s"] = time.perf_counter() - t0
            expect_digests(_restored(roots[kind], steps[kind]), want, f"memtree {kind}: the checkpoint")
            return measured

        return System(f"memtree {kind}", run=run, check=check, setup=training.step)

    torch_file = os.path.join(wd, "torch", "ckpt.pt")

    def torch_save(_: Any) -> None:
        os.makedirs(os.path.dirname(torch_file), exist_ok=True)
        torch.save(training.state(), torch_file)
        fsync_path(torch_file)

    def check_torch(want: dict[str, Digest], _: Any) -> None:
        expect_digests(tensors_of(torch.load(torch_file, weights_only=True)), want, "torch.save: the file")

    return [
        System("copy_ into preallocated", run=copy_into, check=check_copy, setup=training.step, limit=True),
        System("clone", run=lambda _: [t.clone() for t in tensors], check=check_copy, setup=training.step,
               limit=True),
        memtree_save("async"),
        memtree_save("blocking"),
        System("torch.save", run=torch_save, check=check_torch, setup=training.step),
    ]


def _series_save(name: str, training: _Training, root: str, incremental: bool) -> System:
    ckpt = _checkpointer(root, incremental=incremental, keep_last=2)
    step = [0]
    ckpt.save(0, training.state())  # the previous checkpoint every run links from

    def run(_: Any) -> int:
        step[0] += 1
        w0 = wchar()
        ckpt.save(step[0], training.state())
        return wchar() - w0

    def check(want: dict[str, Digest], written: int) -> dict[str, float]:
        expect_digests(_restored(root, step[0]), want, f"{name}: the checkpoint")
        return {"bytes written": float(written)}

    return System(name, run=run, check=check, setup=training.step)


def _adapters(root: str, scale: float) -> System:
    layers = 16
    model, opt = build_adapters(scale, layers, rank=8)
    runs = [0]

    def save_ten(_: Any) -> tuple[str, int, int, dict[str, Digest]]:
        runs[0] += 1
        where = f"{root}-{runs[0]}"
        ckpt = _checkpointer(where)
        first = 0
        for step in range(10):
            ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
            if step == 0:
                first = allocated(where)
            if step < 9:
                step_adapters(model, opt, step)
        return where, first, allocated(where), digests(tensors_of({"model": model.state_dict(),
                                                                      "optim": opt.state_dict()}))

    def check(_: Any, got: tuple[str, int, int, dict[str, Digest]]) -> dict[str, float]:
        where, first, total, want = got
        expect_digests(_restored(where, 9), want, "adapters: the last checkpoint")
        if first <= 0:
            raise CheckFailed("adapters: the first checkpoint occupies nothing")
        shutil.rmtree(where, ignore_errors=True)
        return {"disk all / disk first": total / first}

    return System("memtree incremental", run=save_ten, check=check)
