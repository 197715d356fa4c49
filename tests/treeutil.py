"""Bit-exact comparison helpers shared by the TensorTree test files."""

from __future__ import annotations

import torch

from memtree import TensorTree


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # a fresh dense copy: views may keep odd strides (size-1 or empty dims) that .view refuses
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def bits_equal(a, b) -> bool:
    """Bit-exact equality of two tensors (dtype, shape, device and bytes)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape) or a.device != b.device:
        return False
    return torch.equal(_bytes(a), _bytes(b))


def assert_leaf_equal(actual, expected, where=""):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {actual!r}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert tuple(actual.shape) == tuple(expected.shape), (
            f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert bits_equal(actual, expected), f"{where}: values differ"
    else:
        assert not isinstance(actual, TensorTree), f"{where}: got a sub-tree"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def norm_key(k):
    return k if isinstance(k, tuple) else (k,)


def leaf_dict(tree: TensorTree) -> dict:
    """{key tuple: leaf} for every leaf (tensor or non-tensor) of ``tree``."""
    return {norm_key(k): v for k, v in tree.items(include_nested=True, leaves_only=True)}


def assert_tree_equal_to(tree: TensorTree, expected: dict, batch_size=None):
    """``expected`` maps key tuples to leaves."""
    assert isinstance(tree, TensorTree)
    if batch_size is not None:
        assert tuple(tree.batch_size) == tuple(batch_size)
    got = leaf_dict(tree)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert_leaf_equal(got[k], v, where=repr(k))


def nested_from_flat(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        d = out
        for p in path[:-1]:
            d = d.setdefault(p, {})
        d[path[-1]] = v
    return out
