"""The tensor methods users reach for on a whole tree (``memtree/tree/parts/tensor_ops.py``),
``to(device=, dtype=)``, and ``LoadResult.missing_keys``/``unexpected_keys``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memtree
from memtree import (
    InvalidArgumentError,
    InvalidIndexError,
    MemtreeKeyError,
    ReadOnlyError,
    ShapeMismatchError,
    TensorTree,
)


def _tree() -> TensorTree:
    return TensorTree(
        {
            "obs": torch.arange(24.0).reshape(4, 3, 2),
            "act": torch.arange(12).reshape(4, 3),
            "sub": TensorTree({"h": torch.arange(4 * 3 * 5).reshape(4, 3, 5)}, batch_size=[4, 3, 5]),
            "name": "run",
        },
        batch_size=[4, 3],
    )


@pytest.mark.parametrize(
    ("method", "dtype"),
    [("float", torch.float32), ("double", torch.float64), ("half", torch.float16), ("bfloat16", torch.bfloat16),
     ("int", torch.int32), ("long", torch.int64), ("bool", torch.bool)],
)
def test_casts_cast_every_tensor_leaf_and_keep_the_rest(method, dtype):
    tree = _tree()
    out = getattr(tree, method)()
    for key in ("obs", "act", ("sub", "h")):
        assert out[key].dtype is dtype and torch.equal(out[key], tree[key].to(dtype))
    assert out["name"] == "run" and out.batch_size == tree.batch_size and out["sub"].batch_size == (4, 3, 5)
    assert tree["obs"].dtype is torch.float32 and tree["act"].dtype is torch.int64  # self unchanged


def test_a_cast_to_the_same_dtype_of_a_mapped_tree_copies_nothing(tmp_path):
    mapped = TensorTree({"w": torch.ones(3)}).memmap(tmp_path / "t")
    assert mapped.float()["w"].data_ptr() == mapped["w"].data_ptr()
    assert not mapped.double()["w"].data_ptr() == mapped["w"].data_ptr()


def test_casts_keep_a_tensorclass():
    @memtree.tensorclass
    class Step:
        obs: torch.Tensor

    assert type(Step(torch.zeros(2, 3), batch_size=[2]).half()) is Step


def test_to_takes_torch_forms_and_keywords():
    tree = _tree()
    assert tree.to(torch.float16)["act"].dtype is torch.float16
    assert tree.to("cpu")["obs"].dtype is torch.float32 and tree.to("cpu").device == torch.device("cpu")
    both = tree.to("cpu", torch.bfloat16)
    assert both["obs"].dtype is torch.bfloat16 and both.device == torch.device("cpu")
    kw = tree.to(device="cpu", dtype=torch.int8, non_blocking=True)
    assert kw["obs"].dtype is torch.int8 and kw.device == torch.device("cpu")
    assert tree.to(dtype=torch.float64)["sub", "h"].dtype is torch.float64
    assert tree.to(torch.device("meta"))["obs"].is_meta
    assert tree.to("cpu", torch.float16, True)["obs"].dtype is torch.float16  # torch's positional non_blocking


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [((), {}, "needs a device or a dtype"), ((torch.float16, torch.int8), {}, "two dtypes"),
     (("cpu",), {"device": "cpu"}, "two devices"), ((torch.float16,), {"dtype": torch.int8}, "two dtypes"),
     ((3.5,), {}, "float"), (("nonsense",), {}, "device must name a torch device")],
)
def test_to_refuses_what_is_neither_one_device_nor_one_dtype(args, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        _tree().to(*args, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a process without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    for call in (lambda: _tree().cuda(), lambda: _tree().to(device="cuda:0"), lambda: _tree().cuda(1)):
        with pytest.raises(InvalidArgumentError, match="cuda"):
            call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_moves_every_leaf():  # pragma: no cover - CPU machines skip it
    out = _tree().cuda()
    assert out["obs"].is_cuda and out["sub", "h"].is_cuda and out.device.type == "cuda"
    assert torch.equal(out.cpu()["obs"], _tree()["obs"])


def test_detach_shares_memory_and_drops_the_graph():
    w = torch.ones(3, requires_grad=True)
    tree = TensorTree({"y": w * 2})
    out = tree.detach()
    assert not out["y"].requires_grad and out["y"].data_ptr() == tree["y"].data_ptr()


def test_split_chunk_unbind_match_torch_and_are_views():
    tree = _tree()
    parts = tree.split([1, 3])
    assert [p.batch_size for p in parts] == [torch.Size([1, 3]), torch.Size([3, 3])]
    assert torch.equal(parts[1]["obs"], tree["obs"][1:]) and torch.equal(parts[1]["sub", "h"], tree["sub", "h"][1:])
    parts[0]["obs"].fill_(-1)
    assert (tree["obs"][0] == -1).all()  # a view: writes reach the tree
    by_dim1 = tree.split(2, dim=1)
    assert [p.batch_size for p in by_dim1] == [torch.Size([4, 2]), torch.Size([4, 1])]
    assert torch.equal(by_dim1[1]["act"], tree["act"][:, 2:])
    assert [len(p) for p in tree.chunk(3)] == [len(c) for c in torch.arange(4).chunk(3)]
    rows = tree.unbind(1)
    assert len(rows) == 3 and rows[2].batch_size == (4,) and torch.equal(rows[2]["act"], tree["act"][:, 2])
    assert rows[0]["sub"].batch_size == (4, 5) and rows[0]["name"] == "run"


def test_batch_dim_methods_refuse_dims_outside_the_batch():
    tree = _tree()
    for call in (lambda: tree.split(1, dim=2), lambda: tree.unbind(-3), lambda: tree.chunk(2, dim=5),
                 lambda: TensorTree({"x": torch.ones(2)}).unbind(0), lambda: tree.permute(0, 0),
                 lambda: tree.transpose(0, 2)):
        with pytest.raises(InvalidIndexError, match="batch"):
            call()
    with pytest.raises(InvalidArgumentError, match="chunks"):
        tree.chunk(0)


def test_view_permute_transpose_act_on_the_batch_dims_only():
    tree = _tree()
    assert tree.view(12)["obs"].shape == (12, 2) and tree.view(-1)["sub", "h"].shape == (12, 5)
    assert tree.view(12)["obs"].data_ptr() == tree["obs"].data_ptr()
    permuted = tree.permute(1, 0)
    assert permuted.batch_size == (3, 4) and permuted["obs"].shape == (3, 4, 2) and permuted["sub", "h"].shape == (3, 4, 5)
    assert torch.equal(permuted["obs"][2, 1], tree["obs"][1, 2])
    assert torch.equal(tree.transpose(0, 1)["act"], tree["act"].T)
    with pytest.raises(ShapeMismatchError, match="view"):
        tree.permute(1, 0).view(12)  # not viewable: reshape copies instead
    with pytest.raises(ShapeMismatchError, match="cannot be viewed"):
        tree.view(5)


def test_in_place_methods_write_into_the_files_of_a_mapped_tree(tmp_path):
    tree = _tree().memmap(tmp_path / "t")
    done = torch.tensor([True, False, False, True])
    assert tree.masked_fill_(done, -1) is tree
    again = memtree.load_memmap(tmp_path / "t", mode="r")
    assert (again["obs"][0] == -1).all() and (again["obs"][1] >= 0).all() and (again["sub", "h"][3] == -1).all()
    tree.fill_("act", 7)
    assert (memtree.load_memmap(tmp_path / "t")["act"] == 7).all()
    tree.apply_(lambda t: t * 2)
    assert (memtree.load_memmap(tmp_path / "t")["act"] == 14).all()
    tree.zero_()
    assert not memtree.load_memmap(tmp_path / "t")["obs"].any()


def test_in_place_methods_on_a_read_only_tree_raise(tmp_path):
    _tree().memmap(tmp_path / "t")
    ro = memtree.load_memmap(tmp_path / "t", mode="r")
    for call in (lambda: ro.zero_(), lambda: ro.fill_("act", 1), lambda: ro.masked_fill_(torch.ones(4, dtype=torch.bool), 0),
                 lambda: ro.apply_(lambda t: t + 1)):
        with pytest.raises(ReadOnlyError):
            call()
    assert torch.equal(ro["obs"], _tree()["obs"])


def test_masked_fill_returns_a_copy_and_checks_the_mask():
    tree = _tree()
    out = tree.masked_fill(torch.tensor([[True, False, False]] * 4), 0)
    assert (out["obs"][:, 0] == 0).all() and (tree["obs"][1:, 0] != 0).all()
    for bad, match in ((torch.ones(3, dtype=torch.bool), "does not match"), (torch.ones(4), "bool tensor"),
                       (torch.ones(4, 3, 5, dtype=torch.bool), "does not match")):
        with pytest.raises((ShapeMismatchError, InvalidArgumentError), match=match):
            tree.masked_fill(bad, 0)


def test_fill_and_apply_name_what_is_wrong():
    tree = _tree()
    with pytest.raises(MemtreeKeyError, match="'name' is not a tensor leaf"):
        tree.fill_("name", 1)
    with pytest.raises(ShapeMismatchError, match="apply_: fn returned .* for 'obs'"):
        tree.apply_(lambda t: t.sum())


def test_named_apply_passes_names_as_tensordict_does():
    tree = _tree()
    seen = []
    tree.named_apply(lambda k, v: seen.append(k))
    assert seen == ["obs", "act", "h"]
    seen.clear()
    out = tree.named_apply(lambda k, v: seen.append(k) or (v * 0 if k == ("sub", "h") else v), nested_keys=True)
    assert seen == ["obs", "act", ("sub", "h")] and not out["sub", "h"].any() and out["name"] == "run"


def test_to_tensordict_shares_the_tensors():
    tensordict = pytest.importorskip("tensordict")
    tree = _tree()
    td = tree.to_tensordict()
    assert isinstance(td, tensordict.TensorDict) and td.batch_size == tree.batch_size
    assert td["obs"].data_ptr() == tree["obs"].data_ptr() and torch.equal(td["sub", "h"], tree["sub", "h"])
    assert td["sub"].batch_size == (4, 3, 5) and td["name"] == "run"


def test_load_result_has_load_state_dicts_names():
    result = memtree.load_into_module(nn.Linear(2, 3), TensorTree({"weight": torch.zeros(3, 2), "extra": torch.ones(1)}), strict=False)
    assert result.missing_keys == result.missing == ["bias"]
    assert result.unexpected_keys == result.unexpected == ["extra"]
    missing, unexpected = result
    assert (missing, unexpected) == (["bias"], ["extra"])


def test_a_tensorclass_field_may_take_the_name_of_one_of_these_methods():
    @memtree.tensorclass
    class Image:
        pixels: torch.Tensor
        split: str = "train"
        view: str = "front"

    images = Image(torch.zeros(4, 2), batch_size=[4])
    assert images.split == "train" and images.view == "front" and images[1].split == "train"
    parts = TensorTree.split(images, 2)  # the method, through the class
    assert [type(p) for p in parts] == [Image, Image] and parts[0].split == "train"
    assert [len(p) for p in images.chunk(2)] == [2, 2] and images.half().pixels.dtype is torch.float16
    with pytest.raises(memtree.TensorclassError, match="would hide TensorTree.apply"):
        @memtree.tensorclass
        class Bad:
            apply: str = "x"
