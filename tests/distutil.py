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
from collections.abc import Iterator
from typing import Any, Callable

import pytest
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
import memtree.format.chunks  # noqa: E402

FORK = mp.get_context("fork")
#: How long a collective waits for the other ranks (a killed rank is noticed at once; this bounds
#: a hung one). Generous: the CI machine may be loaded.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
#: How long the parent waits for a whole run.
RUN_TIMEOUT = 240.0


#: The checksummed chunk size of the collective writes in the tests (a writer's default is
#: ``memtree.format.chunks.CHUNK_BYTES``, 4 MiB): leaves of a few MiB span several chunks.
TEST_CHUNK_BYTES = 1 << 20


@pytest.fixture(scope="module")
def mib_chunks() -> Iterator[int]:
    """Writes of the test module (the forked ranks inherit it) record chunks of
    :data:`TEST_CHUNK_BYTES`; a module imports it as ``pytestmark``'s ``usefixtures``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memtree.format.chunks, "CHUNK_BYTES", TEST_CHUNK_BYTES)
        yield TEST_CHUNK_BYTES


class RankError(AssertionError):
    """Some rank failed: ``results`` holds what each rank returned, ``errors`` each traceback,
    ``codes`` each exit code."""

    def __init__(self, message: str, results: dict[int, Any], errors: dict[int, str], codes: dict[int, int | None]):
        super().__init__(message)
        self.results, self.errors, self.codes = results, errors, codes


def _report(out: str, work: Callable[[], Any]) -> None:
    """Run ``work`` in a rank and report what it returned (or its traceback) in the file ``out``;
    leave with ``os._exit``."""
    code = 0
    try:
        torch.set_num_threads(1)  # several ranks on 2 cores: no oversubscribed intra-op threads
        result: tuple[str, Any] = ("ok", work())
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


def _child(rank: int, world: int, rendezvous: str, out: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    def work() -> Any:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        return fn(rank, world, *args)

    _report(out, work)


def _script_child(rank: int, world: int, port: int, cwd: str, code: Any, out: str) -> None:
    def work() -> None:
        os.chdir(cwd)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        exec(code, {"__name__": "__main__"})

    _report(out, work)


def _run(world: int, target: Callable[..., None], args: Callable[[int, str], tuple[Any, ...]], timeout: float) -> list[Any]:
    """Fork ``world`` ranks running ``target(*args(rank, result file))`` and wait for them (a rank
    still running at the deadline is killed); every rank's result, in rank order.

    Raises:
        RankError: a rank raised, died or hung (what the others returned is in it).
    """
    work = tempfile.mkdtemp(prefix="memtree-ranks-")
    procs = [FORK.Process(target=target, args=args(r, f"{work}/result-{r}"), daemon=True) for r in range(world)]
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
    if errors:
        raise RankError("\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items())),
                        results, errors, {r: p.exitcode for r, p in enumerate(procs)})
    return [results[r] for r in range(world)]


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = RUN_TIMEOUT) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` gloo ranks; every rank's return value, in rank order.

    Raises:
        RankError: a rank raised, died or hung (what the others returned is in it).
    """
    rendezvous = tempfile.mkdtemp(prefix="memtree-pg-")
    return _run(world, _child, lambda r, out: (r, world, f"{rendezvous}/pg", out, fn, args), timeout)


def run_script(world: int, source: str, filename: str, cwd: str, timeout: float = RUN_TIMEOUT) -> None:
    """Run the Python script ``source`` on ``world`` ranks as ``torchrun`` would start it (the
    environment variables ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``: the script
    calls ``init_process_group`` itself), each a forked process in ``cwd``.

    Raises:
        RankError: a rank raised, died or hung.
    """
    import socket

    code = compile(source, filename, "exec")
    with socket.socket() as s:  # a free port for the script's TCP store (rank 0 binds it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    _run(world, _script_child, lambda r, out: (r, world, port, cwd, code, out), timeout)
