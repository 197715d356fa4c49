"""Attacks on memtree.saving/loading: tensor subclasses, callable map_location with
weights_only, nested contexts with different path callbacks, an error in the middle of a save.
(Hostile references in the pickle are tested in ``test_routing.py``.)"""

from __future__ import annotations

import os

import pytest
import torch

import memtree


def test_parameters_views_and_mapped_tensors_round_trip(tmp_path):
    memtree.TensorTree({"x": torch.arange(5.0)}).memmap(tmp_path / "tree")
    mapped = memtree.load_memmap(tmp_path / "tree")["x"]
    base = torch.arange(10.0)
    obj = {"p": torch.nn.Parameter(torch.ones(3)), "view": base[2:5], "base": base, "mapped": mapped}
    with memtree.saving():
        torch.save(obj, tmp_path / "ck.pt")
    assert os.path.isdir(tmp_path / "ck.pt.memtree")
    with memtree.loading():
        got = torch.load(tmp_path / "ck.pt", weights_only=True, map_location=lambda storage, loc: storage)
    assert type(got["p"]) is torch.nn.Parameter and got["p"].requires_grad
    assert torch.equal(got["view"], torch.tensor([2.0, 3.0, 4.0]))
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    assert torch.equal(got["mapped"], torch.arange(5.0))


def test_nested_contexts_the_innermost_callback_decides(tmp_path):
    with memtree.saving(path=lambda f: str(tmp_path / "outer")):
        with memtree.saving(path=lambda f: None):
            torch.save({"x": torch.ones(2)}, tmp_path / "plain.pt")
        torch.save({"x": torch.ones(2)}, tmp_path / "routed.pt")
    assert sorted(os.listdir(tmp_path)) == ["outer", "plain.pt", "routed.pt"]
    assert torch.equal(torch.load(tmp_path / "plain.pt")["x"], torch.ones(2))  # a plain torch.save file
    with memtree.loading(path=lambda f: str(tmp_path / "outer")):
        assert torch.equal(torch.load(tmp_path / "routed.pt")["x"], torch.ones(2))


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("cannot pickle this")


def test_an_error_in_the_middle_of_a_save_leaves_the_old_pair(tmp_path):
    with memtree.saving():
        torch.save({"x": torch.ones(2)}, tmp_path / "ck.pt")
    before = sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "ck.pt.memtree"))
    with pytest.raises(RuntimeError, match="cannot pickle"):
        with memtree.saving():
            torch.save({"x": torch.zeros(2), "bad": _Unpicklable()}, tmp_path / "ck.pt")
    assert (sorted(os.listdir(tmp_path)), sorted(os.listdir(tmp_path / "ck.pt.memtree"))) == before
    with memtree.loading():
        assert torch.equal(torch.load(tmp_path / "ck.pt", weights_only=True)["x"], torch.ones(2))
