"""memtree.dcp: torch.distributed.checkpoint storage as a memtree directory, no pickle.

Single-process round trips, then gloo process groups of 2 and 3 ranks started with
torch.multiprocessing.spawn (file:// rendezvous, loopback only): save sharded DTensors from 2
ranks, open the directory with memtree.load_memmap, reshard on load to 1 and to 3 ranks, and a
failure on one rank that must commit nothing. Each spawning test has a timeout, so a hung
collective fails instead of hanging the suite; the timeouts are generous and each rank that passed
leaves with os._exit (see ``_exit_without_teardown``), so a loaded machine does not fail them.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import memtree
import memtree.dcp as mdcp
from memtree.dcp import writer as dcp_writer

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def full_tensors() -> dict[str, torch.Tensor]:
    """The global tensors every process can rebuild bit for bit (fixed seed)."""
    g = torch.Generator().manual_seed(1234)
    return {
        "w": torch.randn(7, 5, generator=g),  # 7 rows: uneven shards on 2 and 3 ranks
        "v": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(2**40), 2**40, (9,), generator=g),
        "b": torch.randn(3, dtype=torch.float64, generator=g),
        "e": torch.empty(0, 2),
    }


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
    )


def plain_state() -> dict:
    f = full_tensors()
    return {"model": {"w": f["w"], "v": f["v"], "b": f["b"]}, "i": f["i"], "e": f["e"],
            "step": 11, "cfg": {"lr": 0.25, "names": ["x", "y"]}}


def zero_state() -> dict:
    return {"model": {"w": torch.zeros(7, 5), "v": torch.zeros(4, 6, dtype=torch.bfloat16),
                      "b": torch.zeros(3, dtype=torch.float64)},
            "i": torch.zeros(9, dtype=torch.int64), "e": torch.empty(0, 2),
            "step": 0, "cfg": {"lr": 0.0, "names": []}}


def check_loaded(state: dict) -> None:
    f = full_tensors()
    for key, got in [("w", state["model"]["w"]), ("v", state["model"]["v"]), ("b", state["model"]["b"]),
                     ("i", state["i"]), ("e", state["e"])]:
        full = got.full_tensor() if hasattr(got, "full_tensor") else got
        assert bit_equal(full, f[key]), key
    assert state["step"] == 11 and state["cfg"] == {"lr": 0.25, "names": ["x", "y"]}


# ---------------------------------------------------------------------------------------------
# one process


def test_round_trip_in_one_process_and_the_directory_is_a_memtree(tmp_path):
    path = str(tmp_path / "ckpt")
    mdcp.save(plain_state(), path)
    names = sorted(os.listdir(path))
    assert names == ["cfg", "dcp.json", "e.memmap", "i.memmap", "meta.json", "model"]
    tree = memtree.load_memmap(path, mode="r")
    f = full_tensors()
    assert bit_equal(tree["model", "w"], f["w"]) and bit_equal(tree["model", "v"], f["v"])
    assert tree["step"] == 11 and tree["cfg", "names"] == ["x", "y"]
    target = zero_state()
    mdcp.load(target, path)
    check_loaded(target)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging directory or lock file left


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_stock_planners_never_pickle(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.save/torch.load must not be used")

    monkeypatch.setattr(torch, "save", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    path = str(tmp_path / "ckpt")
    dcp.save(plain_state(), storage_writer=mdcp.Writer(path), no_dist=True)  # DCP's default planner
    target = zero_state()
    dcp.load(target, storage_reader=mdcp.Reader(path), no_dist=True)
    check_loaded(target)
    for dirpath, _, files in os.walk(path):
        for name in files:
            assert name.endswith((".memmap", ".json")), name


def test_non_json_value_is_refused_and_nothing_is_committed(tmp_path):
    path = str(tmp_path / "ckpt")
    state = plain_state()
    state["obj"] = {1, 2}  # JSON has no sets
    with pytest.raises(memtree.DistributedCheckpointError, match="set") as info:
        mdcp.save(state, path)
    assert isinstance(info.value, memtree.MemtreeError)
    assert isinstance(info.value.failures[0], memtree.NonTensorValueError)
    assert os.listdir(tmp_path) == []


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_pickling_planner_is_refused(tmp_path):
    class PicklingPlanner(dcp.DefaultSavePlanner):
        def transform_object(self, write_item, object):  # noqa: A002
            if write_item.type == dcp.planner.WriteItemType.BYTE_IO:
                buf = io.BytesIO()
                pickle.dump(object, buf)
                return buf
            return object

    writer = mdcp.Writer(str(tmp_path / "ckpt"))
    with pytest.raises(dcp.api.CheckpointException) as info:
        dcp.save(plain_state(), storage_writer=writer, planner=PicklingPlanner(), no_dist=True)
    (err, _), = info.value.failures.values()
    assert isinstance(err, memtree.NonTensorValueError)
    writer.abort()
    assert os.listdir(tmp_path) == []


class _Boom:
    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_planted_pickle_metadata_is_never_read(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    mdcp.save(plain_state(), path)
    marker = str(tmp_path / "pwned")
    boom = _Boom()
    boom.marker = marker
    payload = pickle.dumps(boom)
    for name in (".metadata", "__0_0.distcp"):
        with open(os.path.join(path, name), "wb") as f:
            f.write(payload)

    def refuse(*args, **kwargs):
        raise AssertionError("nothing may be unpickled")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    target = zero_state()
    mdcp.load(target, path)
    check_loaded(target)
    assert not os.path.exists(marker)


def test_damaged_dcp_json_is_a_clear_error(tmp_path):
    path = str(tmp_path / "ckpt")
    mdcp.save(plain_state(), path)
    with open(os.path.join(path, "dcp.json"), "r+b") as f:
        f.truncate(40)
    with pytest.raises(memtree.DistributedCheckpointError, match="dcp.json"):
        mdcp.load(zero_state(), path)
    os.remove(os.path.join(path, "dcp.json"))
    with pytest.raises(memtree.DistributedCheckpointError, match="not a distributed checkpoint"):
        mdcp.load(zero_state(), path)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_parity_with_dcps_own_file_storage(tmp_path):
    state = plain_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    mdcp.save(state, str(tmp_path / "ours"))
    stock, ours = zero_state(), zero_state()
    dcp.load(stock, storage_reader=dcp.FileSystemReader(str(tmp_path / "stock")), no_dist=True)
    mdcp.load(ours, str(tmp_path / "ours"))
    assert ours["step"] == stock["step"] and ours["cfg"] == stock["cfg"]
    for a, b in [(ours["model"][k], stock["model"][k]) for k in ("w", "v", "b")] + [(ours["i"], stock["i"])]:
        assert bit_equal(a, b)


def test_chunk_runs_cover_exactly_the_chunk():
    full = torch.arange(4 * 5 * 6, dtype=torch.int32).reshape(4, 5, 6)
    for offsets, sizes in [((1, 0, 0), (2, 5, 6)), ((0, 2, 0), (4, 3, 6)), ((1, 1, 2), (3, 2, 3)), ((0, 0, 0), (4, 5, 6))]:
        chunk = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].contiguous()
        starts, run = dcp_writer._runs(tuple(full.shape), offsets, sizes, 4)
        flat = full.reshape(-1).view(torch.uint8)
        pieces = [flat[s : s + run] for s in starts]
        assert torch.equal(torch.cat(pieces), chunk.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# gloo process groups


#: How long a rank waits for the others (rendezvous, each collective): spawned ranks finish
#: importing torch seconds apart, and the others wait while the coordinator fsyncs; load
#: stretches both. A hang still fails.
GLOO_TIMEOUT = timedelta(seconds=180)


def _init(rank: int, world: int, rendezvous: str) -> None:
    torch.set_num_threads(1)  # up to 3 ranks on 2 cores: no oversubscribed intra-op threads
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)


def _exit_without_teardown() -> None:
    """End a rank that passed every check, skipping interpreter finalization.

    ``destroy_process_group`` does not free a gloo group that something still references (the
    DTensors' mesh, a traceback), so its worker threads outlive ``fn``; one that drops its last
    work (a tensor with a Python object) after ``Py_Finalize`` began cannot take the GIL, and the
    thread's forced unwind ends in ``std::terminate``: a rank that passed died with SIGABRT
    (``ProcessExitedException``), more often under load. A failing rank raises as before and
    spawn reports its traceback.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _sharded_state(world: int, zeros: bool, v_dim: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    f = {k: torch.zeros_like(v) for k, v in full_tensors().items()} if zeros else full_tensors()
    return {
        "model": {
            "w": distribute_tensor(f["w"], mesh, [Shard(0)]),
            "v": distribute_tensor(f["v"], mesh, [Shard(v_dim)]),
            "b": f["b"].clone(),  # a plain tensor, the same on every rank
        },
        "i": distribute_tensor(f["i"], mesh, [Replicate()]),
        "e": f["e"],
        "step": 0 if zeros else 11,
        "cfg": {"lr": 0.0, "names": []} if zeros else {"lr": 0.25, "names": ["x", "y"]},
    }


def _save_worker(rank: int, world: int, tmp: str) -> None:
    """A save that fails on rank 1 (must commit nothing), then a good one (one spawn for both)."""
    _init(rank, world, os.path.join(tmp, "pg-save"))
    try:
        good = dcp_writer._write_chunk
        if rank == 1:
            def broken(*args, **kwargs):
                raise OSError(5, "injected write failure")

            dcp_writer._write_chunk = broken
        with pytest.raises(memtree.DistributedCheckpointError, match="injected write failure") as info:
            mdcp.save(_sharded_state(world, zeros=False, v_dim=1), os.path.join(tmp, "faulty"))
        assert set(info.value.failures) == {1}
        dcp_writer._write_chunk = good
        mdcp.save(_sharded_state(world, zeros=False, v_dim=1), os.path.join(tmp, "ckpt"))
    finally:
        dist.destroy_process_group()
    _exit_without_teardown()


def _load_worker(rank: int, world: int, tmp: str) -> None:
    _init(rank, world, os.path.join(tmp, f"pg-load{world}"))
    try:
        state = _sharded_state(world, zeros=True, v_dim=0)  # another sharding than the save's
        mdcp.load(state, os.path.join(tmp, "ckpt"))
        check_loaded(state)
    finally:
        dist.destroy_process_group()
    _exit_without_teardown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_save_on_2_ranks_then_open_and_reshard_to_1_and_3(tmp_path):
    """2 ranks: a save failing on rank 1 commits nothing; a good save; then 2 -> 1 and 2 -> 3."""
    tmp = str(tmp_path)
    mp.spawn(_save_worker, args=(2, tmp), nprocs=2, join=True)
    assert sorted(n for n in os.listdir(tmp) if not n.startswith("pg-")) == ["ckpt"]  # no staging, no lock
    path = os.path.join(tmp, "ckpt")
    tree = memtree.load_memmap(path, mode="r")  # one process, no torch.distributed
    f = full_tensors()
    assert bit_equal(tree["model", "w"], f["w"]) and bit_equal(tree["model", "v"], f["v"])
    assert bit_equal(tree["i"], f["i"]) and tree["cfg", "lr"] == 0.25
    one = zero_state()
    mdcp.load(one, path)  # 2 -> 1
    check_loaded(one)
    mp.spawn(_load_worker, args=(3, tmp), nprocs=3, join=True)  # 2 -> 3, Shard(1) -> Shard(0)


# ---------------------------------------------------------------------------------------------
# optimizer state: model + AdamW, with the tuples of its param_groups


def _adamw_model(world_mesh=None):
    """A seeded model after one AdamW step on fixed gradients; sharded on ``world_mesh`` if given."""
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))
    grads = {n: torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, (n, p) in enumerate(model.named_parameters())}
    if world_mesh is not None:
        def shard_rows(name, module, mesh):
            for pname, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(pname, torch.nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))

        distribute_module(model, world_mesh, shard_rows)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=0.1, foreach=False)
    for n, p in model.named_parameters():
        g = grads[n]
        p.grad = distribute_tensor(g, world_mesh, [Shard(0)]) if world_mesh is not None else g
    opt.step()
    return model, opt


def _check_adamw(model, opt) -> None:
    ref_model, ref_opt = _adamw_model()
    for (n, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert bit_equal(p.detach(), q.detach()), n
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert bit_equal(opt.state[p][key], ref_opt.state[q][key]), (n, key)
    assert opt.param_groups[0]["betas"] == (0.8, 0.95) and type(opt.param_groups[0]["betas"]) is tuple
    assert opt.param_groups[0]["lr"] == 0.01 and opt.param_groups[0]["weight_decay"] == 0.1


def test_model_and_adamw_state_dicts_round_trip_with_tuples(tmp_path):
    """The issue's example: memtree.dcp.save({"model": sd, "optim": AdamW.state_dict()})."""
    model, opt = _adamw_model()
    path = str(tmp_path / "ckpt")
    mdcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    tree = memtree.load_memmap(path)
    assert tree["optim", "param_groups", "0", "betas"] == (0.8, 0.95)  # a tuple, also for load_memmap
    fresh, fresh_opt = _adamw_model()  # the same structure, other values
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    target = {"model": fresh.state_dict(), "optim": fresh_opt.state_dict()}
    target["optim"]["param_groups"][0]["betas"] = (0.0, 0.0)
    mdcp.load(target, path)
    assert type(target["optim"]["param_groups"][0]["betas"]) is tuple
    fresh.load_state_dict(target["model"])
    fresh_opt.load_state_dict(target["optim"])
    _check_adamw(fresh, fresh_opt)


def _adamw_save_worker(rank: int, world: int, tmp: str) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    _init(rank, world, os.path.join(tmp, "pg-adamw"))
    try:
        model, opt = _adamw_model(init_device_mesh("cpu", (world,)))
        msd, osd = get_state_dict(model, opt)
        mdcp.save({"model": msd, "optim": osd}, os.path.join(tmp, "ckpt"))
    finally:
        dist.destroy_process_group()
    _exit_without_teardown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adamw_sharded_on_2_ranks_loads_resharded_into_1(tmp_path):
    """Model and AdamW state as DTensors sharded on 2 gloo ranks (get_state_dict), loaded by one
    process into a plain model and optimizer: bit-equal to the same step taken unsharded."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    tmp = str(tmp_path)
    mp.spawn(_adamw_save_worker, args=(2, tmp), nprocs=2, join=True)
    assert sorted(n for n in os.listdir(tmp) if not n.startswith("pg-")) == ["ckpt"]
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, betas=(0.5, 0.5), foreach=False)
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd}
    mdcp.load(target, os.path.join(tmp, "ckpt"))
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    _check_adamw(model, opt)
