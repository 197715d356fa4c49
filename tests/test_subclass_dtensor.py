"""DTensor leaves: stored as the full logical tensor with the layout annotation (format version 3).

On one process (a gloo group of world size 1) the whole path runs: the annotation on disk, a plain
load giving the full tensor, loads into a module of DTensors (filled in place or bound) giving
DTensors of the module's layout back, the Checkpointer. Two gloo ranks each read their part of a
tree's full tensors (the collective save of many ranks is the distributed issue's).
"""

from __future__ import annotations

import os
import tempfile

import orjson
import pytest
import torch
import torch.distributed as dist

import memtree

DTensor = pytest.importorskip("torch.distributed.tensor").DTensor
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402


@pytest.fixture(scope="module")
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
        try:
            yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        finally:
            dist.destroy_process_group()


def _model(mesh, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Linear(8, 4)
    m.weight = torch.nn.Parameter(distribute_tensor(m.weight.detach(), mesh, [Shard(0)]))
    m.bias = torch.nn.Parameter(distribute_tensor(m.bias.detach(), mesh, [Replicate()]))
    return m


def test_a_dtensor_is_its_full_tensor_with_its_layout_on_disk(tmp_path, mesh):
    model = _model(mesh, 0)
    memtree.TensorTree.from_module(model).memmap(tmp_path / "m")
    doc = orjson.loads((tmp_path / "m" / "meta.json").read_bytes())
    assert doc["version"] == 3
    layouts = {e["key"]: e["dtensor"] for e in doc["entries"]}
    assert layouts == {
        "weight": {"mesh": [1], "placements": [{"kind": "shard", "dim": 0}], "dim_names": ["dp"]},
        "bias": {"mesh": [1], "placements": [{"kind": "replicate"}], "dim_names": ["dp"]},
    }
    assert (tmp_path / "m" / "weight.memmap").read_bytes() == model.weight.detach().full_tensor().numpy().tobytes()
    plain = memtree.load_memmap(tmp_path / "m")["weight"]  # a plain load: the full logical tensor
    assert type(plain) is memtree.MemoryMappedTensor and torch.equal(plain, model.weight.full_tensor())


def test_a_module_of_dtensors_gets_dtensors_back(tmp_path, mesh):
    model = _model(mesh, 0)
    memtree.TensorTree.from_module(model).memmap(tmp_path / "m")
    filled = _model(mesh, 1)
    weight = filled.weight
    assert memtree.load_into_module(filled, tmp_path / "m") == memtree.LoadResult([], [])
    assert filled.weight is weight and filled.weight.placements == (Shard(0),)
    bound = _model(mesh, 2)
    memtree.load_memmap(tmp_path / "m").to_module(bound)
    for fresh in (filled, bound):
        assert isinstance(fresh.weight, DTensor) and isinstance(fresh.bias, DTensor)
        assert torch.equal(fresh.weight.full_tensor(), model.weight.full_tensor())
        assert torch.equal(fresh.bias.full_tensor(), model.bias.full_tensor())


def test_checkpointer_keeps_dtensor_state(tmp_path, mesh):
    model = _model(mesh, 0)
    ckpt = memtree.Checkpointer(tmp_path / "ck")
    ckpt.save(1, {"model": model.state_dict()})
    fresh = _model(mesh, 3)
    ckpt.restore(into={"model": fresh})
    assert isinstance(fresh.weight, DTensor) and torch.equal(fresh.weight.full_tensor(), model.weight.full_tensor())


def test_partial_dtensors_are_refused_and_strided_shards_recorded(tmp_path, mesh):
    partial = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    with pytest.raises(memtree.SubclassError, match="'p' is a DTensor with the placement P.*redistribute it first"):
        memtree.TensorTree({"p": partial}).memmap(tmp_path / "p")
    assert not (tmp_path / "p").exists()
    strided = DTensor.from_local(torch.arange(4.0), mesh, [_StridedShard(0, split_factor=2)])
    memtree.TensorTree({"s": strided}).memmap(tmp_path / "s")
    (entry,) = orjson.loads((tmp_path / "s" / "meta.json").read_bytes())["entries"]
    assert entry["dtensor"]["placements"] == [{"kind": "strided_shard", "dim": 0, "split_factor": 2}]
    assert memtree.load_memmap(tmp_path / "s")["s"].tolist() == [0.0, 1.0, 2.0, 3.0]


def _rank_loads_its_part(rank: int, world: int, tree: str, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        m = torch.nn.Linear(8, 6)
        m.weight = torch.nn.Parameter(distribute_tensor(torch.zeros(6, 8), mesh, [Shard(0)], src_data_rank=None))
        m.bias = torch.nn.Parameter(distribute_tensor(torch.zeros(6), mesh, [Replicate()], src_data_rank=None))
        local = m.weight.to_local()
        memtree.load_into_module(m, tree)
        assert m.weight.to_local() is local or m.weight.to_local().data_ptr() == local.data_ptr()
        torch.save({"w": m.weight.to_local().clone(), "b": m.bias.to_local().clone()}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_each_load_their_part_of_the_full_tensor(tmp_path):
    full_w, full_b = torch.arange(48.0).reshape(6, 8), torch.arange(6.0)
    memtree.TensorTree({"weight": full_w, "bias": full_b}).memmap(tmp_path / "m")
    os.mkdir(tmp_path / "out")
    torch.multiprocessing.spawn(
        _rank_loads_its_part, args=(2, str(tmp_path / "m"), f"file://{tmp_path}/pg", str(tmp_path / "out")),
        nprocs=2, join=True,
    )
    for rank in range(2):
        got = torch.load(tmp_path / "out" / f"{rank}.pt")
        assert torch.equal(got["w"], full_w[3 * rank : 3 * rank + 3]) and torch.equal(got["b"], full_b)


def test_a_full_tensor_writer_records_only_a_layout_that_loads(tmp_path, mesh):
    """A writer that stores a DTensor's full tensor (not the collective memmap) records a layout
    the reader accepts: Shard(-1) as the dim it shards; a mesh dim name meta.json cannot hold is
    refused before anything is written (main wrote it, and load_memmap refused the tree)."""
    from memtree.integrations.trees import save_tree

    w = distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(-1)])
    save_tree(str(tmp_path / "neg"), {"w": w})
    (entry,) = orjson.loads((tmp_path / "neg" / "meta.json").read_bytes())["entries"]
    assert entry["dtensor"]["placements"] == [{"kind": "shard", "dim": 1}]
    assert torch.equal(memtree.load_memmap(tmp_path / "neg")["w"], torch.arange(8.0).reshape(2, 4))
    named = init_device_mesh("cpu", (1,), mesh_dim_names=("data-parallel",))
    bad = distribute_tensor(torch.ones(2), named, [Replicate()])
    with pytest.raises(memtree.SubclassError, match="leaf 'w': meta.json's dtensor.dim_names .*Python identifiers"):
        save_tree(str(tmp_path / "names"), {"w": bad})
    assert not (tmp_path / "names").exists()
