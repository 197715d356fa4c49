"""The work of getting a model ready (issue 25, W4): what binding a loaded tree costs per leaf.

Wall times on a shared machine say little, so these tests pin work counts instead: calls that
cost microseconds each and that the path of ``load_memmap(d).to_module(model)`` (the W4 and
GPT-2 "model ready" rows) no longer makes for every leaf.
"""

from __future__ import annotations

import os
from collections import OrderedDict

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


# ---------------------------------------------------------------------------------------------
# meta.json validated once per process for the same bytes (store/reading/storage.read_meta)


@pytest.fixture
def parses(monkeypatch):
    """The paths of the meta.json files validated (parse_level), in order, from an empty cache."""
    from memtree.store.reading import storage

    monkeypatch.setattr(storage, "_PARSED", OrderedDict(), raising=False)
    monkeypatch.setattr(storage, "_parsed_bytes", 0, raising=False)
    seen: list[str] = []
    original = storage.parse_level

    def counting(data, where, *, depth=0):
        seen.append(where)
        return original(data, where, depth=depth)

    monkeypatch.setattr(storage, "parse_level", counting)
    return seen


def _levels(path) -> int:
    return sum(1 for _, _, files in os.walk(path) if "meta.json" in files)


def test_a_tree_loaded_again_validates_each_meta_json_once(saved, parses):
    path, original = saved
    for _ in range(3):
        with memtree.empty_init():
            model = _model()
        memtree.load_memmap(path).to_module(model)
        assert all(torch.equal(t, original.state_dict()[k]) for k, t in model.state_dict().items())
    assert len(parses) == len(set(parses)) == _levels(path)


def test_new_bytes_are_validated_again_and_bad_bytes_every_time(tmp_path, parses):
    d = tmp_path / "t"
    memtree.TensorTree({"a": {"x": torch.zeros(2)}}).memmap(d)
    assert memtree.load_memmap(d)["a", "x"].tolist() == [0.0, 0.0]
    memtree.TensorTree({"a": {"x": torch.ones(3)}}).memmap(d, existsok=True)  # new bytes
    assert memtree.load_memmap(d)["a", "x"].tolist() == [1.0, 1.0, 1.0]
    assert len(parses) == 4
    sub = d / "a" / "meta.json"
    sub.write_bytes(sub.read_bytes().replace(b'"shape":[3]', b'"shape":[-3]'))
    parses.clear()
    for _ in range(2):  # a failed validation is never kept: raised every time
        with pytest.raises(memtree.MetaFormatError, match="shape"):
            memtree.load_memmap(d)["a", "x"]
    assert parses.count(str(sub)) == 2


def test_the_same_bytes_at_another_depth_are_validated_there(tmp_path):
    # the root's meta.json (with its tree_hash, allowed only at the root) copied into a sub-level:
    # the cache holds it as a root's, and the sub-level still refuses it
    d = tmp_path / "t"
    memtree.TensorTree({"x": torch.zeros(2), "a": {"y": torch.ones(1)}}).memmap(d)
    memtree.load_memmap(d)["x"]
    root = (d / "meta.json").read_bytes()
    assert b"tree_hash" in root
    (d / "a" / "meta.json").write_bytes(root)
    with pytest.raises(memtree.MetaFormatError, match="tree_hash"):
        memtree.load_memmap(d)["a"]["x"]


def test_the_kept_levels_stay_within_their_bound(tmp_path, monkeypatch):
    from memtree.store.reading import storage

    monkeypatch.setattr(storage, "PARSED_CACHE_BYTES", 2000)
    monkeypatch.setattr(storage, "_PARSED", OrderedDict())
    monkeypatch.setattr(storage, "_parsed_bytes", 0)
    for i in range(20):
        d = tmp_path / str(i)
        memtree.TensorTree({"x": torch.full((2,), float(i)), "a": {"y": torch.ones(1)}}).memmap(d)
        assert memtree.load_memmap(d)["a", "y"].tolist() == [1.0]
        assert storage._parsed_bytes == sum(len(data) for data, _ in storage._PARSED) <= 2000
    assert 0 < len(storage._PARSED) < 40


def test_a_json_value_changed_by_its_reader_is_read_from_the_file_again(tmp_path):
    d = tmp_path / "t"
    memtree.TensorTree({"betas": [0.9, {"eps": [1e-8]}], "w": torch.ones(1)}).memmap(d)
    first = memtree.load_memmap(d)["betas"]
    first[1]["eps"].append(7.0)  # the reader's own list: a later load must not see this
    first.append(1.0)
    again = memtree.load_memmap(d)["betas"]
    assert again == [0.9, {"eps": [1e-8]}] and again is not first


def test_a_restored_state_changed_by_the_loop_is_restored_as_saved(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, {"groups": [{"lr": 0.1, "params": [0, 1]}], "w": torch.ones(2)})
    state = ckpt.restore(1)
    state["groups"][0]["lr"] = 0.5
    state["groups"][0]["params"].append(2)
    assert ckpt.restore(1)["groups"] == [{"lr": 0.1, "params": [0, 1]}]


def test_a_level_holding_a_subclass_is_validated_on_every_load(tmp_path, parses):
    from subclassutil import same_subclass, scaled

    d = tmp_path / "t"
    w = scaled(cfg={"k": (1, 2)})  # a context of lists and dicts in the level's meta.json
    memtree.TensorTree({"w": w, "a": {"x": torch.ones(2)}}).memmap(d)
    for _ in range(2):
        tree = memtree.load_memmap(d)
        assert same_subclass(tree["w"], w) and tree["a", "x"].tolist() == [1.0, 1.0]
    levels = [str(d / "meta.json"), str(d / "w" / "meta.json"), str(d / "a" / "meta.json")]
    assert [parses.count(p) for p in levels] == [2, 1, 1]  # the group's level holds plain leaves
