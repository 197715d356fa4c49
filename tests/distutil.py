"""Run a test function on several gloo ranks, each a forked process of the test (torch is already
imported: a rank starts in a fraction of a second, where a spawned one imports torch again).

``run_ranks(world, fn, *args)`` forks ``world`` processes; each joins a gloo process group
(``file://`` rendezvous in a fresh directory, loopback only, a timeout on every collective), runs
``fn(rank, world, *args)`` and reports what it returned (pickled: these are the tests' own values)
or its traceback through a file. The parent waits for every rank with a deadline: a rank that
hangs is killed and reported, so a broken collective fails the test instead of hanging the suite.
Every rank that returns leaves with ``os._exit`` (gloo's threads must not outlive the
interpreter's teardown, see ``tests/test_dcp.py``).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

# What the ranks import on first use, imported once here so that each forked rank has it
# (distribute_tensor alone imports torch._dynamo: seconds per rank otherwise).
import torch._dynamo  # noqa: E402,F401
import torch.distributed.checkpoint.state_dict  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
import torch.distributed.tensor  # noqa: E402,F401
import torch.distributed.tensor.parallel  # noqa: E402,F401

import memtree.dist.read  # noqa: E402,F401
import memtree.dist.write  # noqa: E402,F401

FORK = mp.get_context("fork")
#: How long a collective waits for the other ranks (a killed rank is noticed at once; this bounds
#: a hung one). Generous: the CI machine may be loaded.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
#: How long the parent waits for a whole run.
RUN_TIMEOUT = 240.0


class RankError(AssertionError):
    """Some rank failed: ``results`` holds what each rank returned, ``errors`` each traceback,
    ``codes`` each exit code."""

    def __init__(self, message: str, results: dict[int, Any], errors: dict[int, str], codes: dict[int, int | None]):
        super().__init__(message)
        self.results, self.errors, self.codes = results, errors, codes


def _child(rank: int, world: int, rendezvous: str, out: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    code = 0
    try:
        torch.set_num_threads(1)  # several ranks on 2 cores: no oversubscribed intra-op threads
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result, code = ("error", traceback.format_exc()), 1
    try:
        with open(f"{out}.tmp", "wb") as f:
            pickle.dump(result, f)
        os.rename(f"{out}.tmp", out)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = RUN_TIMEOUT) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; every rank's return value, in rank order.

    Raises:
        RankError: a rank raised, died or hung (what the others returned is in it).
    """
    work = tempfile.mkdtemp(prefix="memtree-ranks-")
    procs = [
        FORK.Process(target=_child, args=(r, world, f"{work}/pg", f"{work}/result-{r}", fn, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        os.kill(procs[r].pid, signal.SIGKILL)
        procs[r].join()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    for r in range(world):
        try:
            with open(f"{work}/result-{r}", "rb") as f:
                kind, value = pickle.load(f)
        except FileNotFoundError:
            errors[r] = f"rank {r} reported nothing (exit code {procs[r].exitcode}{', hung: killed' if r in hung else ''})"
            continue
        if kind == "ok":
            results[r] = value
        else:
            errors[r] = value
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    if errors or hung:
        raise RankError(
            "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items())) or "ranks hung",
            results, errors, codes,
        )
    return [results[r] for r in range(world)]
