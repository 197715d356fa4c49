"""device= paths on CUDA: the tests marked ``needs_cuda`` are skipped on machines without a GPU
(run them on a GPU machine when one is lent); the others check what a machine without CUDA gets,
and the pinned ring's allocation, on any machine. The second half runs every CUDA load of a
module or tree through the pinned ring (tests/test_fill_ring.py and tests/test_fill_bound.py
check the same plumbing on the CPU)."""

import pytest
import torch
from torch import nn

import memtree
import memtree.store.primitives.fill as fill_mod

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cuda_tree():
    return memtree.TensorTree(
        {"w": torch.randn(64, 32, device="cuda"), "b": {"x": torch.arange(64, device="cuda")}},
        batch_size=[64],
    )


@needs_cuda
def test_memmap_of_a_cuda_tree_writes_cpu_files(tmp_path, cuda_tree):
    m = cuda_tree.memmap(tmp_path / "t", num_threads=4)
    assert m.is_memmap() and m["w"].device.type == "cpu"
    assert torch.equal(m["w"], cuda_tree["w"].cpu())


@needs_cuda
@pytest.mark.parametrize("mmap", [True, False])
def test_load_memmap_to_cuda(tmp_path, cuda_tree, mmap):
    cuda_tree.memmap(tmp_path / "t")
    g = memtree.load_memmap(tmp_path / "t", device="cuda:0", mmap=mmap)
    assert g["w"].is_cuda and torch.equal(g["w"], cuda_tree["w"])
    assert torch.equal(g["b", "x"], cuda_tree["b", "x"])


@needs_cuda
def test_cuda_values_assigned_into_memmapped_rows(tmp_path, cuda_tree):
    m = cuda_tree.memmap(tmp_path / "t")
    m[0:2] = cuda_tree[0:2].apply(lambda x: x * 0)
    assert m["w"][0:2].abs().sum().item() == 0
    assert torch.equal(m["w"][2:], cuda_tree["w"][2:].cpu())


@needs_cuda
def test_memory_mapped_tensor_from_cuda_tensor(tmp_path):
    mt = memtree.MemoryMappedTensor.from_tensor(torch.ones(3, device="cuda"), filename=tmp_path / "one.memmap")
    assert mt.device.type == "cpu" and mt.sum().item() == 3


@needs_cuda
def test_to_cuda_and_memmap_like(tmp_path, cuda_tree):
    m = cuda_tree.memmap(tmp_path / "t")
    tc = m.to("cuda")
    assert tc.device == torch.device("cuda") and tc["w"].is_cuda
    like = cuda_tree.memmap_like(tmp_path / "like")
    assert like["w"].shape == (64, 32) and like["w"].device.type == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_loading_onto_cuda_without_cuda_raises_a_typed_error_naming_the_device(tmp_path, device):
    memtree.TensorTree({"x": torch.ones(2)}).memmap(tmp_path / "m")
    with pytest.raises(memtree.InvalidArgumentError, match=rf"device='{device}', but .*CUDA.*Nothing was loaded"):
        memtree.load_memmap(tmp_path / "m", device=device)
    with memtree.empty_init():
        target = nn.Linear(2, 2)
    with pytest.raises(memtree.InvalidArgumentError, match=rf"device='{device}'"):
        memtree.load_into_module(target, tmp_path / "m", device=device, strict=False)
    assert target.weight.is_meta


@needs_cuda
def test_loading_onto_a_cuda_device_this_process_lacks_raises_a_typed_error(tmp_path):
    memtree.TensorTree({"x": torch.ones(2)}).memmap(tmp_path / "m")
    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(memtree.InvalidArgumentError, match=rf"device='{missing}', but this process has"):
        memtree.load_memmap(tmp_path / "m", device=missing)


class _RecordingCudart:
    """Stands for ``torch.cuda.cudart()``: records every call; ``cudaHostRegister`` fails as it
    does under a memlock limit (where the real one leaves its error pending)."""

    def __init__(self, real=None):
        self.calls = []
        self.real = real

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append("cudaHostRegister")
        if self.real is not None:  # a real failure: invalid flags (cudaErrorInvalidValue)
            return self.real.cudaHostRegister(ptr, size, 0xFFFF)
        return 1

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.real, name)


class _Stream:
    """Stands for ``torch.cuda.Stream`` where there is no CUDA."""

    def __init__(self, device=None):
        pass

    def wait_stream(self, other):
        pass


def test_the_pinned_ring_is_allocated_by_torch_never_registered_by_hand(monkeypatch):
    cudart = _RecordingCudart(torch.cuda.cudart() if torch.cuda.is_available() else None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "Stream", _Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    copier = fill_mod.CudaCopier(torch.device("cuda"))
    (buf,) = copier.buffers(4096, 1)
    assert buf.dtype == torch.uint8 and buf.shape == (4096,) and buf.device.type == "cpu"
    assert buf.is_pinned() == torch.cuda.is_available()  # without CUDA: pageable, still correct
    copier.release([buf], True)
    assert cudart.calls == []


@needs_cuda
def test_a_load_onto_cuda_leaves_no_cuda_error_pending_for_the_next_kernel(tmp_path, monkeypatch, cuda_tree):
    cuda_tree.memmap(tmp_path / "t")
    cudart = _RecordingCudart(torch.cuda.cudart())
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)  # pinning by hand would fail
    g = memtree.load_memmap(tmp_path / "t", device="cuda")
    assert torch.equal(g["w"], cuda_tree["w"])
    assert (torch.ones(8, device="cuda") * 2).sum().item() == 16  # no stale error raised here
    assert "cudaHostRegister" not in cudart.calls


@needs_cuda
def test_a_ring_buffer_that_cannot_be_pinned_leaves_no_cuda_error_pending(monkeypatch):
    monkeypatch.setattr(fill_mod, "PINNED_RING_BYTES", 1 << 43)  # the ring tries to pin it
    copier = fill_mod.CudaCopier(torch.device("cuda"))
    try:
        copier.buffers(1 << 42, 1)  # 4 TiB: more than a host can pin (its pageable fallback may fail too)
    except RuntimeError:
        pass
    assert (torch.ones(8, device="cuda") * 2).sum().item() == 16


@needs_cuda
def test_to_module_binds_a_cuda_tree_zero_copy_and_the_swap_binds_back():
    model = nn.Linear(32, 4).cuda()
    before = (model.weight, model.bias)
    params = memtree.TensorTree({"weight": torch.randn(4, 32, device="cuda"), "bias": torch.zeros(4, device="cuda")})
    swap = params.to_module(model)
    assert model.weight.data_ptr() == params["weight"].data_ptr() and model.weight.is_cuda
    swap.to_module(model)
    assert model.weight is before[0] and model.bias is before[1]


@pytest.mark.skipif(hasattr(torch, "xpu") and torch.xpu.is_available(), reason="checks a machine without XPU")
def test_loading_onto_another_device_this_process_lacks_raises_a_typed_error(tmp_path):
    memtree.TensorTree({"x": torch.ones(2)}).memmap(tmp_path / "m")
    with pytest.raises(memtree.InvalidArgumentError, match=r"device='xpu' cannot hold tensors in this process"):
        memtree.load_memmap(tmp_path / "m", device="xpu")


# -- every CUDA load through the pinned ring (issue 25) -----------------------------------------------
# Run on a GPU machine: python -m pytest -q tests/test_cuda.py (about ten seconds). Each test
# checks bit-exact values on the device, that every tensor went through the ring (the
# destinations of the CUDA copier's staged jobs), and what the ring holds afterwards.
import os  # noqa: E402 - the section's own imports
import threading  # noqa: E402
from typing import Any  # noqa: E402

import memtree.nn.loading as loading_mod  # noqa: E402
from memtree import StorageError, TensorTree, load_into_module, load_memmap  # noqa: E402
from memtree.store.primitives.files import FileRange  # noqa: E402
from memtree.store.primitives.fill import FillJob, fill, memory_job  # noqa: E402

from test_fill import fail_preadv_at, no_reader_threads  # noqa: E402
from test_fill_bound import assert_written_privately, written_privately  # noqa: E402
from test_fill_loading import Net, _tree, raw, save, trained  # noqa: E402


def host(t: torch.Tensor) -> bytes:
    return raw(t.detach().cpu())


def cuda_usable() -> bool:
    torch.cuda.synchronize()
    return (torch.ones(8, device="cuda") * 2).sum().item() == 16


@pytest.fixture
def ring(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """The process ring emptied before and after; records the destinations of every job staged
    through a CudaCopier, and every pinned allocation (bytes, ring bytes held after it)."""
    fill_mod.release_pinned_memory()
    seen: dict[str, list[Any]] = {"dests": [], "pinned": []}
    real_staged = fill_mod._fill_staged

    def staged(jobs: Any, copier: Any, *args: Any) -> None:
        if isinstance(copier, fill_mod.CudaCopier):
            seen["dests"].extend(j.dest.data_ptr() for j in jobs)
        real_staged(jobs, copier, *args)

    real_allocate = fill_mod.PINNED._allocate

    def allocate(nbytes: int) -> torch.Tensor:
        buf = real_allocate(nbytes)
        assert buf.is_pinned()
        seen["pinned"].append((nbytes, fill_mod.PINNED.held))
        return buf

    monkeypatch.setattr(fill_mod, "_fill_staged", staged)
    monkeypatch.setattr(fill_mod.PINNED, "_allocate", allocate)
    yield seen
    assert fill_mod.PINNED._lent == {} and no_reader_threads()  # drained, joined
    fill_mod.release_pinned_memory()


def through_ring(module_or_tensors: Any, seen: dict[str, list[Any]]) -> None:
    tensors = module_or_tensors.state_dict().values() if isinstance(module_or_tensors, nn.Module) else module_or_tensors
    for t in tensors:
        assert t.is_cuda
        if t.numel():
            assert t.data_ptr() in seen["dests"]


@needs_cuda
def test_the_threaded_ring_fills_casts_and_strided_targets_bit_exact(tmp_path, monkeypatch, ring):
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    monkeypatch.setattr(fill_mod, "PINNED_CHUNK", 1 << 16)  # many pieces, several threads
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8).view(torch.float32).reshape(768, 1024)
    src = torch.nan_to_num(src)
    bf = src.to(torch.bfloat16)
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(raw(src) + raw(bf))
    fd = os.open(path, os.O_RDONLY)
    same = torch.empty(768, 1024, device="cuda")
    wide = torch.empty(768, 1024, dtype=torch.float64, device="cuda")
    strided = torch.empty(1024, 768, device="cuda").t()
    up = torch.empty(768, 1024, device="cuda")
    try:
        fill([
            FillJob(same, FileRange(fd, 0, src.nbytes, "same")),
            FillJob(wide, FileRange(fd, 0, src.nbytes, "wide"), torch.float32),
            FillJob(strided, FileRange(fd, 0, src.nbytes, "strided")),
            FillJob(up, FileRange(fd, src.nbytes, bf.nbytes, "up"), torch.bfloat16),
        ])
    finally:
        os.close(fd)
    assert host(same) == raw(src) and host(strided) == raw(src)
    assert host(wide) == raw(src.double()) and host(up) == raw(bf.float())
    assert 0 < fill_mod.PINNED.held <= 1 << 20  # ten 64 KiB slots at most
    assert cuda_usable()


@needs_cuda
def test_memory_sources_fill_cuda_tensors_bit_exact(ring):
    src = torch.arange(100_000, dtype=torch.float32).reshape(100, 1000)
    dest = torch.empty(1000, 100, dtype=torch.float64, device="cuda").t()
    fill([memory_job(dest, src, "x")])
    assert host(dest) == raw(src.double())


@needs_cuda
@pytest.mark.parametrize("kind", ["memtree", "safetensors", "torch", "safetensors-shards"])
def test_an_empty_init_model_loads_onto_cuda_through_the_ring(tmp_path, ring, kind):
    src = trained()
    path = save(src, kind, tmp_path)
    with memtree.empty_init():
        net = Net()
    assert load_into_module(net, path, device="cuda") == ([], [])
    for k, v in src.state_dict().items():
        assert host(net.state_dict()[k]) == raw(v), k
    through_ring(net, ring)
    assert cuda_usable()


@needs_cuda
@pytest.mark.parametrize("how", ["assign", "tree r+", "tree r", "state_dict", "live", "to_module inplace"])
def test_every_other_cuda_load_of_a_module_goes_through_the_ring(tmp_path, ring, how):
    src = trained()
    path = save(src, "memtree", tmp_path)
    net = Net().cuda()
    if how == "assign":
        load_into_module(net, path, device="cuda", assign=True)
    elif how.startswith("tree"):
        load_into_module(net, load_memmap(path, mode=how[5:]))
    elif how == "state_dict":
        load_into_module(net, {k: v.clone() for k, v in src.state_dict().items()})
    elif how == "live":
        load_into_module(net, path)
    else:
        load_memmap(path).to_module(net, inplace=True)
    for k, v in src.state_dict().items():
        assert host(net.state_dict()[k]) == raw(v), k
    through_ring(net, ring)


@needs_cuda
def test_a_read_only_tree_with_private_writes_loads_its_pages_onto_cuda(tmp_path, ring):
    src, tree = written_privately(tmp_path)
    with memtree.empty_init():
        net = Net()
    load_into_module(net, tree, device="cuda")
    assert_written_privately(net, src)


@needs_cuda
def test_tied_weights_load_onto_cuda_tied_and_read_once(tmp_path, ring):
    from test_attack_models import Tied

    src = Tied()
    TensorTree.from_module(src).memmap(tmp_path / "t")
    with memtree.empty_init():
        net = Tied().to(torch.float64)
    load_into_module(net, tmp_path / "t", device="cuda", dtype=torch.float64)
    assert net.head.weight is net.emb.weight and net.emb.weight.dtype == torch.float64
    assert host(net.emb.weight) == raw(src.emb.weight.double()) and len(ring["dests"]) == 1


@needs_cuda
@pytest.mark.parametrize("mmap", [True, False])
def test_load_memmap_onto_cuda_reuses_the_ring_across_its_batches_and_loads(tmp_path, monkeypatch, ring, mmap):
    import memtree.store.reading.leaf_reader as leaf_reader_mod

    monkeypatch.setattr(leaf_reader_mod, "MAX_PENDING_READS", 4)  # one fill() every 4 leaves
    data = _tree(6)
    d = str(tmp_path / "t")
    TensorTree(data).memmap(d)
    pinned = []
    for _ in range(3):
        g = load_memmap(d, device="cuda", mmap=mmap)
        for i, level in data.items():
            for k, v in level.items():
                assert host(g[i, k]) == raw(v)
        through_ring([g[i, k] for i, level in data.items() for k in level], ring)
        pinned.append(len(ring["pinned"]))
    assert 0 < pinned[0] == pinned[1] == pinned[2]  # pinned by the first load (its larger batches grow it), then reused
    batch = max(sum(v.nbytes for v in level.values()) for level in data.values())
    assert fill_mod.PINNED.held <= 1 << batch.bit_length()  # sized to the batches, not 32 MiB buffers


@needs_cuda
def test_the_ring_never_holds_more_than_its_cap_and_release_gives_it_back(tmp_path, monkeypatch, ring):
    cap = 1 << 20
    monkeypatch.setattr(fill_mod, "PINNED_RING_BYTES", cap)
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    data = {"w": torch.randn(4 << 20), "v": torch.randn(1000, 1000)}  # 20 MB
    d = str(tmp_path / "t")
    TensorTree(data).memmap(d)
    g = load_memmap(d, device="cuda")
    assert host(g["w"]) == raw(data["w"]) and host(g["v"]) == raw(data["v"])
    assert ring["pinned"] and all(held <= cap for _, held in ring["pinned"]) and fill_mod.PINNED.held <= cap
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    before = stats().get("allocated_bytes.current")
    freed = fill_mod.release_pinned_memory()
    assert freed > 0 and fill_mod.PINNED.held == 0
    if before is not None:  # torch's pinned cache gave the blocks back to the system
        assert stats()["allocated_bytes.current"] <= before - freed


@needs_cuda
@pytest.mark.parametrize("fail", ["read", "copy"])
def test_an_error_mid_load_joins_the_threads_drains_the_ring_and_leaves_cuda_usable(tmp_path, monkeypatch, ring, fail):
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    monkeypatch.setattr(fill_mod, "PINNED_CHUNK", 1 << 12)
    src = trained()
    path = save(src, "safetensors", tmp_path)
    if fail == "read":
        calls = fail_preadv_at(monkeypatch, 6)
        error: Any = StorageError
    else:
        calls = {"n": 0}
        real_copy = fill_mod.CudaCopier.copy

        def copy(self: Any, dst: torch.Tensor, src_: torch.Tensor) -> Any:
            calls["n"] += 1  # copies are made by the calling thread only
            if calls["n"] == 6:
                raise RuntimeError("CUDA copy failed")
            return real_copy(self, dst, src_)

        monkeypatch.setattr(fill_mod.CudaCopier, "copy", copy)
        error = RuntimeError
    with memtree.empty_init():
        net = Net()
    with pytest.raises(error):
        load_into_module(net, path, device="cuda")
    assert all(t.is_meta for t in net.state_dict().values())  # nothing bound
    assert no_reader_threads() and fill_mod.PINNED._lent == {} and cuda_usable()
    held = fill_mod.PINNED.held
    calls["n"] = -(10**9)  # no more failures: the same load works
    load_into_module(net, path, device="cuda")
    for k, v in src.state_dict().items():
        assert host(net.state_dict()[k]) == raw(v), k
    assert (held == 0) == (fail == "copy")  # a failed copy's buffers are dropped, a failed read's kept
    assert cuda_usable()


@needs_cuda
def test_two_threads_loading_onto_cuda_at_once_get_their_own_buffers(tmp_path, monkeypatch, ring):
    cap = 8 << 10  # less than the two loads ask for: they compete for it
    monkeypatch.setattr(fill_mod, "PINNED_RING_BYTES", cap)
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    srcs = [trained() for _ in range(2)]
    paths, nets = [], []
    for i, src in enumerate(srcs):
        (tmp_path / str(i)).mkdir()
        paths.append(save(src, "safetensors", tmp_path / str(i)))
        with memtree.empty_init():
            nets.append(Net())
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def run(i: int) -> None:
        try:
            start.wait()
            for _ in range(5):
                load_into_module(nets[i], paths[i], device="cuda", assign=True)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for net, src in zip(nets, srcs):
        for k, v in src.state_dict().items():
            assert host(net.state_dict()[k]) == raw(v), k
    assert all(held <= cap for _, held in ring["pinned"]) and fill_mod.PINNED.held <= cap
