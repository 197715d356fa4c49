"""Loads onto the pinned ring's device (CUDA) read into new tensors, never copy file mappings.

``load_into_module(..., device="cuda")`` into a module built under ``empty_init``, with
``assign=True``, or from a ``TensorTree``/``state_dict`` in memory, allocates each tensor on the
device and fills it through :func:`memtree.store.primitives.fill.fill` (from the file bytes, or from the
source's host memory), then binds it; ``to_module(inplace=True)`` fills live CUDA tensors the
same way. Where there is no GPU these paths are run onto the CPU by counting the CPU as the
ring's device (``on_ring``): the plumbing (which tensors are read, from where, ties, casts,
errors) is the same; tests/test_cuda.py runs them on a GPU.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import memtree
import memtree.nn.loading as loading_mod
import memtree.store.primitives.fill as fill_mod
import memtree.tree.parts.bind as bind_mod
from memtree import MemoryMappedTensor, StorageError, TensorTree, load_into_module, load_memmap
from memtree.store.primitives.files import FileRange
from memtree.store.primitives.fill import FillJob, MemoryRange

from test_attack_models import Tied
from test_fill import fail_preadv_at, no_reader_threads
from test_fill_loading import KINDS, Net, _open_fds, raw, save, trained


@pytest.fixture
def cpu_ring(monkeypatch: pytest.MonkeyPatch) -> list[list[FillJob]]:
    """The CPU counted as the ring's device; every fill()'s jobs recorded."""
    on = lambda device: device is not None  # noqa: E731 - the CPU too
    monkeypatch.setattr(loading_mod, "on_ring", on)
    monkeypatch.setattr(bind_mod, "on_ring", on)
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)  # threads even for these small models
    calls: list[list[FillJob]] = []
    real = fill_mod.fill

    def recording(jobs: Any, **kw: Any) -> None:
        calls.append(list(jobs))
        real(jobs, **kw)

    monkeypatch.setattr(loading_mod, "fill", recording)
    monkeypatch.setattr(fill_mod, "fill", recording)
    return calls


def filled(calls: list[list[FillJob]]) -> dict[int, FillJob]:
    """The jobs of every fill, by their destination's address."""
    return {job.dest.data_ptr(): job for jobs in calls for job in jobs if job.dest.numel()}


def assert_loaded(net: nn.Module, src: nn.Module) -> None:
    got = net.state_dict()
    for k, v in src.state_dict().items():
        assert raw(got[k]) == raw(v), k


def assert_read_not_mapped(net: nn.Module, calls: list[list[FillJob]], source: type) -> None:
    """Every non-empty tensor of ``net`` is a plain tensor that one job filled from ``source``."""
    jobs = filled(calls)
    for name, t in net.state_dict(keep_vars=True).items():
        assert not isinstance(t, MemoryMappedTensor) and not t.is_meta, name
        if t.numel():
            assert isinstance(jobs[t.data_ptr()].source, source), name


# -- every entry point --------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_init_model_loaded_onto_the_device_is_read_into_new_tensors(
    tmp_path: Any, cpu_ring: list[list[FillJob]], kind: str
) -> None:
    """Regression: the tensors were bound by ``.to(device)`` copies of the file mappings."""
    src = trained()
    path = save(src, kind, tmp_path)
    with memtree.empty_init():
        net = Net()
    assert load_into_module(net, path, device="cpu") == ([], [])
    assert_loaded(net, src)
    assert_read_not_mapped(net, cpu_ring, FileRange)
    assert len(cpu_ring) == 1  # one fill: one ring, one set of reader threads
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in net.parameters())


def test_a_cast_is_made_by_the_ring_into_tensors_of_the_cast_dtype(tmp_path: Any, cpu_ring: list[list[FillJob]]) -> None:
    src = Net(torch.bfloat16)
    path = save(src, "safetensors", tmp_path)
    with memtree.empty_init():
        net = Net()
    load_into_module(net, path, device="cpu", dtype=torch.float32, keys=["fc"], strict=False)
    assert net.fc.weight.dtype == torch.float32 and torch.equal(net.fc.weight, src.fc.weight.float())
    job = filled(cpu_ring)[net.fc.weight.data_ptr()]
    assert job.dtype == torch.bfloat16 and job.dest.dtype == torch.float32


@pytest.mark.parametrize("kind", ["memtree", "torch"])
def test_tied_weights_are_read_once_and_bound_tied(tmp_path: Any, cpu_ring: list[list[FillJob]], kind: str) -> None:
    src = Tied()
    if kind == "memtree":
        path = str(tmp_path / "t")
        TensorTree.from_module(src).memmap(path)  # one leaf and the tie record
    else:
        path = str(tmp_path / "m.pt")
        torch.save(src.state_dict(), path)  # both names, one storage
    with memtree.empty_init():
        net = Tied()
    load_into_module(net, path, device="cpu")
    assert net.head.weight is net.emb.weight and torch.equal(net.emb.weight, src.emb.weight)
    assert sum(len(jobs) for jobs in cpu_ring) == 1


def test_assign_into_a_live_model_binds_tensors_read_from_the_file(tmp_path: Any, cpu_ring: list[list[FillJob]]) -> None:
    src = trained()
    path = save(src, "memtree", tmp_path)
    net = Net()
    old = list(net.parameters())
    load_into_module(net, path, device="cpu", assign=True)
    assert_loaded(net, src)
    assert_read_not_mapped(net, cpu_ring, FileRange)
    assert not any(p is q for p, q in zip(old, net.parameters()))


def test_a_tree_whose_mappings_are_shared_is_read_from_its_files(tmp_path: Any, cpu_ring: list[list[FillJob]]) -> None:
    src = trained()
    tree = load_memmap(save(src, "memtree", tmp_path))  # mode="r+": the mappings are the files
    with memtree.empty_init():
        net = Net()
    load_into_module(net, tree, device="cpu")
    assert_loaded(net, src)
    assert_read_not_mapped(net, cpu_ring, FileRange)


def written_privately(tmp_path: Any) -> tuple[Net, TensorTree]:
    """A model, and its tree loaded read-only with ``fc.weight[0, 0] = 42`` written through a
    plain alias: into this process's copy-on-write pages, not the file."""
    src = trained()
    tree = load_memmap(save(src, "memtree", tmp_path), mode="r")
    tree["fc", "weight"].as_subclass(torch.Tensor)[0, 0] = 42.0
    return src, tree


def assert_written_privately(net: nn.Module, src: nn.Module) -> None:
    w = net.fc.weight.detach().cpu()
    assert w[0, 0].item() == 42.0 and raw(w[1:]) == raw(src.fc.weight[1:])


def test_a_read_only_tree_is_copied_from_its_memory_which_may_differ_from_its_files(
    tmp_path: Any, cpu_ring: list[list[FillJob]]
) -> None:
    """A read-only tree is mapped copy-on-write: a write through a plain alias (a module bound
    to it and trained) changes this process's pages, not the files. The load takes the pages."""
    src, tree = written_privately(tmp_path)
    with memtree.empty_init():
        net = Net()
    load_into_module(net, tree, device="cpu")
    assert_written_privately(net, src)
    assert_read_not_mapped(net, cpu_ring, MemoryRange)
    live = Net()  # filled in place: the same pages
    load_into_module(live, tree)
    assert live.fc.weight[0, 0].item() == 42.0


def test_a_state_dict_in_memory_is_copied_through_the_ring(cpu_ring: list[list[FillJob]]) -> None:
    src = trained()
    state = {k: v.clone() for k, v in src.state_dict().items()}
    state["fc.weight"] = src.fc.weight.detach().t().contiguous().t()  # not contiguous: copied by .to()
    with memtree.empty_init():
        net = Net()
    load_into_module(net, state, device="cpu")
    assert_loaded(net, src)
    jobs = filled(cpu_ring)
    assert net.fc.weight.data_ptr() not in jobs
    assert isinstance(jobs[net.fc.bias.data_ptr()].source, MemoryRange)


def test_a_live_model_filled_from_a_shared_tree_reads_the_files(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a tree's leaves were copied from their mappings (page faults, SIGBUS on a
    truncated file) although their files hold exactly their bytes; now read with preadv."""
    calls: list[int] = []
    real = fill_mod.fill
    monkeypatch.setattr(loading_mod, "fill", lambda jobs, **kw: (calls.append(len(jobs)), real(jobs, **kw)))
    src = trained()
    tree = load_memmap(save(src, "memtree", tmp_path))
    net = Net()
    load_into_module(net, tree)
    assert_loaded(net, src)
    assert calls == [len(src.state_dict())]


def test_a_shared_tree_whose_file_was_truncated_raises_instead_of_faulting(tmp_path: Any) -> None:
    """Regression: copying from the mapping of a truncated file killed the process (SIGBUS)."""
    tree = load_memmap(save(trained(), "memtree", tmp_path))
    net = Net()
    before = {k: raw(v) for k, v in net.state_dict().items()}
    os.truncate(tree["fc", "weight"].filename, 100)
    with pytest.raises(StorageError, match=r"weight\.memmap.*truncated.*Nothing was written"):
        load_into_module(net, tree)
    assert {k: raw(v) for k, v in net.state_dict().items()} == before


def test_to_module_inplace_fills_through_the_ring_and_shared_storages_in_order(cpu_ring: list[list[FillJob]]) -> None:
    class Fused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            qkv = torch.zeros(3, 4)
            self.register_buffer("q", qkv[0])
            self.register_buffer("k", qkv[1])
            self.w = nn.Parameter(torch.zeros(5, 6))

    m = Fused()
    values = {"q": torch.full((4,), 1.0), "k": torch.full((4,), 2.0), "w": torch.arange(30.0).reshape(5, 6)}
    TensorTree(values).to_module(m, inplace=True)
    assert torch.equal(m.q, values["q"]) and torch.equal(m.k, values["k"]) and torch.equal(m.w, values["w"])
    jobs = filled(cpu_ring)
    assert list(jobs) == [m.w.data_ptr()]  # q and k share a storage: copy_, in order


# -- errors ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fail_at", [1, 6])
def test_a_read_failing_mid_load_binds_nothing_and_leaves_no_thread_or_descriptor(
    tmp_path: Any, cpu_ring: list[list[FillJob]], monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    monkeypatch.setattr(fill_mod, "READ_CHUNK", 64)
    path = save(trained(), "memtree", tmp_path)
    fail_preadv_at(monkeypatch, fail_at)
    with memtree.empty_init():
        net = Net()
    before = _open_fds()
    with pytest.raises(StorageError, match=r"leaf .*\.memmap") as info:
        load_into_module(net, path, device="cpu")
    del info
    assert _open_fds() == before
    assert all(t.is_meta for t in net.state_dict().values())  # nothing bound
    assert no_reader_threads()
