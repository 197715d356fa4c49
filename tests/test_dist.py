"""Many ranks, one tree: collective writes of DTensor trees and rank-aware reads (memtree.dist).

gloo ranks are forked processes of the test (tests/distutil.py: they start in a fraction of a
second, every collective has a timeout). Saved on N ranks, loaded on M, for every N, M in
{1, 2, 3, 4}: Shard(0), Shard(1), Replicate, 2-d meshes and _StridedShard, uneven shards, every
value compared bit for bit with what torch's own distribute_tensor gives each rank.
"""

from __future__ import annotations

import os

import orjson
import pytest
import torch
import torch.distributed as dist
from torch import nn

import memtree
import memtree.interop
from distutil import TEST_CHUNK_BYTES, run_ranks, mib_chunks  # noqa: F401 - a fixture

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.timeout(600),
    pytest.mark.usefixtures("mib_chunks"),  # chunks of 1 MiB: the leaves of a few MiB span several
]


# ---------------------------------------------------------------------------------------------
# the saved tree: global tensors every process rebuilds bit for bit, and how each is split


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(27)
    return {
        "rows": torch.randn(13, 6, generator=g),  # 13 rows: uneven on 2, 3 and 4 ranks
        "cols": torch.randn(5, 11, generator=g).to(torch.bfloat16),
        "rep": torch.randint(-(2**40), 2**40, (4, 3), generator=g),
        "big": torch.randn(600, 1024, generator=g),  # 2.4 MB: three checksummed chunks
        "wide": torch.randn(1024, 600, generator=g),  # column shards: every chunk from every rank
        "grid": torch.randn(9, 10, generator=g).to(torch.float64),
        "vec": torch.randn(7, generator=g),
    }


def saved_placements(world: int) -> dict[str, tuple[tuple[int, ...], list]]:
    """How each tensor is split when saved on ``world`` ranks: (mesh shape, placements)."""
    from torch.distributed.tensor import Replicate, Shard

    out = {
        "rows": ((world,), [Shard(0)]),
        "cols": ((world,), [Shard(1)]),
        "rep": ((world,), [Replicate()]),
        "big": ((world,), [Shard(0)]),
        "wide": ((world,), [Shard(1)]),
        "grid": ((world,), [Shard(1)]),
        "vec": ((world,), [Shard(0)]),
    }
    if world == 4:  # 2-d meshes: sharded on both dims, and replicated x sharded
        out["grid"] = ((2, 2), [Shard(0), Shard(1)])
        out["rows"] = ((2, 2), [Replicate(), Shard(0)])
    return out


def meshes(world: int) -> dict[tuple[int, ...], object]:
    from torch.distributed.device_mesh import init_device_mesh

    shapes = {(world,)} | ({(2, 2)} if world == 4 else set())
    return {shape: init_device_mesh("cpu", shape) for shape in sorted(shapes)}


def distribute(full: torch.Tensor, mesh, placements):
    """``full`` split as DTensor splits it (each rank splits its own copy: no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, mesh, placements, src_data_rank=None)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def _save(rank: int, world: int, d: str) -> int:
    full = full_tensors()
    mesh_of = meshes(world)
    tree = memtree.TensorTree({
        k: distribute(full[k], mesh_of[shape], placements) for k, (shape, placements) in saved_placements(world).items()
    })
    tree["step"] = torch.tensor(7)  # a plain tensor: the same on every rank
    tree["cfg"] = memtree.NonTensor({"lr": 0.5, "betas": [0.9, 0.95]})
    out = tree.memmap(d)
    for key, (_, placements) in saved_placements(world).items():  # what memmap returns: this rank's shards
        assert type(out[key]).__name__ == "DTensor" and list(out[key].placements) == placements
        assert same(out[key].to_local(), tree[key].to_local()), key
    assert out["step"].item() == 7 and out["cfg"] == {"lr": 0.5, "betas": [0.9, 0.95]}
    return world


def target_variants(world: int) -> list[tuple[tuple[int, ...], list]]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out = [((world,), [Shard(0)]), ((world,), [Shard(1)]), ((world,), [Replicate()])]
    if world == 4:
        out += [((2, 2), [Shard(0), Shard(1)]), ((2, 2), [Replicate(), Shard(0)]),
                ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)])]
    return out


def _fits(tensor: torch.Tensor, placements) -> bool:
    return all(not hasattr(p, "dim") or p.dim < tensor.dim() for p in placements)


class Holder(nn.Module):
    """A module whose buffers are DTensors, one per key (filled in place by load_into_module)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for key, value in tensors.items():
            self.register_buffer(key, value)


def _load(rank: int, world: int, dirs: list[str]) -> int:
    from torch.distributed.tensor import Replicate

    full = full_tensors()
    mesh_of = meshes(world)
    checks = 0
    for d in dirs:
        for shape, placements in target_variants(world):
            mesh = mesh_of[shape]
            replicated = [Replicate()] * len(placements)  # a tensor with too few dims for them
            wanted = {k: placements if _fits(v, placements) else replicated for k, v in full.items()}
            truth = {k: distribute(full[k], mesh, p) for k, p in wanted.items()}
            # load_memmap with placements: every named leaf a DTensor holding this rank's shard
            tree = memtree.load_memmap(d, mesh=mesh, placements=wanted, mode="r")
            for key, want in truth.items():
                got = tree[key]
                assert list(got.placements) == list(want.placements), (d, key)
                assert same(got.to_local(), want.to_local()), (d, key, placements)
                checks += 1
            # load_into_module: DTensor buffers filled in place, straight into their storage
            holder = Holder({k: distribute(torch.zeros_like(full[k]), mesh, p) for k, p in wanted.items()})
            before = {k: v.to_local().data_ptr() for k, v in holder.named_buffers()}
            memtree.load_into_module(holder, d, strict=False)
            for key, want in truth.items():
                got = getattr(holder, key)
                assert got.to_local().data_ptr() == before[key]  # the same storage, filled
                assert same(got.to_local(), want.to_local()), (d, key, placements)
                checks += 1
    return checks


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, str]:
    """The tree saved on 1, 2, 3 and 4 ranks (N = 0: written by one process, no process group)."""
    root = tmp_path_factory.mktemp("saved")
    dirs = {}
    for n in (1, 2, 3, 4):
        dirs[n] = str(root / f"n{n}")
        assert run_ranks(n, _save, dirs[n]) == [n] * n
    plain = memtree.TensorTree(full_tensors())
    plain["step"] = torch.tensor(7)
    dirs[0] = str(root / "plain")
    plain.memmap(dirs[0])
    return dirs


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_a_collective_save_is_one_plain_tree(saved, n, tmp_path):
    """One process loads the tree of N ranks as full tensors, zero-copy; every checksum (made from
    the ranks' pieces) verifies, and is what one process writing the full tensors records (the
    same chunks, the same digests); each DTensor leaf records its mesh and placements."""
    d = saved[n]
    tree = memtree.load_memmap(d, mode="r")
    for key, value in full_tensors().items():
        assert same(tree[key], value), key
        assert isinstance(tree[key], memtree.MemoryMappedTensor)
    assert tree["step"].item() == 7 and tree["cfg"] == {"lr": 0.5, "betas": [0.9, 0.95]}
    report = memtree.verify_tree(d)
    assert report.problems == [] and report.checksummed == report.leaves == 8 and report.tree_hash == "ok"
    meta = orjson.loads(open(os.path.join(d, "meta.json"), "rb").read())
    assert meta["version"] == 3
    leaves = {e["key"]: e for e in meta["entries"]}
    assert leaves["cols"]["dtensor"] == {"mesh": [n], "placements": [{"kind": "shard", "dim": 1}]}
    assert leaves["rep"]["dtensor"] == {"mesh": [n], "placements": [{"kind": "replicate"}]}
    assert "dtensor" not in leaves["step"]
    chunks = leaves["big"]["chunks"]  # per-chunk checksums (2.4 MB), no whole-leaf checksum
    assert "checksum" not in leaves["big"] and chunks["algorithm"] in ("crc32c", "crc32")
    assert chunks["chunk_bytes"] == TEST_CHUNK_BYTES and len(chunks["digests"]) == 3 * 8
    assert leaves["rows"]["checksum"].startswith(chunks["algorithm"] + ":") and "chunks" not in leaves["rows"]
    memtree.TensorTree(full_tensors()).memmap(tmp_path / "one", checksum=chunks["algorithm"])
    one = {e["key"]: e for e in orjson.loads((tmp_path / "one" / "meta.json").read_bytes())["entries"]}
    for key in full_tensors():
        assert (leaves[key].get("checksum"), leaves[key].get("chunks")) == (one[key].get("checksum"), one[key].get("chunks"))
    if n == 4:
        assert leaves["grid"]["dtensor"] == {
            "mesh": [2, 2], "placements": [{"kind": "shard", "dim": 0}, {"kind": "shard", "dim": 1}]
        }
    assert sorted(os.listdir(os.path.dirname(d))) == ["n1", "n2", "n3", "n4", "plain"]  # no staging, no lock


@pytest.mark.parametrize("m", [1, 2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_saved_on_n_ranks_loads_on_m_ranks_bit_exact(saved, m):
    """Every N -> M: each of M ranks gets exactly the shard DTensor would give it, for every target
    placement, through load_memmap(mesh=, placements=) and load_into_module."""
    checks = run_ranks(m, _load, [saved[n] for n in (0, 1, 2, 3, 4)])
    assert all(c > 0 for c in checks)


# ---------------------------------------------------------------------------------------------
# training: FSDP2 and tensor parallelism, model + AdamW, resume continues identically


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 10)  # 10 rows: uneven shards on 3 and 4 ranks
        self.down = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def parallel(kind: str, world: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """A ``Net`` (initialised from ``seed``) parallelised by FSDP2 or by a tensor-parallel plan,
    and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    if kind == "fsdp":
        fully_shard(model, mesh=mesh)
    else:
        parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model, torch.optim.AdamW(model.parameters(), lr=0.05), mesh


def steps(model: nn.Module, opt: torch.optim.Optimizer, rank: int, first: int, count: int, kind: str) -> list[float]:
    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(1000 * step + (rank if kind == "fsdp" else 0))  # TP: one batch
        x = torch.randn(4, 6, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss))
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _train_and_save(rank: int, world: int, kind: str, d: str) -> tuple[list[float], dict]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, opt, _ = parallel(kind, world, seed=0)
    steps(model, opt, rank, 0, 3, kind)
    memtree.TensorTree({"model": memtree.TensorTree.from_module(model),
                        "optim": get_optimizer_state_dict(model, opt)}).memmap(d)
    return steps(model, opt, rank, 3, 3, kind), full_params(model)


def _resume(rank: int, world: int, kind: str, d: str) -> tuple[list[float], dict]:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    model, opt, mesh = parallel(kind, world, seed=1)  # other weights: the load must replace them all
    result = memtree.load_into_module(model, d, prefix="model", strict=False)
    assert result.missing == [] and all(n.startswith("optim.") for n in result.unexpected)
    # mmap=False: the optimizer updates its state in place, in memory of its own (a mapping with
    # mode="r+" would write into the checkpoint's files)
    state = memtree.load_memmap(d, mesh=mesh, keys=["optim"], mmap=False)["optim"].to_dict()
    assert type(state["state"]["up.weight"]["exp_avg"]).__name__ == "DTensor"
    set_optimizer_state_dict(model, opt, state)
    return steps(model, opt, rank, 3, 3, kind), full_params(model)


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
def test_resume_continues_training_identically(tmp_path, kind):
    """FSDP2 (Shard(0) everywhere) or a tensor-parallel plan (ColwiseParallel: Shard(0),
    RowwiseParallel: Shard(1) and a replicated bias), model and AdamW state saved collectively on
    2 ranks, loaded into a freshly built model and optimizer: the next steps' losses and the
    weights they give are bit for bit those of the run that never stopped."""
    d = str(tmp_path / "ckpt")
    straight = run_ranks(2, _train_and_save, kind, d)
    resumed = run_ranks(2, _resume, kind, d)
    for (losses_a, params_a), (losses_b, params_b) in zip(straight, resumed):
        assert losses_a == losses_b
        assert params_a.keys() == params_b.keys() and all(same(params_a[k], params_b[k]) for k in params_a)
    # the same checkpoint, loaded by one process with no process group: plain full tensors
    tree = memtree.load_memmap(d)
    assert tree["model", "up", "weight"].shape == (10, 6)
    assert tree["optim", "state", "down.weight", "exp_avg"].shape == (3, 10)


def _cross_load(rank: int, world: int, kind: str, d: str) -> dict:
    model, _, _ = parallel(kind, world, seed=2)
    memtree.load_into_module(model, d, prefix="model", strict=False)
    return full_params(model)


@pytest.mark.slow
def test_a_checkpoint_of_one_parallelism_loads_into_another(tmp_path):
    """Saved from FSDP2 on 2 ranks; loaded into a tensor-parallel model on 3 ranks, FSDP2 on 4,
    and a plain model in this process: the same weights, bit for bit."""
    d = str(tmp_path / "ckpt")
    _, saved_params = run_ranks(2, _train_and_save, "fsdp", d)[0]
    plain = Net()
    memtree.load_into_module(plain, d, prefix="model", strict=False)
    for kind, world in (("tp", 3), ("fsdp", 4)):
        for params in run_ranks(world, _cross_load, kind, f"{d}"):
            assert all(same(params[k], dict(plain.named_parameters())[k].detach()) for k in params)


# ---------------------------------------------------------------------------------------------
# what a rank reads, and the memory it needs: its own bytes only


def big_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"row": torch.randn(8192, 1024, generator=g), "col": torch.randn(1024, 8192, generator=g)}


BIG_PLACEMENT = {"row": "S(0)", "col": "S(1)"}


def _save_big(rank: int, world: int, d: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    full = big_tensors()
    memtree.TensorTree({"row": distribute(full["row"], mesh, [Shard(0)]),
                        "col": distribute(full["col"], mesh, [Shard(1)])}).memmap(d)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


class Counted:
    """Counts the bytes every read of this process asks for (preadv, pread, read)."""

    def __init__(self) -> None:
        self.nbytes = 0
        self.real = (os.preadv, os.pread, os.read)

    def __enter__(self) -> "Counted":
        preadv, pread, read = self.real

        def counting_preadv(fd, buffers, offset, *args):
            self.nbytes += sum(memoryview(b).nbytes for b in buffers)
            return preadv(fd, buffers, offset, *args)

        def counting_pread(fd, n, offset):
            self.nbytes += n
            return pread(fd, n, offset)

        def counting_read(fd, n):
            self.nbytes += n
            return read(fd, n)

        os.preadv, os.pread, os.read = counting_preadv, counting_pread, counting_read
        return self

    def __exit__(self, *exc) -> None:
        os.preadv, os.pread, os.read = self.real


def _measure(rank: int, world: int, d: str, key: str) -> dict[str, int]:
    """Load ``key`` into a DTensor buffer (placed as saved), then with load_memmap; the bytes read
    and the peak memory beyond what the rank held before (after a warm-up load: imports, thread
    arenas are once per process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from memtree.dist.placement import Layout, box_shape, local_box

    mesh = init_device_mesh("cpu", (world,))
    shape = tuple(big_tensors()[key].shape)
    placements = [Shard(0 if key == "row" else 1)]
    local = torch.zeros(box_shape(local_box(shape, Layout((world,), (BIG_PLACEMENT[key],)), (rank,))))
    holder = Holder({key: DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                             stride=(shape[1], 1))})
    memtree.load_into_module(holder, d, strict=False)  # warm-up
    out = {"local": local.nbytes}
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from here
    before = _status("VmRSS")
    with Counted() as counted:
        memtree.load_into_module(holder, d, strict=False)
    out["module_peak"], out["module_bytes"] = _status("VmHWM") - before, counted.nbytes
    want = distribute(big_tensors()[key], mesh, placements).to_local()
    assert same(local, want)
    del want
    memtree.load_memmap(d, mesh=mesh, keys=[key], mmap=False)  # warm-up
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    with Counted() as counted:
        tree = memtree.load_memmap(d, mesh=mesh, keys=[key], mmap=False)
    out["memmap_peak"], out["memmap_bytes"] = _status("VmHWM") - before, counted.nbytes
    assert same(tree[key].to_local(), local)
    with Counted() as counted:
        verified = memtree.load_memmap(d, mesh=mesh, keys=[key], verify=True)
    out["verified_bytes"] = counted.nbytes
    assert same(verified[key].to_local(), local)
    return out


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("big") / "t")
    run_ranks(2, _save_big, d)
    return d


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("key", ["row", "col"])
def test_each_rank_reads_its_own_bytes_in_little_more_memory(big, world, key):
    """The targets: a rank asks for Shard(0) <= 1/N + 1% of the tree's bytes, Shard(1) <= 1.25/N
    (column ranges are one per row, never read over a gap wider than a quarter of a range); its
    peak memory stays within 1.1x its shard, filled in place or loaded by load_memmap (no full
    tensor is ever made); verify=True reads just the chunks its ranges touch."""
    tree_bytes = sum(t.nbytes for t in big_tensors().values())
    leaf = big_tensors()[key].nbytes
    for m in run_ranks(world, _measure, big, key):
        cap = (1 / world + 0.01) * tree_bytes if key == "row" else 1.25 / world * tree_bytes
        assert m["module_bytes"] <= cap and m["memmap_bytes"] <= cap + 65536  # + the meta.json files
        assert m["module_bytes"] >= m["local"]
        assert m["module_peak"] <= 0.1 * m["local"]
        assert m["memmap_peak"] <= 1.1 * m["local"]
        if key == "row":  # whole chunks of 1 MiB around its range
            assert m["verified_bytes"] <= m["local"] + 2 * (1 << 20) + 65536
        else:  # a row of a column shard lies in every chunk: the whole leaf is read to check it
            assert m["verified_bytes"] <= leaf + 65536


def _load_file(rank: int, world: int, path: str) -> dict[str, int]:
    """load_into_module of DTensors from a checkpoint file: each rank reads only its ranges."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    full = big_tensors()
    holder = Holder({"row": distribute(torch.zeros_like(full["row"]), mesh, [Shard(0)]),
                     "col": distribute(torch.zeros_like(full["col"]), mesh, [Shard(1)])})
    with Counted() as counted:
        memtree.load_into_module(holder, path)
    for key, placement in (("row", Shard(0)), ("col", Shard(1))):
        assert same(getattr(holder, key).to_local(), distribute(full[key], mesh, [placement]).to_local()), key
    return {"bytes": counted.nbytes}


@pytest.mark.parametrize("layout", ["model.safetensors", pytest.param("shards", marks=pytest.mark.slow)])
def test_dtensors_load_from_safetensors_files_and_shards_reading_their_own_bytes(big, tmp_path, layout):
    """The same rank-aware reads from a .safetensors file and from a Hugging Face directory of
    shards (the tensors' ranges in those files): no rank reads the whole checkpoint."""
    dst = str(tmp_path / layout)
    memtree.convert(big, dst, format="safetensors", max_shard_size="20MB" if layout == "shards" else None)
    tree_bytes = sum(t.nbytes for t in big_tensors().values())
    for result in run_ranks(2, _load_file, dst):
        assert result["bytes"] <= 0.5 * tree_bytes + 256 * 1024  # + each file's header


def test_the_distributed_guide_runs_on_2_ranks(tmp_path):
    """docs/guide/distributed.md: its ```python blocks, one script, on 2 ranks as torchrun starts
    them (the script initialises its own process group); its asserts are the checks."""
    import re

    from distutil import run_script

    page = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "guide", "distributed.md")
    blocks = re.findall(r"^```python\n(.*?)^```$", open(page).read(), re.M | re.S)
    assert len(blocks) >= 5
    run_script(2, "\n".join(blocks), page, str(tmp_path))
    exported = memtree.interop.open_checkpoint(str(tmp_path / "model.safetensors"))  # convert's, rank 0
    assert exported["model.0.weight"].shape == (63, 16)


# ---------------------------------------------------------------------------------------------
# Checkpointer: a state holding DTensors is saved by every rank at once


def _checkpointer(rank: int, world: int, root: str) -> list[int]:
    import memtree

    model, opt, _ = parallel("fsdp", world, seed=0)
    steps(model, opt, rank, 0, 1, "fsdp")
    ckpt = memtree.Checkpointer(root, keep_last=1)
    for step in (1, 2):
        assert ckpt.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": step}) == ckpt.path(step)
    with pytest.raises(memtree.InvalidArgumentError, match="blocking=True"):
        ckpt.save(3, {"model": model.state_dict()}, blocking=False)
    dist.barrier()  # rank 0 applies the retention: wait for it before listing
    return ckpt.steps()


def test_a_checkpointer_saves_a_sharded_state_from_every_rank(tmp_path):
    """Checkpointer.save of an FSDP2 state (model and optimizer: DTensors under int keys) on 2
    ranks: one step directory, committed once, with the retention applied by rank 0; restored
    whole by one process."""
    root = str(tmp_path / "root")
    assert run_ranks(2, _checkpointer, root) == [[2], [2]]
    state = memtree.Checkpointer(root).restore()
    assert state["epoch"] == 2 and state["model"]["up.weight"].shape == (10, 6)
    assert set(state["optim"]["state"]) == {0, 1, 2, 3}
    assert state["optim"]["state"][0]["exp_avg"].shape == (10, 6)


def _wrong_uses(rank: int, world: int, d: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    tree = memtree.TensorTree({"w": distribute(torch.ones(4, 2), mesh, [Shard(0)])})
    messages = []
    for call in (
        lambda: tree.memmap(d, checksum="xxh3"),  # rank 0 cannot combine xxh3 from the pieces
        lambda: tree.memmap(None),  # shared memory is this process's
        lambda: tree.memmap(d, encryption=memtree.EncryptionKey.generate()),
    ):
        with pytest.raises(memtree.MemtreeError) as info:
            call()
        messages.append(str(info.value))
    tree.memmap(d)
    mesh2 = init_device_mesh("cpu", (world, 1))
    for kwargs, error in (
        ({"placements": {"w": [Shard(0)]}}, memtree.InvalidArgumentError),  # no mesh
        ({"mesh": mesh, "placements": [Shard(0)]}, memtree.InvalidArgumentError),  # a list: for which key?
        ({"mesh": mesh2}, memtree.PlacementError),  # saved on a 1-d mesh
        ({"mesh": mesh, "placements": {"w": [Shard(2)]}}, memtree.PlacementError),
    ):
        with pytest.raises(error) as info:
            memtree.load_memmap(d, **kwargs)
        messages.append(str(info.value))
    return messages


def test_wrong_uses_are_refused_with_the_fix(tmp_path):
    xxh3, shared, encrypted, no_mesh, a_list, mesh_dims, bad_dim = run_ranks(1, _wrong_uses, str(tmp_path / "t"))[0]
    assert "records crc32c or crc32" in xxh3 and "checksum='auto'" in xxh3
    assert "pass a prefix" in shared
    assert "encryption=" in encrypted
    assert "placements= needs mesh=" in no_mesh
    assert "a mapping from keys to placements" in a_list
    assert "mesh of shape [1]" in mesh_dims and "Pass placements=" in mesh_dims
    assert "shards dim 2" in bad_dim


def _unreadable_names(rank: int, world: int, d: str) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    out = []
    for name in ("data-parallel", "x" * 65):  # meta.json's dim_names are identifiers of 64 chars at most
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(name,))
        with pytest.raises(memtree.PlacementError) as info:
            memtree.TensorTree({"w": distribute(torch.ones(4, 2), mesh, [Shard(0)])}).memmap(d)
        out.append(str(info.value))
    return out


def test_a_mesh_whose_names_meta_json_cannot_record_is_refused_before_writing(tmp_path):
    """A mesh dim name the reader refuses (not an identifier, too long) is refused at write time,
    naming the leaf and the fix, rather than written into a tree that no longer loads."""
    d = str(tmp_path / "t")
    for message in run_ranks(1, _unreadable_names, d)[0]:
        assert "leaf 'w'" in message and "dim_names" in message and "name the mesh dims with Python identifiers" in message
    assert not os.path.exists(d) and os.listdir(tmp_path) == []


def _other_calls(rank: int, world: int, d: str) -> dict:
    """memmap_like and checksum=None from every rank; placements= as a function, a key the tree
    lacks, a Shard(-1); options that differ between ranks; a tree saved while a rank holds a
    mapped shard of the tree it replaces."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(40.0).reshape(10, 4)
    tree = memtree.TensorTree({"w": distribute(full, mesh, [Shard(1)]), "n": torch.tensor(3)})
    out: dict = {}
    like = tree.memmap_like(d + "/like")
    out["like"] = (type(like["w"]).__name__, list(like["w"].placements), bool((like["w"].to_local() == 0).all()))
    plain = tree.memmap(d + "/plain", checksum=None)
    out["plain"] = same(plain["w"].to_local(), tree["w"].to_local())
    pick = memtree.load_memmap(d + "/plain", mesh=mesh, mmap=False,
                               placements=lambda key, shape: [Replicate()] if key == ("n",) else None)
    out["pick"] = (list(pick["n"].placements), pick["n"].to_local().item(), list(pick["w"].placements))
    negative = memtree.load_memmap(d + "/plain", mesh=mesh, placements={"w": [Shard(-1)]})
    out["negative"] = list(negative["w"].placements) == [Shard(1)]
    with pytest.raises(memtree.MemtreeKeyError) as info:
        memtree.load_memmap(d + "/plain", mesh=mesh, placements={"nope": [Shard(0)]})
    out["unknown"] = str(info.value)
    with pytest.raises(memtree.PlacementError) as info:
        tree.memmap(d + "/plain", fsync=rank == 1)
    out["options"] = str(info.value)
    held = memtree.load_memmap(d + "/plain", mesh=mesh, placements={"w": [Shard(0)]}, mode="r")
    tree["w"] = distribute(full + 1, mesh, [Shard(1)])
    tree.memmap(d + "/plain")  # replaces the tree whose shard this rank maps
    out["held"] = same(held["w"].to_local(), distribute(full, mesh, [Shard(0)]).to_local())
    return out


def test_memmap_like_checksum_none_and_placement_choices_from_every_rank(tmp_path):
    from torch.distributed.tensor import Replicate, Shard

    for out in run_ranks(2, _other_calls, str(tmp_path)):
        assert out["like"] == ("DTensor", [Shard(1)], True)
        assert out["plain"] and out["negative"] and out["held"]
        assert out["pick"] == ([Replicate()], 3, [Shard(1)])
        assert "'nope'" in out["unknown"] and "not a tensor leaf" in out["unknown"]
        assert "different options" in out["options"] and "'fsync': True" in out["options"]
    meta = orjson.loads(open(tmp_path / "like" / "meta.json", "rb").read())
    assert all("checksum" not in e for e in meta["entries"] if e["kind"] == "tensor")
    assert memtree.load_memmap(str(tmp_path / "like"))["w"].shape == (10, 4)


def remote_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(6)  # 4 MiB each: 4 checksummed chunks; 16 rows of columns
    return {"row": torch.randn(1024, 1024, generator=g), "col": torch.randn(16, 65536, generator=g)}


def _save_remote(rank: int, world: int, d: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    full = remote_tensors()
    memtree.TensorTree({"row": distribute(full["row"], mesh, [Shard(0)]),
                        "col": distribute(full["col"], mesh, [Shard(1)])}).memmap(d)


def _remote(rank: int, world: int, url: str, verify: bool) -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    mesh = init_device_mesh("cpu", (world,))
    tree = memtree.load_memmap(url, mesh=mesh, verify=verify)
    full = remote_tensors()
    for key, placement in (("row", Shard(0)), ("col", Shard(1))):
        assert list(tree[key].placements) == [placement]
        assert same(tree[key].to_local(), distribute(full[key], mesh, [placement]).to_local()), key
    return rank


@pytest.mark.parametrize("verify", [False, True])
def test_ranks_read_only_their_ranges_of_a_remote_tree(tmp_path, verify):
    """load_memmap(url, mesh=): each rank's ranges are ranged HTTP requests, so the server sends
    the tree about once for 2 ranks (not twice); with verify=True each rank reads the chunks its
    ranges touch whole and checks them (a column shard touches every chunk of its leaf)."""
    import remote_server

    d = str(tmp_path / "t")
    run_ranks(2, _save_remote, d)
    srv, _ = remote_server.start()
    try:
        srv.publish(d, "t")
        assert run_ranks(2, _remote, f"{srv.url}/t", verify) == [0, 1]
        row, col = (t.nbytes for t in remote_tensors().values())
        assert srv.leaf_bytes() <= (row + col if not verify else row + 2 * col) * 1.01
    finally:
        remote_server.stop(srv)
