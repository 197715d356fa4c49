"""Property tests of the in-memory ``TensorTree`` API against a reference model.

The reference model of a tree is a flat ``{key tuple: leaf}`` dict; every tree operation is
checked against doing the same torch operation on each leaf independently, bit-exactly.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import memtree
from memtree import TensorTree
from treeutil import assert_leaf_equal, assert_tree_equal_to, leaf_dict, nested_from_flat, set_ref

SETTINGS = dict(deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

DTYPES = [torch.float32, torch.int64, torch.bool, torch.bfloat16, torch.uint8]

# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def make_tensor(dtype, shape, g):
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g).to(torch.uint8)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------

ODD_CHARS = list("./\\\x00 :*?<>|\"'~%$\t\n") + ["CON", "..", "ü", "日", "🌲", "A", "a"]

keys_st = st.one_of(
    st.sampled_from([".", "..", "a/b", "\x00", "CON", "nul", "k" * 200, ".hidden", "A", "a",
                     "obs", "x.y"]),
    st.lists(st.one_of(st.sampled_from(ODD_CHARS), st.characters(codec="utf-8")),
             min_size=1, max_size=5).map("".join),
)

nontensor_st = st.one_of(
    st.text(max_size=5),
    st.integers(-(2**63), 2**63 - 1),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none()), max_size=3),
)

# a leaf spec: ("tensor", dtype, extra trailing shape) or ("value", python value)
tensor_spec_st = st.tuples(
    st.just("tensor"),
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 3), max_size=2).map(tuple),
)
leaf_spec_st = st.one_of(
    tensor_spec_st, tensor_spec_st, tensor_spec_st,
    st.tuples(st.just("value"), nontensor_st),
)


def schema_st(depth=3, with_values=True):
    """A nested dict of leaf specs, depth <= ``depth``, 1..3 keys per level."""
    leaf = leaf_spec_st if with_values else tensor_spec_st
    if depth <= 1:
        return st.dictionaries(keys_st, leaf, min_size=1, max_size=3)
    return st.dictionaries(
        keys_st, st.one_of(leaf, leaf, schema_st(depth - 1, with_values)), min_size=1, max_size=3
    )


batch_size_st = st.lists(st.integers(0, 4), max_size=2).map(tuple)


def flat_schema(schema, prefix=()):
    out = {}
    for k, v in schema.items():
        if isinstance(v, dict):
            out.update(flat_schema(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def instantiate(schema, batch_size, seed):
    """Reference flat dict {key tuple: tensor or value} for ``schema`` at ``batch_size``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for path, spec in flat_schema(schema).items():
        if spec[0] == "tensor":
            out[path] = make_tensor(spec[1], tuple(batch_size) + spec[2], g)
        else:
            out[path] = spec[1]
    return out


def build(ref: dict, batch_size) -> TensorTree:
    """A tree from a reference, with its own copies of the tensors."""
    src = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in ref.items()}
    return TensorTree(nested_from_flat(src), batch_size=batch_size)


# ---- batch indices ----


def dim_index_st(n, for_set):
    """One index for a batch dim of size n: (kind, index)."""
    opts = [
        st.builds(
            slice,
            st.one_of(st.none(), st.integers(-n - 2, n + 2)),
            st.one_of(st.none(), st.integers(-n - 2, n + 2)),
            st.one_of(st.none(), st.integers(1, 3)),
        ).map(lambda s: ("basic", s)),
        st.lists(st.booleans(), min_size=n, max_size=n).map(
            lambda b: ("adv", torch.tensor(b, dtype=torch.bool).reshape(n))
        ),
    ]
    if n > 0:
        opts.append(st.integers(-n, n - 1).map(lambda i: ("int", i)))
        if for_set:
            ints = st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True)
        else:
            ints = st.lists(st.integers(-n, n - 1), min_size=1, max_size=5)
        opts.append(ints.map(lambda l: ("adv", torch.tensor(l, dtype=torch.long))))
        opts.append(ints.map(lambda l: ("adv", list(l))))
    return st.one_of(*opts)


@st.composite
def batch_index_st(draw, batch_size, for_set=False):
    ndim = len(batch_size)
    if ndim == 0:
        return draw(st.sampled_from([Ellipsis] if for_set else [Ellipsis, None]))
    kind = draw(st.sampled_from(["single", "single", "tuple", "tuple", "full_mask", "ellipsis"]))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "full_mask":
        numel = int(torch.Size(batch_size).numel())
        bits = draw(st.lists(st.booleans(), min_size=numel, max_size=numel))
        return torch.tensor(bits, dtype=torch.bool).reshape(batch_size)
    if kind == "single":
        return draw(dim_index_st(batch_size[0], for_set))[1]
    # tuple: indices for the first p dims, optionally an Ellipsis, then the last q dims;
    # at most one advanced index (tensor, list or mask) so shapes always broadcast.
    m = draw(st.integers(1, ndim))
    use_ellipsis = draw(st.booleans())
    p = draw(st.integers(0, m)) if use_ellipsis else m
    dims = list(range(p)) + list(range(ndim - (m - p), ndim))
    items = []
    n_adv = 0
    for d in dims:
        kind_, idx = draw(dim_index_st(batch_size[d], for_set))
        if kind_ == "adv":
            if n_adv:
                idx = slice(None)
            n_adv += 1
        items.append(idx)
    if use_ellipsis:
        items.insert(p, Ellipsis)
    if not for_set and draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), None)
    return tuple(items)


def expand_index(idx, ndim):
    """The same index for a leaf: Ellipsis is spelled out over the batch dims only."""
    items = idx if isinstance(idx, tuple) else (idx,)
    if not any(i is Ellipsis for i in items):
        return idx
    consumed = 0
    for i in items:
        if i is None or i is Ellipsis:
            continue
        if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
            consumed += i.ndim
        else:
            consumed += 1
    out = []
    for i in items:
        if i is Ellipsis:
            out.extend([slice(None)] * (ndim - consumed))
        else:
            out.append(i)
    return tuple(out)


def index_ref(ref: dict, leaf_idx) -> dict:
    return {k: (v[leaf_idx] if isinstance(v, torch.Tensor) else v) for k, v in ref.items()}


# --------------------------------------------------------------------------------------------
# properties
# --------------------------------------------------------------------------------------------


@settings(max_examples=150, **SETTINGS)
@given(schema=schema_st(), batch_size=batch_size_st, seed=st.integers(0, 2**31 - 1))
def test_construction_matches_reference(schema, batch_size, seed):
    ref = instantiate(schema, batch_size, seed)
    tree = build(ref, batch_size)
    assert_tree_equal_to(tree, ref, batch_size)
    for path in ref:
        assert_leaf_equal(tree[path], ref[path], where=repr(path))
        assert path in tree


@settings(max_examples=250, **SETTINGS)
@given(data=st.data(), schema=schema_st(), batch_size=batch_size_st,
       seed=st.integers(0, 2**31 - 1))
def test_getitem_matches_indexing_each_leaf(data, schema, batch_size, seed):
    idx = data.draw(batch_index_st(batch_size), label="idx")
    ref = instantiate(schema, batch_size, seed)
    tree = build(ref, batch_size)
    leaf_idx = expand_index(idx, len(batch_size))
    expected_bs = torch.empty(batch_size)[leaf_idx].shape
    out = tree[idx]
    assert_tree_equal_to(out, index_ref(ref, leaf_idx), expected_bs)
    # indexing never changes the source tree
    assert_tree_equal_to(tree, ref, batch_size)


@settings(max_examples=200, **SETTINGS)
@given(data=st.data(), schema=schema_st(), batch_size=batch_size_st,
       seed=st.integers(0, 2**31 - 1))
def test_setitem_tree_matches_reference(data, schema, batch_size, seed):
    idx = data.draw(batch_index_st(batch_size, for_set=True), label="idx")
    ref = instantiate(schema, batch_size, seed)
    tree = build(ref, batch_size)
    leaf_idx = expand_index(idx, len(batch_size))
    sub_bs = torch.empty(batch_size)[leaf_idx].shape
    value_ref = instantiate(schema, sub_bs, seed + 1)
    tree[idx] = build(value_ref, sub_bs)
    expected = set_ref(ref, leaf_idx, value_ref)
    assert_tree_equal_to(tree, expected, batch_size)


@pytest.mark.slow
@settings(max_examples=150, **SETTINGS)
@given(data=st.data(), schema=schema_st(), batch_size=batch_size_st,
       seed=st.integers(0, 2**31 - 1), number=st.sampled_from([0, 1, 7, 0.0, 1.0]))
def test_setitem_number_matches_reference(data, schema, batch_size, seed, number):
    idx = data.draw(batch_index_st(batch_size, for_set=True), label="idx")
    ref = instantiate(schema, batch_size, seed)
    tree = build(ref, batch_size)
    leaf_idx = expand_index(idx, len(batch_size))
    tree[idx] = number
    expected = set_ref(ref, leaf_idx, number)
    assert_tree_equal_to(tree, expected, batch_size)


@settings(max_examples=150, **SETTINGS)
@given(data=st.data(), schema=schema_st(), batch_size=batch_size_st,
       n=st.integers(1, 3), seed=st.integers(0, 2**31 - 1))
def test_stack_matches_torch_stack_per_leaf(data, schema, batch_size, n, seed):
    dim = data.draw(st.integers(0, len(batch_size)), label="dim")
    refs = [instantiate(schema, batch_size, seed + i) for i in range(n)]
    trees = [build(r, batch_size) for r in refs]
    out = memtree.stack(trees, dim=dim)
    expected = {
        k: (torch.stack([r[k] for r in refs], dim=dim) if isinstance(v, torch.Tensor) else v)
        for k, v in refs[0].items()
    }
    bs = torch.stack([torch.empty(batch_size)] * n, dim=dim).shape
    assert_tree_equal_to(out, expected, bs)


@settings(max_examples=150, **SETTINGS)
@given(data=st.data(), schema=schema_st(),
       batch_size=st.lists(st.integers(0, 4), min_size=1, max_size=2).map(tuple),
       sizes=st.lists(st.integers(0, 3), min_size=1, max_size=3), seed=st.integers(0, 2**31 - 1))
def test_cat_matches_torch_cat_per_leaf(data, schema, batch_size, sizes, seed):
    dim = data.draw(st.integers(0, len(batch_size) - 1), label="dim")
    bss = []
    for s in sizes:
        bs = list(batch_size)
        bs[dim] = s
        bss.append(tuple(bs))
    refs = [instantiate(schema, bs, seed + i) for i, bs in enumerate(bss)]
    trees = [build(r, bs) for r, bs in zip(refs, bss)]
    out = memtree.cat(trees, dim=dim)
    expected = {
        k: (torch.cat([r[k] for r in refs], dim=dim) if isinstance(v, torch.Tensor) else v)
        for k, v in refs[0].items()
    }
    out_bs = list(batch_size)
    out_bs[dim] = sum(sizes)
    assert_tree_equal_to(out, expected, tuple(out_bs))


@settings(max_examples=150, **SETTINGS)
@given(schema=schema_st(), batch_size=batch_size_st, seed=st.integers(0, 2**31 - 1),
       sep=st.sampled_from([".", "/", "|", "::"]))
def test_flatten_unflatten_round_trip(schema, batch_size, seed, sep):
    ref = instantiate(schema, batch_size, seed)
    assume(all(sep not in p for path in ref for p in path))
    # a key that ends/starts with a sep fragment could merge with its neighbour ("a:" + "::")
    assume(all(not (p.startswith(sep[0]) or p.endswith(sep[-1])) for path in ref for p in path))
    tree = build(ref, batch_size)
    flat = tree.flatten_keys(sep=sep)
    expected_flat = {(sep.join(path),): v for path, v in ref.items()}
    assert_tree_equal_to(flat, expected_flat, batch_size)
    back = flat.unflatten_keys(sep=sep)
    assert_tree_equal_to(back, ref, batch_size)
    # the source tree is untouched
    assert_tree_equal_to(tree, ref, batch_size)


@settings(max_examples=100, **SETTINGS)
@given(schema=schema_st(), batch_size=batch_size_st, seed=st.integers(0, 2**31 - 1))
def test_clone_equal_and_independent(schema, batch_size, seed):
    ref = instantiate(schema, batch_size, seed)
    tree = build(ref, batch_size)
    c = tree.clone()
    assert_tree_equal_to(c, ref, batch_size)
    for k, v in leaf_dict(c).items():
        if isinstance(v, torch.Tensor) and v.numel():
            v.fill_(1)
    assert_tree_equal_to(tree, ref, batch_size)


@pytest.mark.slow
@settings(max_examples=100, **SETTINGS)
@given(schema=schema_st(), batch_size=batch_size_st, seed=st.integers(0, 2**31 - 1))
def test_state_dict_round_trip(schema, batch_size, seed):
    ref = instantiate(schema, batch_size, seed)
    # dotted state_dict keys are only unambiguous when no key contains "."
    assume(all("." not in p for path in ref for p in path))
    tree = build(ref, batch_size)
    sd = tree.state_dict()
    assert set(sd) == {".".join(path) for path in ref}
    other = build(instantiate(schema, batch_size, seed + 1), batch_size)
    other.load_state_dict(sd)
    assert_tree_equal_to(other, {k: v for k, v in ref.items()}, batch_size)
