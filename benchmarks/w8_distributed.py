"""W8 distributed: an FSDP2 model on 2 gloo ranks saved into one consolidated artifact, then loaded.

Every run forks :data:`RANKS` ranks (processes of this one: torch is imported once) that join a
gloo process group and build the same GPT-like model from a seed, sharded by FSDP2 (untimed);
each rank then times its part between two barriers and reports its seconds and the bytes its
system calls read and wrote (``rchar``/``wchar`` of ``/proc/self/io``). A row's time is the
slowest rank's plus, for DCP, the consolidation that makes one artifact a single process can
load (the step memtree does not need).

Comparisons (``python benchmarks/run.py w8``):

* ``save to a consolidated artifact``:
  ``memtree collective`` (``TensorTree.from_module(model).memmap(d)``: each rank writes its shards
  into the shared leaf files, rank 0 commits once), ``memtree.dcp`` (memtree's DCP storage: a
  memtree directory too), ``DCP + consolidation`` (``dcp.save`` with ``FileSystemWriter``, then
  rank 0 ``dcp_to_torch_save`` and a ``.safetensors`` file of it), ``DCP HF consolidated``
  (``HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True)``);
* ``load into FSDP2``: each artifact loaded into a freshly built sharded model:
  ``load_into_module`` (each rank reads its own byte ranges), ``memtree.dcp.load``, DCP's
  ``FileSystemReader`` (of the sharded ``.distcp`` files) and ``HuggingFaceStorageReader`` (of
  the consolidated files).

Checked: every saved artifact holds the model's full tensors bit for bit (read back in this
process); every load gives each parameter's full tensor bit for bit (gathered on rank 0 after the
timed part). Metrics per row: ``max/min rank time`` (the goal is <= 1.2), ``bytes written per
rank`` / ``bytes read per rank`` (the most of any rank), ``consolidation s``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch._dynamo  # noqa: F401 - what the ranks import on first use, imported once before they fork
import torch.distributed.checkpoint  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
from torch import nn

import memtree.dcp  # noqa: F401
import memtree.dist.read  # noqa: F401
import memtree.dist.write  # noqa: F401
from checks import CheckFailed, digests, expect_digests
from harness import Comparison, System, remove, wanted

RANKS = 2
FORK = mp.get_context("fork")
SAVERS = ["memtree collective", "memtree.dcp", "DCP + consolidation", "DCP HF consolidated"]
#: Each saver's artifact, by the name of its loader.
LOADERS = {"memtree collective": "memtree load_into_module", "memtree.dcp": "memtree.dcp load",
           "DCP + consolidation": "DCP FileSystemReader", "DCP HF consolidated": "DCP HF reader"}


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class Model(nn.Module):
    def __init__(self, layers: int, d: int, vocab: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))


def dims_for(cfg: dict[str, Any]) -> dict[str, int]:
    """The model for ``cfg["size_gib"]`` GiB of float32 weights (quick: a tiny one)."""
    if cfg["quick"]:
        return {"layers": 2, "d": 64, "vocab": 100}
    per_layer = 12 * 1024 * 1024 + 9 * 1024
    return {"layers": max(1, round((cfg["size_gib"] * (1 << 30) / 4 - 32000 * 1024) / per_layer)),
            "d": 1024, "vocab": 32000}


def describe(cfg: dict[str, Any]) -> str:
    dims = dims_for(cfg)
    return f"FSDP2 on {RANKS} gloo ranks, a model of {dims['layers']} blocks of d={dims['d']} (float32)"


def reference(dims: dict[str, int]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Model(**dims).state_dict()


# -- ranks ----------------------------------------------------------------------------------


def _io() -> tuple[int, int]:
    with open("/proc/self/io") as f:
        fields = dict(line.split(": ") for line in f.read().splitlines())
    return int(fields["rchar"]), int(fields["wchar"])


def _rank(rank: int, rendezvous: str, out: str, work: Callable[[int, Any], Any], dims: dict[str, int]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    code = 0
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=RANKS,
                                timeout=timedelta(seconds=600))
        mesh = init_device_mesh("cpu", (RANKS,))
        torch.manual_seed(0 if work is not _load_any else 1)  # a load must replace every value
        model = Model(**dims)
        fully_shard(model, mesh=mesh)
        dist.barrier()
        reads, writes = _io()
        start = time.perf_counter()
        extra = work(rank, model)
        seconds = time.perf_counter() - start
        reads2, writes2 = _io()
        dist.barrier()
        full = {n: p.full_tensor() for n, p in model.named_parameters()}  # untimed: the check
        result = ("ok", {"seconds": seconds, "read": reads2 - reads, "written": writes2 - writes,
                         "extra": extra, "digests": digests(full) if rank == 0 else None})
    except BaseException:  # noqa: BLE001 - reported to the parent
        result, code = ("error", traceback.format_exc()), 1
    with open(f"{out}.tmp", "wb") as f:
        pickle.dump(result, f)
    os.rename(f"{out}.tmp", out)
    os._exit(code)


def run_ranks(work: Callable[[int, Any], Any], dims: dict[str, int], timeout: float = 1800) -> list[dict[str, Any]]:
    """``work(rank, model)`` timed on every rank; each rank's report."""
    tmp = tempfile.mkdtemp(prefix="w8-")
    procs = [FORK.Process(target=_rank, args=(r, f"{tmp}/pg", f"{tmp}/{r}", work, dims)) for r in range(RANKS)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    reports = []
    for r in range(RANKS):
        try:
            with open(f"{tmp}/{r}", "rb") as f:
                kind, value = pickle.load(f)
        except FileNotFoundError:
            raise RuntimeError(f"rank {r} reported nothing (exit code {procs[r].exitcode})") from None
        if kind != "ok":
            raise RuntimeError(f"rank {r} failed:\n{value}")
        reports.append(value)
    shutil.rmtree(tmp, ignore_errors=True)
    return reports


# -- what each system does on a rank --------------------------------------------------------

_TARGET: dict[str, str] = {}  # the current run's artifact (set before the ranks are forked)


def _save_memtree(rank: int, model: nn.Module) -> None:
    import memtree

    memtree.TensorTree.from_module(model).memmap(_TARGET["path"])


def _save_memtree_dcp(rank: int, model: nn.Module) -> None:
    import memtree.dcp

    memtree.dcp.save(model.state_dict(), _TARGET["path"])


def _save_dcp(rank: int, model: nn.Module) -> float:
    """``dcp.save``, then rank 0 consolidates (its time is returned and added to the row's)."""
    import safetensors.torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp.save(model.state_dict(), storage_writer=dcp.FileSystemWriter(_TARGET["path"] + ".distcp"))
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        dcp_to_torch_save(_TARGET["path"] + ".distcp", _TARGET["path"] + ".pt")
        state = torch.load(_TARGET["path"] + ".pt", weights_only=True)
        safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, _TARGET["path"])
    return time.perf_counter() - start


def _save_dcp_hf(rank: int, model: nn.Module) -> None:
    import torch.distributed.checkpoint as dcp

    names = list(model.state_dict())
    writer = dcp.HuggingFaceStorageWriter(_TARGET["path"], fqn_to_index_mapping={n: 1 for n in names},
                                          save_distributed=True, enable_consolidation=True)
    dcp.save(model.state_dict(), storage_writer=writer)


def _load_any(rank: int, model: nn.Module) -> None:
    import memtree
    import memtree.dcp
    import torch.distributed.checkpoint as dcp

    kind, path = _TARGET["kind"], _TARGET["path"]
    if kind == "memtree collective":
        memtree.load_into_module(model, path)
    elif kind == "memtree.dcp":
        memtree.dcp.load(model.state_dict(), path)
    elif kind == "DCP + consolidation":
        dcp.load(model.state_dict(), storage_reader=dcp.FileSystemReader(path + ".distcp"))
    else:
        dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(path))


SAVE_WORK = {"memtree collective": _save_memtree, "memtree.dcp": _save_memtree_dcp,
             "DCP + consolidation": _save_dcp, "DCP HF consolidated": _save_dcp_hf}


def _saved_tensors(kind: str, path: str) -> dict[str, torch.Tensor]:
    """What a single process finds in an artifact: the consolidated full tensors."""
    import memtree
    import memtree.interop

    if kind.startswith("memtree"):
        tree = memtree.load_memmap(path, mode="r")
        return {k if isinstance(k, str) else ".".join(k): v for k, v in tree.items(include_nested=True, leaves_only=True)}
    if kind == "DCP HF consolidated":
        path = os.path.join(path, "model-00001-of-00001.safetensors")
    return dict(memtree.interop.open_checkpoint(path).items())


def _metrics(reports: list[dict[str, Any]]) -> dict[str, float]:
    times = [r["seconds"] for r in reports]
    return {"max/min rank time": max(times) / max(min(times), 1e-9),
            "bytes read per rank": max(r["read"] for r in reports),
            "bytes written per rank": max(r["written"] for r in reports)}


# -- systems ----------------------------------------------------------------------------------


def _saver(kind: str, dims: dict[str, int], want: dict[str, Any], wd: str) -> System:
    path = os.path.join(wd, kind.replace(" ", "_").replace("+", "p").replace(".", "_"))

    def setup() -> str:
        for p in (path, path + ".distcp", path + ".pt"):
            remove(p)
        return path

    def run(_: str) -> tuple[float, list[dict[str, Any]]]:
        _TARGET.update(path=path, kind=kind)
        reports = run_ranks(SAVE_WORK[kind], dims)
        return max(r["seconds"] for r in reports), reports  # rank 0's includes any consolidation

    def check(_: str, reports: list[dict[str, Any]]) -> dict[str, float]:
        expect_digests(_saved_tensors(kind, path), want, f"{kind}'s artifact")
        out = _metrics(reports)
        out["consolidation s"] = max(r["extra"] or 0.0 for r in reports)
        return out

    return System(kind, run, check, setup=setup, own_time=True, output=[path])


def _loader(kind: str, dims: dict[str, int], want: dict[str, Any], wd: str) -> System:
    path = os.path.join(wd, kind.replace(" ", "_").replace("+", "p").replace(".", "_"))

    def run(_: Any) -> tuple[float, list[dict[str, Any]]]:
        _TARGET.update(path=path, kind=kind)
        reports = run_ranks(_load_any, dims)
        return max(r["seconds"] for r in reports), reports

    def check(_: Any, reports: list[dict[str, Any]]) -> dict[str, float]:
        if reports[0]["digests"] != want:
            wrong = sorted(k for k in want if reports[0]["digests"].get(k) != want[k])
            raise CheckFailed(f"{LOADERS[kind]}: wrong values in {len(wrong)} of {len(want)} parameters: {wrong[:5]}")
        return _metrics(reports)

    return System(LOADERS[kind], run, check, own_time=True)


def comparisons(cfg: dict[str, Any]) -> Iterator[Comparison]:
    wd = os.path.join(cfg["workdir"], "w8")
    os.makedirs(wd, exist_ok=True)
    dims = dims_for(cfg)
    want = digests(reference(dims))
    kinds = [k for k in SAVERS if wanted(k, cfg) or wanted(LOADERS[k], cfg)]
    yield Comparison("save to a consolidated artifact", "", [_saver(k, dims, want, wd) for k in kinds])
    yield Comparison("load into FSDP2", "warm", [_loader(k, dims, want, wd) for k in kinds])
    shutil.rmtree(wd, ignore_errors=True)
