"""Example-based tests of the in-memory ``TensorTree`` API (SPEC §3).

Every check compares a tree operation against doing the same thing to each leaf tensor
directly with torch, bit-exactly.
"""

from __future__ import annotations

import collections
import re

import pytest
import torch

import memtree
from memtree import TensorTree
from treeutil import (
    assert_leaf_equal,
    assert_tree_equal_to,
    bits_equal,
    leaf_dict,
    nested_from_flat,
    set_ref,
)

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def make_leaves():
    """Leaves of the standard (3, 4)-batched test tree, as {key tuple: tensor or value}."""
    return {
        ("obs",): torch.arange(3 * 4 * 5, dtype=torch.float32).reshape(3, 4, 5) / 7,
        ("act",): torch.arange(12, dtype=torch.int64).reshape(3, 4) - 5,
        ("nested", "mask"): torch.arange(12).reshape(3, 4) % 3 == 0,
        ("nested", "deep", "w"): (torch.arange(3 * 4 * 2).reshape(3, 4, 2) * 1.5).to(
            torch.bfloat16
        ),
        ("nested", "deep", "u8"): (torch.arange(12).reshape(3, 4) * 37 % 256).to(torch.uint8),
        ("name",): "hello",
    }


def make_tree(leaves=None) -> TensorTree:
    leaves = make_leaves() if leaves is None else leaves
    src = nested_from_flat({k: (v.clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in leaves.items()})
    return TensorTree(src, batch_size=(3, 4))


def tensor_leaves(leaves: dict) -> dict:
    return {k: v for k, v in leaves.items() if isinstance(v, torch.Tensor)}


def random_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if t.dtype == torch.bool:
        return torch.randint(0, 2, t.shape, generator=g).bool()
    if t.dtype.is_floating_point:
        return torch.randn(t.shape, generator=g).to(t.dtype)
    return torch.randint(0, 200, t.shape, generator=g).to(t.dtype)


# --------------------------------------------------------------------------------------------
# public names
# --------------------------------------------------------------------------------------------


def test_public_names_exist():
    for name in ["TensorTree", "MemoryMappedTensor", "NonTensor", "stack", "cat", "load_memmap"]:
        assert hasattr(memtree, name), name
    for name in memtree.errors.__all__:
        assert getattr(memtree, name) is getattr(memtree.errors, name)


def test_error_classes_subclass_builtins():
    assert issubclass(memtree.MemtreeKeyError, KeyError)
    assert issubclass(memtree.KeyTypeError, TypeError)
    assert issubclass(memtree.InvalidKeyError, ValueError)
    assert issubclass(memtree.BatchSizeError, ValueError)
    assert issubclass(memtree.KeyCollisionError, ValueError)
    assert issubclass(memtree.LockedError, memtree.MemtreeError)


# --------------------------------------------------------------------------------------------
# construction
# --------------------------------------------------------------------------------------------


def test_empty_tree_has_no_keys_and_empty_batch_size():
    tree = TensorTree()
    assert list(tree.keys()) == []
    assert tuple(tree.batch_size) == ()


def test_construction_from_nested_mapping_builds_subtrees():
    tree = make_tree()
    assert isinstance(tree["nested"], TensorTree)
    assert isinstance(tree["nested"]["deep"], TensorTree)
    assert_tree_equal_to(tree, make_leaves(), batch_size=(3, 4))


def test_nested_mapping_subtrees_get_parent_batch_size():
    tree = make_tree()
    assert tuple(tree["nested"].batch_size) == (3, 4)
    assert tuple(tree["nested", "deep"].batch_size) == (3, 4)


def test_construction_does_not_require_leaves_to_be_contiguous():
    t = torch.arange(20.0).reshape(5, 4).t()
    tree = TensorTree({"x": t}, batch_size=(4,))
    assert bits_equal(tree["x"], t)


def test_construction_from_tensortree_source():
    tree = make_tree()
    copy = TensorTree(tree, batch_size=(3, 4))
    assert_tree_equal_to(copy, make_leaves(), batch_size=(3, 4))


@pytest.mark.parametrize("bs", [(3, 4), [3, 4], torch.Size([3, 4])])
def test_batch_size_accepts_tuple_list_and_size(bs):
    tree = TensorTree({"x": torch.zeros(3, 4, 2)}, batch_size=bs)
    assert tree.batch_size == torch.Size([3, 4])
    assert tuple(tree.batch_size) == (3, 4)


def test_batch_size_prefix_of_leaf_shape_is_accepted():
    tree = TensorTree({"x": torch.zeros(3, 4, 2), "y": torch.zeros(3)}, batch_size=(3,))
    assert tuple(tree.batch_size) == (3,)


def test_empty_batch_size_accepts_any_leaf_including_scalar():
    tree = TensorTree({"s": torch.tensor(1.5), "v": torch.zeros(7), "m": torch.zeros(2, 9)})
    assert tuple(tree.batch_size) == ()
    assert bits_equal(tree["s"], torch.tensor(1.5))


def test_construction_batch_size_mismatch_names_the_key():
    with pytest.raises(memtree.BatchSizeError) as err:
        TensorTree({"bad_leaf_name": torch.zeros(3)}, batch_size=(4,))
    assert "bad_leaf_name" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_construction_batch_size_mismatch_in_subtree_names_the_key():
    with pytest.raises(memtree.BatchSizeError) as err:
        TensorTree({"outer_k": {"inner_leaf_k": torch.zeros(3, 2)}}, batch_size=(4,))
    assert "inner_leaf_k" in str(err.value)


def test_construction_leaf_with_too_few_dims_is_refused():
    with pytest.raises(memtree.BatchSizeError) as err:
        TensorTree({"scalar_leaf": torch.tensor(1.0)}, batch_size=(3,))
    assert "scalar_leaf" in str(err.value)


def test_construction_second_batch_dim_mismatch_is_refused():
    with pytest.raises(memtree.BatchSizeError) as err:
        TensorTree({"second_dim_bad": torch.zeros(3, 5)}, batch_size=(3, 4))
    assert "second_dim_bad" in str(err.value)


def test_set_leaf_batch_size_mismatch_names_key_and_leaves_tree_unchanged():
    tree = make_tree()
    with pytest.raises(memtree.BatchSizeError) as err:
        tree["new_bad_key"] = torch.zeros(2, 4)
    assert "new_bad_key" in str(err.value)
    assert "new_bad_key" not in tree


def test_set_nested_leaf_batch_size_mismatch_names_key():
    tree = make_tree()
    with pytest.raises(memtree.BatchSizeError) as err:
        tree["nested", "nested_bad_key"] = torch.zeros(3, 3)
    assert "nested_bad_key" in str(err.value)
    assert ("nested", "nested_bad_key") not in tree


def test_failed_set_of_new_nested_key_leaves_no_intermediate_subtree():
    tree = make_tree()
    with pytest.raises(memtree.BatchSizeError):
        tree["fresh_parent", "fresh_child"] = torch.zeros(2)
    assert "fresh_parent" not in tree
    assert set(tree.keys()) == {"obs", "act", "nested", "name"}


def test_replacing_leaf_with_wrong_batch_size_keeps_old_leaf():
    tree = make_tree()
    with pytest.raises(memtree.BatchSizeError):
        tree["obs"] = torch.zeros(4, 3)
    assert_leaf_equal(tree["obs"], make_leaves()[("obs",)])


def test_set_subtree_with_mismatched_batch_size_is_refused():
    tree = make_tree()
    with pytest.raises(memtree.BatchSizeError):
        tree["sub_bad"] = TensorTree({"x": torch.zeros(2)}, batch_size=(2,))
    assert "sub_bad" not in tree


def test_non_tensor_leaves_are_exempt_from_batch_size():
    tree = TensorTree({"name": "x", "n": 3, "l": [1, 2]}, batch_size=(3,))
    assert tree["name"] == "x"
    assert tree["n"] == 3


def test_device_argument_sets_tree_device():
    tree = TensorTree({"x": torch.zeros(3)}, batch_size=(3,), device="cpu")
    assert tree.device == torch.device("cpu")
    assert tree["x"].device == torch.device("cpu")


# --------------------------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------------------------


def test_tuple_key_reaches_nested_leaf():
    tree = make_tree()
    assert_leaf_equal(tree["nested", "mask"], make_leaves()[("nested", "mask")])
    assert_leaf_equal(tree["nested", "deep", "w"], make_leaves()[("nested", "deep", "w")])
    assert_leaf_equal(tree[("nested", "deep", "w")], make_leaves()[("nested", "deep", "w")])
    assert_leaf_equal(tree["nested"]["deep"]["w"], make_leaves()[("nested", "deep", "w")])


def test_set_tuple_key_creates_intermediate_subtrees():
    tree = make_tree()
    t = torch.ones(3, 4, 2)
    tree["x", "y", "z"] = t
    assert isinstance(tree["x"], TensorTree)
    assert isinstance(tree["x", "y"], TensorTree)
    assert tuple(tree["x"].batch_size) == (3, 4)
    assert tuple(tree["x", "y"].batch_size) == (3, 4)
    assert bits_equal(tree["x"]["y"]["z"], t)


def test_set_tuple_key_into_existing_subtree():
    tree = make_tree()
    tree["nested", "extra"] = torch.zeros(3, 4)
    assert bits_equal(tree["nested"]["extra"], torch.zeros(3, 4))
    assert ("nested", "mask") in tree


def test_set_plain_mapping_value_becomes_subtree():
    tree = make_tree()
    tree["sub"] = {"p": torch.zeros(3, 4), "q": {"r": torch.ones(3, 4, 1)}}
    assert isinstance(tree["sub"], TensorTree)
    assert tuple(tree["sub"].batch_size) == (3, 4)
    assert bits_equal(tree["sub", "q", "r"], torch.ones(3, 4, 1))


def test_set_tensortree_value_becomes_subtree():
    tree = make_tree()
    sub = TensorTree({"p": torch.zeros(3, 4, 2)}, batch_size=(3, 4))
    tree["sub"] = sub
    assert isinstance(tree["sub"], TensorTree)
    assert bits_equal(tree["sub", "p"], torch.zeros(3, 4, 2))


def test_replace_leaf_with_different_trailing_shape_and_dtype():
    tree = make_tree()
    t = torch.ones(3, 4, 7, dtype=torch.float64)
    tree["obs"] = t
    assert bits_equal(tree["obs"], t)


@pytest.mark.parametrize("key", [1, 2.5, b"bytes", None, object()])
def test_non_str_key_in_constructor_raises_keytypeerror(key):
    with pytest.raises(memtree.KeyTypeError):
        TensorTree({key: torch.zeros(3)}, batch_size=(3,))


def test_non_str_key_in_nested_mapping_raises_keytypeerror():
    with pytest.raises(memtree.KeyTypeError):
        TensorTree({"b": {2: torch.zeros(3)}}, batch_size=(3,))


def test_non_str_key_in_update_raises_keytypeerror():
    tree = make_tree()
    with pytest.raises(memtree.KeyTypeError):
        tree.update({3.5: torch.zeros(3, 4)})


def test_tuple_key_with_non_str_element_raises_keytypeerror():
    tree = make_tree()
    with pytest.raises(memtree.KeyTypeError):
        tree["nested", 3] = torch.zeros(3, 4)


@pytest.mark.parametrize("op", ["get", "pop", "select", "exclude", "del", "rename_key"])
def test_key_methods_refuse_non_str_keys(op):
    # tree[0] is a batch index, but the key-only methods take keys: 0 is not a key
    tree = make_tree()
    with pytest.raises(memtree.KeyTypeError):
        if op == "get":
            tree.get(0)
        elif op == "pop":
            tree.pop(0)
        elif op == "select":
            tree.select(0)
        elif op == "exclude":
            tree.exclude(0)
        elif op == "del":
            del tree[0]
        else:
            tree.rename_key(0, "x")
    assert_tree_equal_to(tree, make_leaves(), batch_size=(3, 4))


def test_keytypeerror_is_typeerror():
    with pytest.raises(TypeError):
        TensorTree({1: torch.zeros(3)}, batch_size=(3,))


def test_empty_key_in_constructor_raises_invalidkeyerror():
    with pytest.raises(memtree.InvalidKeyError):
        TensorTree({"": torch.zeros(3)}, batch_size=(3,))


def test_empty_key_set_raises_invalidkeyerror():
    tree = make_tree()
    with pytest.raises(memtree.InvalidKeyError):
        tree[""] = torch.zeros(3, 4)
    with pytest.raises(ValueError):
        tree[""] = torch.zeros(3, 4)


def test_empty_key_in_nested_tuple_raises_invalidkeyerror():
    tree = make_tree()
    with pytest.raises(memtree.InvalidKeyError):
        tree["nested", ""] = torch.zeros(3, 4)


def test_rename_to_empty_key_raises_invalidkeyerror():
    tree = make_tree()
    with pytest.raises(memtree.InvalidKeyError):
        tree.rename_key("obs", "")


def test_rename_to_non_str_key_raises_keytypeerror():
    tree = make_tree()
    with pytest.raises(memtree.KeyTypeError):
        tree.rename_key("obs", 5)


def test_missing_key_raises_memtreekeyerror_naming_it():
    tree = make_tree()
    with pytest.raises(memtree.MemtreeKeyError) as err:
        tree["missing_key_xyz"]
    assert "missing_key_xyz" in str(err.value)
    assert isinstance(err.value, KeyError)


def test_missing_nested_key_raises_memtreekeyerror():
    tree = make_tree()
    with pytest.raises(memtree.MemtreeKeyError) as err:
        tree["nested", "missing_nested_xyz"]
    assert "missing_nested_xyz" in str(err.value)


def test_nested_key_through_a_tensor_leaf_raises_keyerror():
    tree = make_tree()
    with pytest.raises(KeyError):
        tree["obs", "below_a_leaf"]


@pytest.mark.parametrize(
    "key",
    ["a/b", "..", ".", "\x00", "a\x00b", "CON", "nul.txt", "k" * 300, "ü日本🌲", ".hidden",
     "trailing. ", "back\\slash", "new\nline", "*?<>|:\""],
)
def test_odd_str_keys_are_fine_in_memory(key):
    tree = TensorTree({key: torch.arange(3)}, batch_size=(3,))
    tree["sub", key] = torch.ones(3, 2)
    assert key in tree
    assert key in list(tree.keys())
    assert ("sub", key) in tree
    assert bits_equal(tree[key], torch.arange(3))
    assert bits_equal(tree["sub"][key], torch.ones(3, 2))
    assert bits_equal(tree[1:][key], torch.arange(3)[1:])
    assert bits_equal(tree.clone()["sub", key], torch.ones(3, 2))


def test_keys_differing_only_by_case_coexist():
    tree = TensorTree({"A": torch.zeros(2), "a": torch.ones(2)}, batch_size=(2,))
    assert bits_equal(tree["A"], torch.zeros(2))
    assert bits_equal(tree["a"], torch.ones(2))
    assert set(tree.keys()) == {"A", "a"}


# --------------------------------------------------------------------------------------------
# get / pop / del / update / select / exclude / rename_key / in
# --------------------------------------------------------------------------------------------


def test_get_returns_value_or_default():
    tree = make_tree()
    assert_leaf_equal(tree.get("obs"), make_leaves()[("obs",)])
    assert tree.get("missing") is None
    assert tree.get("missing", 5) == 5
    assert_leaf_equal(tree.get(("nested", "mask")), make_leaves()[("nested", "mask")])
    assert tree.get(("nested", "missing"), "dflt") == "dflt"


def test_get_does_not_return_default_for_none_leaf():
    tree = make_tree()
    tree["none_leaf"] = None
    assert "none_leaf" in tree
    assert tree.get("none_leaf", 5) is None


def test_contains():
    tree = make_tree()
    assert "obs" in tree
    assert "nested" in tree
    assert ("nested", "mask") in tree
    assert ("nested", "deep", "w") in tree
    assert "mask" not in tree
    assert ("nested", "zz") not in tree
    assert "zz" not in tree


def test_pop_returns_value_and_removes_key():
    tree = make_tree()
    v = tree.pop("obs")
    assert_leaf_equal(v, make_leaves()[("obs",)])
    assert "obs" not in tree


def test_pop_nested_key():
    tree = make_tree()
    v = tree.pop(("nested", "deep", "w"))
    assert_leaf_equal(v, make_leaves()[("nested", "deep", "w")])
    assert ("nested", "deep", "w") not in tree
    assert ("nested", "deep", "u8") in tree


def test_pop_subtree_returns_subtree():
    tree = make_tree()
    sub = tree.pop("nested")
    assert isinstance(sub, TensorTree)
    assert "nested" not in tree
    assert ("deep", "w") in sub


def test_pop_missing_key_raises():
    tree = make_tree()
    with pytest.raises(memtree.MemtreeKeyError):
        tree.pop("missing_pop_key")


def test_del_removes_key():
    tree = make_tree()
    del tree["act"]
    assert "act" not in tree
    assert set(tree.keys()) == {"obs", "nested", "name"}


def test_del_nested_key_and_subtree():
    tree = make_tree()
    del tree["nested", "mask"]
    assert ("nested", "mask") not in tree
    del tree["nested", "deep"]
    assert ("nested", "deep") not in tree
    assert "nested" in tree


def test_del_missing_key_raises():
    tree = make_tree()
    with pytest.raises(memtree.MemtreeKeyError):
        del tree["missing_del_key"]


def test_update_adds_and_replaces_in_place_and_returns_self():
    tree = make_tree()
    new_obs = torch.zeros(3, 4, 5)
    out = tree.update({"obs": new_obs, "added": torch.ones(3, 4)})
    assert out is tree
    assert bits_equal(tree["obs"], new_obs)
    assert bits_equal(tree["added"], torch.ones(3, 4))
    assert_leaf_equal(tree["act"], make_leaves()[("act",)])


def test_update_with_nested_mapping_merges_into_subtree():
    tree = make_tree()
    tree.update({"nested": {"new_leaf": torch.zeros(3, 4)}})
    assert bits_equal(tree["nested", "new_leaf"], torch.zeros(3, 4))
    assert_leaf_equal(tree["nested", "mask"], make_leaves()[("nested", "mask")])


def test_update_with_tensortree():
    tree = make_tree()
    other = TensorTree({"o": torch.full((3, 4), 2.0)}, batch_size=(3, 4))
    tree.update(other)
    assert bits_equal(tree["o"], torch.full((3, 4), 2.0))


def test_update_batch_size_mismatch_raises():
    tree = make_tree()
    with pytest.raises(memtree.BatchSizeError) as err:
        tree.update({"upd_bad_key": torch.zeros(5)})
    assert "upd_bad_key" in str(err.value)


def test_select_returns_new_tree_with_only_those_keys():
    tree = make_tree()
    sel = tree.select("obs", "name")
    assert set(sel.keys()) == {"obs", "name"}
    assert tuple(sel.batch_size) == (3, 4)
    assert_leaf_equal(sel["obs"], make_leaves()[("obs",)])
    assert sel["name"] == "hello"
    assert set(tree.keys()) == {"obs", "act", "nested", "name"}


def test_select_nested_key_keeps_structure():
    tree = make_tree()
    sel = tree.select(("nested", "deep", "w"), "act")
    leaves = make_leaves()
    assert_tree_equal_to(
        sel, {k: leaves[k] for k in [("nested", "deep", "w"), ("act",)]}, batch_size=(3, 4)
    )
    assert ("nested", "mask") in tree


def test_select_missing_key_raises():
    tree = make_tree()
    with pytest.raises(memtree.MemtreeKeyError):
        tree.select("obs", "missing_select_key")


def test_exclude_returns_new_tree_without_those_keys():
    tree = make_tree()
    exc = tree.exclude("obs", ("nested", "mask"))
    leaves = make_leaves()
    del leaves[("obs",)]
    del leaves[("nested", "mask")]
    assert_tree_equal_to(exc, leaves, batch_size=(3, 4))
    assert_tree_equal_to(tree, make_leaves())


def test_exclude_subtree():
    tree = make_tree()
    exc = tree.exclude("nested")
    assert set(exc.keys()) == {"obs", "act", "name"}


def test_rename_key_returns_new_tree_and_leaves_self_untouched():
    tree = make_tree()
    new = tree.rename_key("obs", "observation")
    assert new is not tree
    assert "obs" not in new
    assert_leaf_equal(new["observation"], make_leaves()[("obs",)])
    assert "observation" not in tree
    assert_tree_equal_to(tree, make_leaves())


def test_rename_key_of_subtree():
    tree = make_tree()
    new = tree.rename_key("nested", "inner")
    assert "nested" not in new
    assert_leaf_equal(new["inner", "deep", "w"], make_leaves()[("nested", "deep", "w")])


def test_rename_nested_key():
    tree = make_tree()
    new = tree.rename_key(("nested", "mask"), ("nested", "mask2"))
    assert ("nested", "mask") not in new
    assert_leaf_equal(new["nested", "mask2"], make_leaves()[("nested", "mask")])
    assert ("nested", "mask") in tree


def test_rename_missing_key_raises():
    tree = make_tree()
    with pytest.raises(memtree.MemtreeKeyError):
        tree.rename_key("missing_rename_key", "x")


# --------------------------------------------------------------------------------------------
# keys / items / values / len / shape
# --------------------------------------------------------------------------------------------


def _kv_tree():
    return TensorTree(
        {"a": torch.zeros(2), "b": {"c": torch.ones(2), "d": {"e": torch.arange(2)}}},
        batch_size=(2,),
    )


def test_keys_default_top_level_only():
    assert set(_kv_tree().keys()) == {"a", "b"}


def test_keys_preserve_insertion_order():
    tree = TensorTree({"z": torch.zeros(1), "a": torch.zeros(1), "m": torch.zeros(1)},
                      batch_size=(1,))
    tree["b"] = torch.zeros(1)
    assert list(tree.keys()) == ["z", "a", "m", "b"]


def test_keys_include_nested():
    assert set(_kv_tree().keys(include_nested=True)) == {
        "a", "b", ("b", "c"), ("b", "d"), ("b", "d", "e")
    }


def test_keys_include_nested_leaves_only():
    keys = list(_kv_tree().keys(include_nested=True, leaves_only=True))
    assert set(keys) == {"a", ("b", "c"), ("b", "d", "e")}
    assert len(keys) == 3


def test_keys_leaves_only_top_level():
    assert set(_kv_tree().keys(leaves_only=True)) == {"a"}


def test_top_level_keys_are_str_nested_keys_are_tuples():
    for k in _kv_tree().keys(include_nested=True):
        if isinstance(k, tuple):
            assert len(k) >= 2 and all(isinstance(p, str) for p in k)
        else:
            assert isinstance(k, str)


def test_items_and_values_match_keys():
    tree = _kv_tree()
    for flags in [{}, {"include_nested": True}, {"leaves_only": True},
                  {"include_nested": True, "leaves_only": True}]:
        keys = list(tree.keys(**flags))
        items = list(tree.items(**flags))
        values = list(tree.values(**flags))
        assert [k for k, _ in items] == keys
        assert len(values) == len(keys)
        for (k, v), v2 in zip(items, values):
            expected = tree[k]
            if isinstance(expected, TensorTree):
                assert isinstance(v, TensorTree) and isinstance(v2, TensorTree)
                assert set(v.keys()) == set(expected.keys())
            else:
                assert bits_equal(v, expected)
                assert bits_equal(v2, expected)


def test_non_tensor_leaves_are_leaves():
    tree = _kv_tree()
    tree["name"] = "n"
    tree["b", "cfg"] = memtree.NonTensor({"lr": 0.1})
    assert "name" in set(tree.keys(leaves_only=True))
    assert ("b", "cfg") in set(tree.keys(include_nested=True, leaves_only=True))
    assert ("b", "cfg", "lr") not in set(tree.keys(include_nested=True))


def test_len_is_first_batch_dim():
    assert len(make_tree()) == 3
    assert len(TensorTree({"x": torch.zeros(0, 2)}, batch_size=(0,))) == 0


def test_len_of_unbatched_tree_raises_typeerror():
    with pytest.raises(TypeError):
        len(TensorTree({"x": torch.zeros(3)}))


def test_shape_ndim_numel():
    tree = make_tree()
    assert tree.shape == tree.batch_size
    assert tuple(tree.shape) == (3, 4)
    assert tree.ndim == 2
    assert tree.numel() == 12
    empty = TensorTree({"x": torch.zeros(5)})
    assert empty.ndim == 0
    assert empty.numel() == 1
    zero = TensorTree({"x": torch.zeros(0, 3)}, batch_size=(0, 3))
    assert zero.numel() == 0


# --------------------------------------------------------------------------------------------
# batch indexing
# --------------------------------------------------------------------------------------------

M34 = torch.tensor([[True, False, False, True],
                    [False, False, False, False],
                    [True, True, False, True]])

# (tree index, equivalent index on each leaf)
GET_CASES = [
    ("int", 1, 1),
    ("neg_int", -1, -1),
    ("slice", slice(1, 3), slice(1, 3)),
    ("slice_step", slice(None, None, 2), slice(None, None, 2)),
    ("slice_empty", slice(2, 1), slice(2, 1)),
    ("slice_oob", slice(1, 100), slice(1, 100)),
    ("tuple_ints", (0, 2), (0, 2)),
    ("tuple_slice_int", (slice(None), 1), (slice(None), 1)),
    ("tuple_slices", (slice(1, None), slice(None, None, 3)), (slice(1, None), slice(None, None, 3))),
    ("ellipsis_int", (Ellipsis, 1), (slice(None), 1)),
    ("int_ellipsis", (1, Ellipsis), (1,)),
    ("ellipsis", Ellipsis, ()),
    ("none", None, None),
    ("slice_none", (slice(None), None), (slice(None), None)),
    ("ellipsis_none", (Ellipsis, None), (slice(None), slice(None), None)),
    ("index_tensor_dups", torch.tensor([2, 0, 2]), torch.tensor([2, 0, 2])),
    ("index_tensor_neg", torch.tensor([-1, 0]), torch.tensor([-1, 0])),
    ("index_tensor_empty", torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long)),
    ("index_tensor_2d", torch.tensor([[0, 1], [2, 2]]), torch.tensor([[0, 1], [2, 2]])),
    ("list", [0, 2], [0, 2]),
    ("bool_mask_dim0", torch.tensor([True, False, True]), torch.tensor([True, False, True])),
    ("bool_mask_full", M34, M34),
    ("bool_mask_none", torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)),
    ("slice_index_tensor", (slice(None), torch.tensor([3, 1])), (slice(None), torch.tensor([3, 1]))),
    ("index_tensor_int", (torch.tensor([0, 2]), 1), (torch.tensor([0, 2]), 1)),
    ("ellipsis_mask", (Ellipsis, torch.tensor([True, False, False, True])),
     (slice(None), torch.tensor([True, False, False, True]))),
    ("int_list", (1, [3, 0]), (1, [3, 0])),
]


@pytest.mark.parametrize("idx,leaf_idx", [c[1:] for c in GET_CASES], ids=[c[0] for c in GET_CASES])
def test_batch_index_get_matches_indexing_each_leaf(idx, leaf_idx):
    leaves = make_leaves()
    tree = make_tree(leaves)
    out = tree[idx]
    expected_bs = torch.empty(3, 4)[leaf_idx].shape
    expected = {k: (v[leaf_idx] if isinstance(v, torch.Tensor) else v) for k, v in leaves.items()}
    assert_tree_equal_to(out, expected, batch_size=expected_bs)
    assert tuple(out["nested"].batch_size) == tuple(expected_bs)


def test_batch_index_get_does_not_modify_tree():
    leaves = make_leaves()
    tree = make_tree(leaves)
    tree[M34]
    tree[torch.tensor([2, 0])]
    tree[1:]
    assert_tree_equal_to(tree, leaves, batch_size=(3, 4))


def test_int_index_on_1d_batch_gives_unbatched_tree():
    tree = TensorTree({"x": torch.arange(6).reshape(3, 2), "s": torch.arange(3)}, batch_size=(3,))
    out = tree[1]
    assert tuple(out.batch_size) == ()
    assert bits_equal(out["x"], torch.tensor([2, 3]))
    assert bits_equal(out["s"], torch.tensor(1))


def _unbatched():
    leaves = {("s",): torch.tensor(1.5), ("v",): torch.arange(3), ("n", "b"): torch.tensor(True),
              ("name",): "x"}
    return leaves, TensorTree(nested_from_flat({k: (v.clone() if isinstance(v, torch.Tensor)
                                                    else v) for k, v in leaves.items()}))


def test_unbatched_tree_ellipsis_index_returns_same_leaves():
    leaves, tree = _unbatched()
    assert_tree_equal_to(tree[...], leaves, batch_size=())


def test_unbatched_tree_none_index_adds_batch_dim():
    leaves, tree = _unbatched()
    out = tree[None]
    assert_tree_equal_to(out, {k: (v[None] if isinstance(v, torch.Tensor) else v)
                               for k, v in leaves.items()}, batch_size=(1,))


def test_unbatched_tree_ellipsis_set():
    leaves, tree = _unbatched()
    tree[...] = 0
    assert bits_equal(tree["s"], torch.tensor(0.0))
    assert bits_equal(tree["v"], torch.zeros(3, dtype=torch.int64))
    value = TensorTree({"s": torch.tensor(2.0), "v": torch.ones(3, dtype=torch.int64),
                        "n": {"b": torch.tensor(True)}, "name": "x"})
    tree[...] = value
    assert bits_equal(tree["s"], torch.tensor(2.0))
    assert bits_equal(tree["n", "b"], torch.tensor(True))


def test_unbatched_tree_int_index_raises_indexerror():
    _, tree = _unbatched()
    with pytest.raises(IndexError):
        tree[0]


def test_index_out_of_range_raises_indexerror():
    tree = make_tree()
    with pytest.raises(IndexError):
        tree[3]


def test_too_many_indices_raise():
    # obs has shape (3, 4, 5) but the batch has 2 dims: a third index must be refused
    tree = make_tree()
    with pytest.raises((IndexError, ValueError)):
        tree[0, 0, 0]


def test_basic_index_returns_views_like_torch():
    tree = make_tree()
    view = tree[1]
    view["obs"][0, 0] = 123.0
    assert tree["obs"][1, 0, 0].item() == 123.0


# (tree index, equivalent leaf index) without duplicate targets, for writes
SET_CASES = [
    ("int", 1, 1),
    ("neg_int", -1, -1),
    ("slice", slice(0, 2), slice(0, 2)),
    ("slice_step", slice(None, None, 2), slice(None, None, 2)),
    ("tuple_ints", (2, 3), (2, 3)),
    ("tuple_int_slice", (1, slice(1, 3)), (1, slice(1, 3))),
    ("ellipsis_int", (Ellipsis, 1), (slice(None), 1)),
    ("ellipsis", Ellipsis, ()),
    ("index_tensor", torch.tensor([2, 0]), torch.tensor([2, 0])),
    ("list", [0, 2], [0, 2]),
    ("bool_mask_dim0", torch.tensor([True, False, True]), torch.tensor([True, False, True])),
    ("bool_mask_full", M34, M34),
    ("slice_index_tensor", (slice(None), torch.tensor([3, 1])), (slice(None), torch.tensor([3, 1]))),
    ("ellipsis_mask", (Ellipsis, torch.tensor([True, False, False, True])),
     (slice(None), torch.tensor([True, False, False, True]))),
]


def _value_for(leaves, leaf_idx, seed=0):
    """A new leaf set shaped like leaves[...][leaf_idx] with fresh data."""
    out = {}
    for i, (k, v) in enumerate(leaves.items()):
        out[k] = random_like(v[leaf_idx], seed + i) if isinstance(v, torch.Tensor) else v
    return out


@pytest.mark.parametrize("idx,leaf_idx", [c[1:] for c in SET_CASES], ids=[c[0] for c in SET_CASES])
def test_batch_index_set_with_tree_matches_each_leaf(idx, leaf_idx):
    leaves = make_leaves()
    tree = make_tree(leaves)
    before = {k: v for k, v in leaf_dict(tree).items() if isinstance(v, torch.Tensor)}
    value_leaves = _value_for(leaves, leaf_idx)
    bs = torch.empty(3, 4)[leaf_idx].shape
    value = TensorTree(nested_from_flat(value_leaves), batch_size=bs)
    tree[idx] = value
    expected = set_ref(leaves, leaf_idx, value_leaves)
    assert_tree_equal_to(tree, expected, batch_size=(3, 4))
    # written in place: the tensors held before see the write
    for k, t in before.items():
        assert bits_equal(t, expected[k]), k


@pytest.mark.parametrize("idx,leaf_idx", [c[1:] for c in SET_CASES], ids=[c[0] for c in SET_CASES])
def test_batch_index_set_with_number_fills_every_leaf(idx, leaf_idx):
    leaves = make_leaves()
    tree = make_tree(leaves)
    tree[idx] = 1
    expected = set_ref(leaves, leaf_idx, 1)
    assert_tree_equal_to(tree, expected, batch_size=(3, 4))


def test_batch_index_set_with_nested_mapping():
    leaves = make_leaves()
    tree = make_tree(leaves)
    value_leaves = _value_for(leaves, 1, seed=7)
    tree[1] = nested_from_flat(value_leaves)
    for k, v in tensor_leaves(leaves).items():
        v = v.clone()
        v[1] = value_leaves[k]
        assert_leaf_equal(tree[k], v, where=str(k))


def test_batch_index_set_with_float_into_int_and_bool_leaves_casts_like_torch():
    tree = TensorTree({"i": torch.zeros(3, dtype=torch.int64), "b": torch.zeros(3, dtype=torch.bool),
                       "f": torch.zeros(3)}, batch_size=(3,))
    tree[0:2] = 2.0
    assert bits_equal(tree["i"], torch.tensor([2, 2, 0]))
    assert bits_equal(tree["b"], torch.tensor([True, True, False]))
    assert bits_equal(tree["f"], torch.tensor([2.0, 2.0, 0.0]))


def test_batch_index_set_with_tree_of_wrong_shape_raises():
    tree = make_tree()
    value = tree[0:2].clone()
    with pytest.raises((ValueError, RuntimeError)):
        tree[0:3] = value


def test_batch_index_set_leaves_non_tensor_leaves_alone():
    tree = make_tree()
    tree[0] = 0
    assert tree["name"] == "hello"


# --------------------------------------------------------------------------------------------
# shape ops
# --------------------------------------------------------------------------------------------


def _small():
    return {
        ("x",): torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2),
        ("s", "y"): torch.arange(12).reshape(3, 4),
        ("s", "b"): torch.arange(12).reshape(3, 4) % 2 == 1,
        ("name",): "n",
    }


def _small_tree(leaves=None, bs=(3, 4)):
    leaves = _small() if leaves is None else leaves
    return TensorTree(nested_from_flat(leaves), batch_size=bs)


def _map(leaves, fn):
    return {k: (fn(v) if isinstance(v, torch.Tensor) else v) for k, v in leaves.items()}


def test_expand_adds_leading_dims():
    leaves = _small()
    out = _small_tree(leaves).expand(2, 3, 4)
    expected = _map(leaves, lambda t: t.expand(2, *t.shape))
    assert_tree_equal_to(out, expected, batch_size=(2, 3, 4))


def test_expand_size_one_dim_and_minus_one():
    leaves = {("x",): torch.arange(8.0).reshape(1, 4, 2), ("y",): torch.arange(4).reshape(1, 4)}
    tree = TensorTree(nested_from_flat(leaves), batch_size=(1, 4))
    out = tree.expand(3, -1)
    expected = _map(leaves, lambda t: t.expand(3, *t.shape[1:]))
    assert_tree_equal_to(out, expected, batch_size=(3, 4))


def test_expand_accepts_a_size_sequence():
    leaves = _small()
    out = _small_tree(leaves).expand(torch.Size([2, 3, 4]))
    assert tuple(out.batch_size) == (2, 3, 4)
    out2 = _small_tree(leaves).expand((2, 3, 4))
    assert tuple(out2.batch_size) == (2, 3, 4)


def test_expand_incompatible_shape_raises():
    with pytest.raises((ValueError, RuntimeError)):
        _small_tree().expand(3, 5)


@pytest.mark.parametrize("dim,leaf_dim,bs", [(0, 0, (1, 3, 4)), (1, 1, (3, 1, 4)), (2, 2, (3, 4, 1)),
                                             (-1, 2, (3, 4, 1)), (-3, 0, (1, 3, 4))])
def test_unsqueeze_counts_dims_on_batch(dim, leaf_dim, bs):
    leaves = _small()
    out = _small_tree(leaves).unsqueeze(dim)
    assert_tree_equal_to(out, _map(leaves, lambda t: t.unsqueeze(leaf_dim)), batch_size=bs)


@pytest.mark.parametrize("dim", [1, -1])
def test_squeeze_dim(dim):
    leaves = {("x",): torch.arange(6.0).reshape(3, 1, 2), ("y",): torch.arange(3).reshape(3, 1),
              ("n",): 5}
    tree = TensorTree(nested_from_flat(leaves), batch_size=(3, 1))
    out = tree.squeeze(dim)
    assert_tree_equal_to(out, _map(leaves, lambda t: t.squeeze(1)), batch_size=(3,))


@pytest.mark.parametrize("shape,bs", [((12,), (12,)), ((-1,), (12,)), ((2, 6), (2, 6)),
                                      ((4, -1), (4, 3)), ((2, 2, 3), (2, 2, 3))])
def test_reshape_batch_dims(shape, bs):
    leaves = _small()
    out = _small_tree(leaves).reshape(*shape)
    expected = _map(leaves, lambda t: t.reshape(*bs, *t.shape[2:]))
    assert_tree_equal_to(out, expected, batch_size=bs)


def test_reshape_incompatible_raises():
    with pytest.raises((ValueError, RuntimeError)):
        _small_tree().reshape(5)


# --------------------------------------------------------------------------------------------
# stack / cat
# --------------------------------------------------------------------------------------------


def _pair(seed_a=1, seed_b=2, bs_a=(3, 4), bs_b=(3, 4)):
    def mk(bs, seed):
        return {
            ("x",): random_like(torch.empty(*bs, 2), seed),
            ("s", "y"): random_like(torch.empty(*bs, dtype=torch.int64), seed + 1),
            ("s", "b"): random_like(torch.empty(*bs, dtype=torch.bool), seed + 2),
            ("s", "h"): random_like(torch.empty(*bs, dtype=torch.bfloat16), seed + 3),
            ("name",): "same",
        }
    la, lb = mk(bs_a, seed_a), mk(bs_b, seed_b)
    return la, lb, TensorTree(nested_from_flat(la), batch_size=bs_a), TensorTree(
        nested_from_flat(lb), batch_size=bs_b)


@pytest.mark.parametrize("dim,bs", [(0, (2, 3, 4)), (1, (3, 2, 4)), (2, (3, 4, 2))])
def test_stack_matches_torch_stack(dim, bs):
    la, lb, ta, tb = _pair()
    out = memtree.stack([ta, tb], dim=dim)
    expected = {k: (torch.stack([la[k], lb[k]], dim=dim) if isinstance(la[k], torch.Tensor)
                    else la[k]) for k in la}
    assert_tree_equal_to(out, expected, batch_size=bs)
    assert tuple(out["s"].batch_size) == bs


def test_stack_default_dim_is_zero():
    la, lb, ta, tb = _pair()
    assert tuple(memtree.stack([ta, tb]).batch_size) == (2, 3, 4)


def test_stack_negative_dim_counts_on_batch():
    la, lb, ta, tb = _pair()
    out = memtree.stack([ta, tb], dim=-1)
    assert tuple(out.batch_size) == (3, 4, 2)
    assert bits_equal(out["x"], torch.stack([la[("x",)], lb[("x",)]], dim=2))


def test_stack_three_unbatched_trees():
    trees = [TensorTree({"v": torch.full((2,), float(i))}) for i in range(3)]
    out = memtree.stack(trees)
    assert tuple(out.batch_size) == (3,)
    assert bits_equal(out["v"], torch.tensor([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]))


@pytest.mark.parametrize("dim,bs_a,bs_b,bs", [(0, (3, 4), (2, 4), (5, 4)), (1, (3, 4), (3, 2), (3, 6))])
def test_cat_matches_torch_cat(dim, bs_a, bs_b, bs):
    la, lb, ta, tb = _pair(bs_a=bs_a, bs_b=bs_b)
    out = memtree.cat([ta, tb], dim=dim)
    expected = {k: (torch.cat([la[k], lb[k]], dim=dim) if isinstance(la[k], torch.Tensor)
                    else la[k]) for k in la}
    assert_tree_equal_to(out, expected, batch_size=bs)


def test_cat_default_dim_is_zero():
    la, lb, ta, tb = _pair(bs_a=(3, 4), bs_b=(1, 4))
    assert tuple(memtree.cat([ta, tb]).batch_size) == (4, 4)


def test_stack_result_does_not_alias_inputs():
    la, lb, ta, tb = _pair()
    out = memtree.stack([ta, tb])
    out["x"].zero_()
    assert bits_equal(ta["x"], la[("x",)])


@pytest.mark.parametrize("op", ["stack", "cat"])
def test_stack_cat_mismatched_top_level_keys_raise(op):
    a = TensorTree({"x": torch.zeros(3), "y": torch.zeros(3)}, batch_size=(3,))
    b = TensorTree({"x": torch.zeros(3), "z": torch.zeros(3)}, batch_size=(3,))
    with pytest.raises(memtree.MemtreeError):
        getattr(memtree, op)([a, b])


@pytest.mark.parametrize("op", ["stack", "cat"])
def test_stack_cat_missing_key_raises(op):
    a = TensorTree({"x": torch.zeros(3), "y": torch.zeros(3)}, batch_size=(3,))
    b = TensorTree({"x": torch.zeros(3)}, batch_size=(3,))
    with pytest.raises(memtree.MemtreeError):
        getattr(memtree, op)([a, b])
    with pytest.raises(memtree.MemtreeError):
        getattr(memtree, op)([b, a])


@pytest.mark.parametrize("op", ["stack", "cat"])
def test_stack_cat_mismatched_nested_keys_raise(op):
    a = TensorTree({"s": {"x": torch.zeros(3)}}, batch_size=(3,))
    b = TensorTree({"s": {"y": torch.zeros(3)}}, batch_size=(3,))
    with pytest.raises(memtree.MemtreeError):
        getattr(memtree, op)([a, b])


@pytest.mark.parametrize("op", ["stack", "cat"])
def test_stack_cat_different_non_tensor_values_raise_valueerror(op):
    a = TensorTree({"x": torch.zeros(3), "name": "a"}, batch_size=(3,))
    b = TensorTree({"x": torch.zeros(3), "name": "b"}, batch_size=(3,))
    with pytest.raises(ValueError):
        getattr(memtree, op)([a, b])


def test_stack_mismatched_batch_sizes_raises():
    a = TensorTree({"x": torch.zeros(3)}, batch_size=(3,))
    b = TensorTree({"x": torch.zeros(4)}, batch_size=(4,))
    with pytest.raises(memtree.MemtreeError):
        memtree.stack([a, b])


def test_cat_mismatched_other_dims_raises():
    a = TensorTree({"x": torch.zeros(3, 4)}, batch_size=(3, 4))
    b = TensorTree({"x": torch.zeros(3, 5)}, batch_size=(3, 5))
    with pytest.raises(memtree.MemtreeError):
        memtree.cat([a, b], dim=0)


# --------------------------------------------------------------------------------------------
# apply / to / clone / contiguous
# --------------------------------------------------------------------------------------------


def test_apply_maps_every_tensor_leaf_and_returns_new_tree():
    leaves = make_leaves()
    tree = make_tree(leaves)
    out = tree.apply(lambda t: t.clone() * 2 if t.dtype != torch.bool else ~t)
    expected = _map(leaves, lambda t: t.clone() * 2 if t.dtype != torch.bool else ~t)
    assert out is not tree
    assert_tree_equal_to(out, expected, batch_size=(3, 4))
    assert_tree_equal_to(tree, leaves)


def test_apply_with_batch_size():
    leaves = _small()
    out = _small_tree(leaves).apply(lambda t: t[:, :2], batch_size=(3, 2))
    assert_tree_equal_to(out, _map(leaves, lambda t: t[:, :2]), batch_size=(3, 2))


def test_apply_result_breaking_batch_size_raises():
    with pytest.raises(memtree.BatchSizeError):
        _small_tree().apply(lambda t: t[:2])


def test_to_dtype_casts_every_tensor_leaf():
    leaves = make_leaves()
    out = make_tree(leaves).to(torch.float64)
    assert_tree_equal_to(out, _map(leaves, lambda t: t.to(torch.float64)), batch_size=(3, 4))


def test_to_device_cpu():
    leaves = make_leaves()
    for dev in ["cpu", torch.device("cpu")]:
        out = make_tree(leaves).to(dev)
        assert_tree_equal_to(out, leaves, batch_size=(3, 4))


def test_clone_equal_values():
    leaves = make_leaves()
    tree = make_tree(leaves)
    out = tree.clone()
    assert out is not tree
    assert_tree_equal_to(out, leaves, batch_size=(3, 4))


def test_clone_does_not_share_storage():
    tree = make_tree()
    out = tree.clone()
    for k, v in leaf_dict(tree).items():
        if isinstance(v, torch.Tensor):
            c = out[k]
            assert c.untyped_storage().data_ptr() != v.untyped_storage().data_ptr(), k
    out["obs"].fill_(0)
    out["nested", "deep", "w"].fill_(0)
    assert_tree_equal_to(tree, make_leaves())


def test_clone_of_memmapped_tree_is_in_ordinary_memory():
    tree = make_tree().memmap_()
    assert tree.is_memmap()
    out = tree.clone()
    for k, v in leaf_dict(out).items():
        if isinstance(v, torch.Tensor):
            assert not isinstance(v, memtree.MemoryMappedTensor), k
    assert_tree_equal_to(out, make_leaves(), batch_size=(3, 4))


def test_clone_is_structurally_independent():
    tree = make_tree()
    out = tree.clone()
    out["nested", "added"] = torch.zeros(3, 4)
    del out["obs"]
    assert ("nested", "added") not in tree
    assert "obs" in tree


def test_contiguous_makes_leaves_contiguous():
    leaves = _small()
    tree = _small_tree(leaves).expand(2, 3, 4)
    out = tree.contiguous()
    for k, v in leaf_dict(out).items():
        if isinstance(v, torch.Tensor):
            assert v.is_contiguous(), k
    assert_tree_equal_to(out, _map(leaves, lambda t: t.expand(2, *t.shape)), batch_size=(2, 3, 4))


def test_contiguous_of_transposed_leaf():
    t = torch.arange(12.0).reshape(4, 3).t()
    out = TensorTree({"x": t}, batch_size=(3,)).contiguous()
    assert out["x"].is_contiguous()
    assert bits_equal(out["x"], t.contiguous())


# --------------------------------------------------------------------------------------------
# equality
# --------------------------------------------------------------------------------------------


def _tensor_only_tree():
    return make_tree(tensor_leaves(make_leaves()))


def test_eq_returns_tree_of_bool_tensors():
    a, b = _tensor_only_tree(), _tensor_only_tree()
    eq = a == b
    assert isinstance(eq, TensorTree)
    assert tuple(eq.batch_size) == (3, 4)
    for k, v in leaf_dict(a).items():
        e = eq[k]
        assert e.dtype == torch.bool, k
        assert tuple(e.shape) == tuple(v.shape), k
        assert bool(e.all()), k


def test_eq_all_and_any_return_python_bool():
    a, b = _tensor_only_tree(), _tensor_only_tree()
    assert (a == b).all() is True
    assert (a == b).any() is True
    b["obs"][0, 0, 0] = -1.0
    assert (a == b).all() is False
    assert (a == b).any() is True
    eq = a == b
    assert bool(eq["obs"][0, 0, 0]) is False
    assert bool(eq["act"].all()) is True


def test_eq_none_equal_any_false():
    a = TensorTree({"x": torch.zeros(3)}, batch_size=(3,))
    b = TensorTree({"x": torch.ones(3)}, batch_size=(3,))
    assert (a == b).any() is False
    assert (a == b).all() is False


def test_eq_with_number():
    tree = TensorTree({"x": torch.tensor([0.0, 1.0, 0.0]), "s": {"y": torch.zeros(3, 2)}},
                      batch_size=(3,))
    eq = tree == 0
    assert bits_equal(eq["x"], torch.tensor([True, False, True]))
    assert bits_equal(eq["s", "y"], torch.ones(3, 2, dtype=torch.bool))


def test_eq_with_mapping():
    tree = TensorTree({"x": torch.tensor([0.0, 1.0]), "s": {"y": torch.zeros(2)}}, batch_size=(2,))
    other = {"x": torch.tensor([0.0, 2.0]), "s": {"y": torch.zeros(2)}}
    eq = tree == other
    assert bits_equal(eq["x"], torch.tensor([True, False]))
    assert (tree == {"x": torch.tensor([0.0, 1.0]), "s": {"y": torch.zeros(2)}}).all() is True


def test_bool_of_eq_result_raises():
    a, b = _tensor_only_tree(), _tensor_only_tree()
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        bool(a == b)
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        if a == b:
            pass


def test_bool_of_tree_raises():
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        bool(_tensor_only_tree())


# --------------------------------------------------------------------------------------------
# flatten_keys / unflatten_keys
# --------------------------------------------------------------------------------------------


def test_flatten_keys_default_sep():
    leaves = make_leaves()
    tree = make_tree(leaves)
    flat = tree.flatten_keys()
    assert set(flat.keys()) == {"obs", "act", "nested.mask", "nested.deep.w", "nested.deep.u8",
                                "name"}
    assert set(flat.keys(include_nested=True)) == set(flat.keys())
    assert tuple(flat.batch_size) == (3, 4)
    for k, v in leaves.items():
        assert_leaf_equal(flat[".".join(k)], v, where=str(k))
    assert_tree_equal_to(tree, leaves)


def test_flatten_keys_custom_sep():
    flat = make_tree().flatten_keys(sep="/")
    assert "nested/deep/w" in flat
    assert "nested.deep.w" not in flat


def test_unflatten_keys_round_trip():
    leaves = make_leaves()
    tree = make_tree(leaves)
    for sep in [".", "/", "::"]:
        back = tree.flatten_keys(sep=sep).unflatten_keys(sep=sep)
        assert_tree_equal_to(back, leaves, batch_size=(3, 4))
        assert tuple(back["nested", "deep"].batch_size) == (3, 4)


def test_unflatten_keys_builds_subtrees():
    tree = TensorTree({"a.b": torch.zeros(2), "a.c.d": torch.ones(2), "e": torch.arange(2)},
                      batch_size=(2,))
    out = tree.unflatten_keys()
    assert isinstance(out["a"], TensorTree)
    assert bits_equal(out["a", "c", "d"], torch.ones(2))
    assert set(out.keys(include_nested=True, leaves_only=True)) == {("a", "b"), ("a", "c", "d"), "e"}


def test_flatten_keys_collision_raises():
    tree = TensorTree({"b.c": torch.zeros(2), "b": {"c": torch.ones(2)}}, batch_size=(2,))
    with pytest.raises(memtree.KeyCollisionError):
        tree.flatten_keys()


def test_unflatten_keys_collision_raises():
    tree = TensorTree({"a": torch.zeros(2), "a.b": torch.ones(2)}, batch_size=(2,))
    with pytest.raises(memtree.KeyCollisionError):
        tree.unflatten_keys()


# --------------------------------------------------------------------------------------------
# to_dict / from_dict / state_dict
# --------------------------------------------------------------------------------------------


def test_to_dict_is_nested_plain_dict():
    leaves = make_leaves()
    d = make_tree(leaves).to_dict()
    assert type(d) is dict
    assert type(d["nested"]) is dict
    assert type(d["nested"]["deep"]) is dict
    assert d["name"] == "hello"
    for k, v in leaves.items():
        x = d
        for p in k:
            x = x[p]
        assert_leaf_equal(x, v, where=str(k))


def test_from_dict_round_trip():
    leaves = make_leaves()
    tree = TensorTree.from_dict(make_tree(leaves).to_dict(), batch_size=(3, 4))
    assert isinstance(tree, TensorTree)
    assert_tree_equal_to(tree, leaves, batch_size=(3, 4))


def test_from_dict_checks_batch_size():
    with pytest.raises(memtree.BatchSizeError):
        TensorTree.from_dict({"from_dict_bad": torch.zeros(3)}, batch_size=(4,))


def test_state_dict_has_dotted_flat_keys():
    leaves = make_leaves()
    sd = make_tree(leaves).state_dict()
    assert isinstance(sd, collections.OrderedDict)
    assert set(sd) == {"obs", "act", "nested.mask", "nested.deep.w", "nested.deep.u8", "name"}
    assert sd["name"] == "hello"
    for k, v in tensor_leaves(leaves).items():
        assert_leaf_equal(sd[".".join(k)], v, where=str(k))


def test_load_state_dict_copies_in_place_keeping_tensor_identity():
    tree = _tensor_only_tree()
    before = {k: v for k, v in leaf_dict(tree).items()}
    new = {".".join(k): random_like(v, i) for i, (k, v) in enumerate(before.items())}
    tree.load_state_dict(new)
    for k, t in before.items():
        assert tree[k] is t, k
        assert bits_equal(t, new[".".join(k)]), k


def test_load_state_dict_round_trip_from_other_tree():
    src = _tensor_only_tree().apply(lambda t: random_like(t, 3))
    dst = _tensor_only_tree()
    dst.load_state_dict(src.state_dict())
    assert (dst == src).all() is True


def test_load_state_dict_strict_missing_key_raises():
    tree = _tensor_only_tree()
    sd = tree.clone().state_dict()
    del sd["nested.deep.w"]
    with pytest.raises(memtree.MemtreeKeyError) as err:
        tree.load_state_dict(sd)
    assert "deep" in str(err.value)


def test_load_state_dict_strict_unexpected_key_raises():
    tree = _tensor_only_tree()
    sd = tree.clone().state_dict()
    sd["unexpected_sd_key"] = torch.zeros(3, 4)
    with pytest.raises(memtree.MemtreeKeyError) as err:
        tree.load_state_dict(sd)
    assert "unexpected_sd_key" in str(err.value)


@pytest.mark.parametrize("bad", [torch.zeros(5), torch.zeros(1, 4, 5), torch.zeros(3, 4, 6)])
def test_load_state_dict_shape_mismatch_raises_naming_key(bad):
    # copy_ would silently broadcast (5,) or (1, 4, 5) into (3, 4, 5): must be refused like
    # torch.nn.Module.load_state_dict does ("size mismatch")
    tree = _tensor_only_tree()
    sd = tree.clone().state_dict()
    sd["obs"] = bad
    with pytest.raises((ValueError, RuntimeError)) as err:
        tree.load_state_dict(sd)
    assert "obs" in str(err.value)
    assert_leaf_equal(tree["obs"], make_leaves()[("obs",)])


def test_load_state_dict_non_strict_loads_what_matches():
    tree = _tensor_only_tree()
    obs = tree["obs"]
    new_obs = torch.full((3, 4, 5), 9.0)
    tree.load_state_dict({"obs": new_obs, "unexpected_sd_key": torch.zeros(3)}, strict=False)
    assert tree["obs"] is obs
    assert bits_equal(obs, new_obs)
    assert_leaf_equal(tree["act"], make_leaves()[("act",)])
    assert "unexpected_sd_key" not in tree


# --------------------------------------------------------------------------------------------
# lock_ / unlock_
# --------------------------------------------------------------------------------------------


def test_lock_returns_self_and_sets_is_locked():
    tree = make_tree()
    assert tree.is_locked is False
    assert tree.lock_() is tree
    assert tree.is_locked is True
    assert tree["nested"].is_locked is True
    assert tree["nested", "deep"].is_locked is True
    assert tree.unlock_() is tree
    assert tree.is_locked is False
    assert tree["nested"].is_locked is False


def test_locked_refuses_adding_key():
    tree = make_tree().lock_()
    with pytest.raises(memtree.LockedError):
        tree["new_key"] = torch.zeros(3, 4)
    assert "new_key" not in tree


def test_locked_refuses_replacing_key():
    tree = make_tree().lock_()
    with pytest.raises(memtree.LockedError):
        tree["obs"] = torch.zeros(3, 4, 5)
    assert_leaf_equal(tree["obs"], make_leaves()[("obs",)])


def test_locked_refuses_replacing_non_tensor_leaf():
    tree = make_tree().lock_()
    with pytest.raises(memtree.LockedError):
        tree["name"] = "other"
    assert tree["name"] == "hello"


def test_locked_refuses_del_and_pop():
    tree = make_tree().lock_()
    with pytest.raises(memtree.LockedError):
        del tree["obs"]
    with pytest.raises(memtree.LockedError):
        tree.pop("act")
    assert "obs" in tree and "act" in tree


def test_locked_refuses_update():
    tree = make_tree().lock_()
    with pytest.raises(memtree.LockedError):
        tree.update({"upd": torch.zeros(3, 4)})
    assert "upd" not in tree


def test_locked_refuses_nested_changes_via_tuple_key():
    tree = make_tree().lock_()
    with pytest.raises(memtree.LockedError):
        tree["nested", "deep", "new"] = torch.zeros(3, 4)
    with pytest.raises(memtree.LockedError):
        del tree["nested", "mask"]
    with pytest.raises(memtree.LockedError):
        tree["brand", "new"] = torch.zeros(3, 4)
    assert "brand" not in tree
    assert ("nested", "mask") in tree


def test_locked_refuses_nested_changes_via_subtree_object():
    tree = make_tree()
    sub = tree["nested"]
    tree.lock_()
    with pytest.raises(memtree.LockedError):
        sub["new"] = torch.zeros(3, 4)
    with pytest.raises(memtree.LockedError):
        tree["nested"]["deep"]["new"] = torch.zeros(3, 4)
    with pytest.raises(memtree.LockedError):
        del tree["nested"]["deep"]["w"]
    assert ("nested", "deep", "w") in tree


def test_locked_allows_in_place_tensor_writes():
    tree = make_tree().lock_()
    tree["obs"][0] = 5.0
    tree["act"].add_(1)
    tree[1] = 0
    tree[2:] = tree[0:1].clone()
    tree["nested", "deep", "w"].fill_(2.0)
    leaves = make_leaves()
    obs = leaves[("obs",)].clone()
    obs[0] = 5.0
    obs[1] = 0
    obs[2:] = obs[0:1]
    assert bits_equal(tree["obs"], obs)
    assert bits_equal(tree["nested", "deep", "w"], torch.full((3, 4, 2), 2.0, dtype=torch.bfloat16))


def test_locked_allows_load_state_dict():
    tree = _tensor_only_tree()
    sd = {k: torch.zeros_like(v) if not isinstance(v, str) else v
          for k, v in tree.state_dict().items()}
    tree.lock_()
    tree.load_state_dict(sd)
    assert bits_equal(tree["obs"], torch.zeros(3, 4, 5))


def test_unlock_allows_changes_again_at_depth():
    tree = make_tree().lock_().unlock_()
    tree["new_key"] = torch.zeros(3, 4)
    tree["nested", "deep", "new"] = torch.zeros(3, 4)
    del tree["obs"]
    assert "new_key" in tree and ("nested", "deep", "new") in tree and "obs" not in tree


def test_locked_error_is_memtree_error():
    tree = make_tree().lock_()
    with pytest.raises(memtree.MemtreeError):
        tree["new_key"] = torch.zeros(3, 4)


# --------------------------------------------------------------------------------------------
# non-tensor leaves
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["hello", "", 3, -2**63, 2.5, True, False, None, [1, 2.5, "x", None,
                                                                                  True], []])
def test_non_tensor_leaf_returns_raw_value(value):
    tree = TensorTree({"x": torch.zeros(2)}, batch_size=(2,))
    tree["v"] = value
    got = tree["v"]
    assert got == value
    assert type(got) is type(value)


def test_non_tensor_leaf_in_constructor():
    tree = TensorTree({"x": torch.zeros(2), "name": "n", "cfg": {"depth": 3}}, batch_size=(2,))
    assert tree["name"] == "n"
    assert isinstance(tree["cfg"], TensorTree)
    assert tree["cfg", "depth"] == 3


def test_nontensor_wraps_dict_as_one_leaf():
    tree = TensorTree({"x": torch.zeros(2)}, batch_size=(2,))
    tree["cfg"] = memtree.NonTensor({"lr": 0.1, "layers": [1, 2]})
    assert tree["cfg"] == {"lr": 0.1, "layers": [1, 2]}
    assert not isinstance(tree["cfg"], TensorTree)
    assert ("cfg", "lr") not in tree


def test_nontensor_in_constructor():
    tree = TensorTree({"cfg": memtree.NonTensor({"lr": 0.1})}, batch_size=())
    assert tree["cfg"] == {"lr": 0.1}


def test_nontensor_wrapping_list():
    tree = TensorTree({"l": memtree.NonTensor([1, 2])})
    assert tree["l"] == [1, 2]


def test_plain_dict_value_becomes_subtree_not_leaf():
    tree = TensorTree({"x": torch.zeros(2)}, batch_size=(2,))
    tree["cfg"] = {"lr": 0.1}
    assert isinstance(tree["cfg"], TensorTree)
    assert tree["cfg", "lr"] == 0.1


def _tree_with_non_tensor():
    return TensorTree({"x": torch.arange(4), "name": "hello", "n": None, "l": [1, "a"],
                       "cfg": memtree.NonTensor({"lr": 0.1}), "s": {"f": 2.5}},
                      batch_size=(4,))


def _assert_non_tensor_carried(t):
    assert t["name"] == "hello"
    assert t["n"] is None
    assert "n" in t
    assert t["l"] == [1, "a"]
    assert t["cfg"] == {"lr": 0.1}
    assert t["s", "f"] == 2.5


@pytest.mark.parametrize("idx", [0, slice(1, 3), torch.tensor([True, False, True, False]),
                                 torch.tensor([3, 1]), [0], Ellipsis, None])
def test_non_tensor_leaves_carried_through_indexing(idx):
    _assert_non_tensor_carried(_tree_with_non_tensor()[idx])


def test_non_tensor_leaves_carried_through_clone():
    _assert_non_tensor_carried(_tree_with_non_tensor().clone())


def test_non_tensor_leaves_carried_through_shape_ops_and_apply():
    tree = _tree_with_non_tensor()
    _assert_non_tensor_carried(tree.apply(lambda t: t + 1))
    _assert_non_tensor_carried(tree.to(torch.float64))
    _assert_non_tensor_carried(tree.unsqueeze(0))
    _assert_non_tensor_carried(tree.expand(2, 4))
    _assert_non_tensor_carried(tree.reshape(2, 2))
    _assert_non_tensor_carried(tree.contiguous())
    _assert_non_tensor_carried(memtree.stack([tree, tree]))
    _assert_non_tensor_carried(memtree.cat([tree, tree]))


def test_non_tensor_leaves_carried_through_select_and_exclude():
    tree = _tree_with_non_tensor()
    sel = tree.select("name", "cfg", "x")
    assert sel["name"] == "hello"
    assert sel["cfg"] == {"lr": 0.1}
    exc = tree.exclude("x")
    _assert_non_tensor_carried(exc)


def test_non_tensor_leaves_in_flatten_and_to_dict():
    tree = _tree_with_non_tensor()
    flat = tree.flatten_keys()
    assert flat["s.f"] == 2.5
    assert flat["name"] == "hello"
    d = tree.to_dict()
    assert d["name"] == "hello"
    assert d["s"]["f"] == 2.5


# --------------------------------------------------------------------------------------------
# repr
# --------------------------------------------------------------------------------------------


def test_repr_mentions_keys_shapes_dtypes():
    r = repr(make_tree())
    for word in ["obs", "act", "nested", "mask", "deep", "w", "u8", "name"]:
        assert word in r, word
    for dt in ["float32", "int64", "bool", "bfloat16", "uint8"]:
        assert dt in r, dt
    assert re.search(r"3,\s*4,\s*5", r), r
    assert re.search(r"3,\s*4,\s*2", r), r
    assert isinstance(str(make_tree()), str)


def test_repr_mentions_device():
    r = repr(make_tree())
    assert "cpu" in r, r


def test_repr_of_empty_and_unbatched_trees():
    assert isinstance(repr(TensorTree()), str)
    r = repr(TensorTree({"scalar_key": torch.tensor(1.0)}))
    assert "scalar_key" in r


def test_repr_of_odd_keys_does_not_fail():
    tree = TensorTree({"\x00": torch.zeros(1), "a/b": torch.zeros(1), "..": torch.zeros(1)},
                      batch_size=(1,))
    r = repr(tree)
    assert "a/b" in r
