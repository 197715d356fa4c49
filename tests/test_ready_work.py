"""The work of getting a model ready (issue 25, W4): what binding a loaded tree costs per leaf.

Wall times on a shared machine say little, so these tests pin work counts instead: calls that
cost microseconds each and that the path of ``load_memmap(d).to_module(model)`` (the W4 and
GPT-2 "model ready" rows) no longer makes for every leaf.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memtree
from memtree.store.reading.mapped import MemoryMappedTensor


def _model() -> nn.Module:
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(8)), nn.LayerNorm(4))


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    model = _model()
    memtree.TensorTree.from_module(model).memmap(tmp_path / "t")
    return tmp_path / "t", model


def _count_torch_function(monkeypatch):
    """The names of the calls routed through ``MemoryMappedTensor.__torch_function__``."""
    calls: list[str] = []
    original = MemoryMappedTensor.__torch_function__.__func__

    def counting(cls, func, types, args=(), kwargs=None):
        calls.append(getattr(func, "__name__", repr(func)))
        return original(cls, func, types, args, kwargs)

    monkeypatch.setattr(MemoryMappedTensor, "__torch_function__", classmethod(counting))
    return calls


def test_binding_a_mapped_tree_asks_its_leaves_nothing_through_torch_function(saved, monkeypatch):
    # each question to a MemoryMappedTensor (requires_grad, shape, device) goes through its
    # __torch_function__ (~2 us); the bind makes the plain tensor first and asks that
    path, original = saved
    with memtree.empty_init():
        model = _model()
    calls = _count_torch_function(monkeypatch)
    swap = memtree.load_memmap(path).to_module(model)
    assert calls == []
    for name, t in model.state_dict().items():
        assert torch.equal(t, original.state_dict()[name]), name
        assert type(t) is torch.Tensor
    assert all(type(p) is nn.Parameter and p.requires_grad for p in model.parameters())
    swap.to_module(model, return_swap=False)  # bound back: the meta tensors again
    assert all(p.is_meta for p in model.parameters())


def test_a_tree_of_mapped_leaves_is_built_without_torch_function(saved, monkeypatch):
    path, _ = saved
    tree = memtree.load_memmap(path)
    calls = _count_torch_function(monkeypatch)
    copy = memtree.TensorTree({"a": tree["0"]["weight"], "b": {"c": tree["1"]["bias"]}})
    assert calls == []
    assert type(copy["a"]) is MemoryMappedTensor and copy["b", "c"].shape == (4,)
