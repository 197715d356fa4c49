"""Properties of binding trees into modules, over random module structures (hypothesis).

For any structure (nested containers; parameters and buffers of several dtypes; tied
parameters; sub-modules used twice; parametrizations; non-persistent buffers; extra states;
state_dict hooks that rebind ``p.data``):

* ``from_module(m, use_state_dict=True)`` is exactly ``m.state_dict()`` (names, dtypes, bits);
* ``tree.to_module(m)`` makes every slot of ``m`` the tree's tensor (same memory) for trees of
  their own memory, shared-memory trees and meta trees, and its swap binds every old object
  back (identity);
* ``to_module(m, inplace=True)`` keeps every object and copies the bits, and its swap copies
  the old bits back;
* a hostile tree (a wrong shape or dtype, an unknown or missing name) raises a typed error and
  leaves every slot and every bit as it was;
* tied names given different tensors are bound apart (and bound back by the swap), unless one
  slot holds both (a sub-module used twice) or the call fills: then it raises, changing nothing.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import parametrize

from memtree import MemtreeError, TensorTree
from memtree.tree.parts.bind import TIED_KEY
from treeutil import random_tensor, raw_bytes

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


class Cell(nn.Module):
    """A leaf module: a parameter of a given dtype, an int buffer, optionally a non-persistent
    buffer, an extra state, and state_dict hooks that rebind ``p.data`` (as quantisation code does)."""

    def __init__(self, n: int, dtype: torch.dtype, scratch: bool, extra: bool, hooks: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(n, 2, dtype=dtype))
        self.register_buffer("count", torch.zeros(n, dtype=torch.int64))
        if scratch:
            self.register_buffer("scratch", torch.ones(n), persistent=False)
        self.extra = extra
        self.step = 0
        if hooks:
            self.register_state_dict_pre_hook(Cell._shift_up)
            self.register_state_dict_post_hook(Cell._shift_down)

    @staticmethod
    def _shift_up(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        for p in module.parameters(recurse=False):
            p.data = p.data + 1

    @staticmethod
    def _shift_down(module: nn.Module, sd: Any, prefix: str, meta: Any) -> None:
        for p in module.parameters(recurse=False):
            p.data = p.data - 1

    def get_extra_state(self) -> Any:
        return {"step": self.step} if self.extra else None

    def set_extra_state(self, state: Any) -> None:
        if state is not None:
            self.step = state["step"]


class Double(nn.Module):
    """A parametrization (its ``original`` is the parameter that is stored)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


leaf_specs = st.one_of(
    st.tuples(st.just("cell"), st.integers(1, 4), st.sampled_from(DTYPES), st.booleans(), st.booleans(), st.booleans()),
    st.tuples(st.just("linear"), st.integers(1, 4), st.booleans()),
    st.tuples(st.just("batchnorm"), st.integers(1, 4)),
    st.tuples(st.just("parametrized"), st.integers(1, 4)),
    st.tuples(st.just("share"), st.integers(0, 50)),  # a sub-module used again (if any)
    st.tuples(st.just("tie"), st.integers(0, 50)),  # a new Linear whose weight is an earlier one's
)
structures = st.recursive(
    st.lists(leaf_specs, min_size=1, max_size=4),
    lambda children: st.lists(st.one_of(leaf_specs, children), min_size=1, max_size=3),
    max_leaves=10,
)


def build(structure: list[Any], seed: int) -> nn.Module:
    """The module a structure describes, with recognisable values (deterministic in ``seed``)."""
    made: list[nn.Module] = []
    linears: list[nn.Linear] = []

    def one(spec: Any) -> nn.Module:
        if isinstance(spec, list):
            return nn.Sequential(*[one(s) for s in spec])
        kind = spec[0]
        if kind == "cell":
            m: nn.Module = Cell(*spec[1:])
        elif kind == "linear":
            m = nn.Linear(2, spec[1], bias=spec[2])
            linears.append(m)
        elif kind == "batchnorm":
            m = nn.BatchNorm1d(spec[1])
        elif kind == "parametrized":
            m = nn.Linear(2, spec[1])
            parametrize.register_parametrization(m, "weight", Double())
        elif kind == "share" and made:
            return made[spec[1] % len(made)]
        elif kind == "tie" and linears:
            tied = linears[spec[1] % len(linears)]
            m = nn.Linear(2, tied.out_features, bias=False)
            m.weight = tied.weight
        else:
            m = nn.Identity()
        made.append(m)
        return m

    module = nn.Sequential(Cell(2, torch.float32, False, False, False), one(structure))  # a tensor at least
    with torch.no_grad():
        for i, (_, t) in enumerate(sorted(module.state_dict(keep_vars=True).items())):
            if isinstance(t, torch.Tensor):
                t.copy_(random_tensor(tuple(t.shape), torch.float32, seed + i).nan_to_num().clamp(-9, 9))
    return module


def slots(module: nn.Module) -> dict[str, Any]:
    """Every parameter and buffer object by name (duplicates, non-persistent ones included; read
    without state_dict(), whose hooks rebind p.data here)."""
    out: dict[str, Any] = {f"p:{n}": t for n, t in module.named_parameters(remove_duplicate=False)}
    out.update({f"b:{n}": t for n, t in module.named_buffers(remove_duplicate=False)})
    return out


def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of ``module`` by dotted name, as :func:`slots` reads them."""
    return {k[2:]: t for k, t in slots(module).items()}


def bits(module: nn.Module) -> dict[str, Any]:
    return {k: ("meta",) if t.is_meta else (t.dtype, raw_bytes(t)) for k, t in slots(module).items()}


def unchanged(module: nn.Module, objects: dict[str, Any], values: dict[str, Any]) -> bool:
    now = slots(module)
    return now.keys() == objects.keys() and all(now[k] is objects[k] for k in now) and bits(module) == values


def flat(tree: TensorTree) -> dict[str, Any]:
    out = {k if isinstance(k, str) else ".".join(k): v for k, v in tree.items(include_nested=True, leaves_only=True)}
    for alias, target in dict(out.pop(TIED_KEY, {})).items():
        out[alias] = out[target]
    return out


def own_memory(module: nn.Module, how: str) -> TensorTree:
    """A tree of ``module``'s values, independent of it, made the way ``how`` names."""
    tree = TensorTree.from_module(module).apply(lambda t: t.detach().clone())
    if how == "shared":
        return tree.memmap()  # anonymous shared memory: MemoryMappedTensor leaves
    if how == "meta":
        return tree.apply(lambda t: t.to("meta"))
    return tree


@SETTINGS
@given(structure=structures, seed=st.integers(0, 2**16))
def test_from_module_with_use_state_dict_is_state_dict(structure, seed) -> None:
    module = build(structure, seed)
    expected = module.state_dict()
    got = flat(TensorTree.from_module(module, use_state_dict=True))
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[name].dtype == value.dtype and raw_bytes(got[name]) == raw_bytes(value), name
        else:
            assert got[name] == value, name


@SETTINGS
@given(structure=structures, seed=st.integers(0, 2**16), how=st.sampled_from(["own", "shared", "meta"]))
def test_binding_makes_every_slot_the_trees_tensor_and_the_swap_binds_back(structure, seed, how) -> None:
    target = build(structure, seed)
    tree = own_memory(build(structure, seed + 1), how)
    objects, values = slots(target), bits(target)
    swap = tree.to_module(target)
    leaves = flat(tree)
    bound = {name: t for name, t in tensors(target).items() if name in leaves}
    assert len(bound) == len(leaves) - sum(name.endswith("._extra_state") for name in leaves)
    for name, t in bound.items():
        if how == "meta":
            assert t.is_meta, name
        else:
            assert t.data_ptr() == leaves[name].data_ptr(), name
    assert all(isinstance(p, nn.Parameter) for p in target.parameters())
    swap.to_module(target)
    assert unchanged(target, objects, values)


@SETTINGS
@given(structure=structures, seed=st.integers(0, 2**16))
def test_filling_keeps_every_object_and_the_swap_copies_the_old_bits_back(structure, seed) -> None:
    target, source = build(structure, seed), build(structure, seed + 1)
    objects, values = slots(target), bits(target)
    swap = TensorTree.from_module(source).to_module(target, inplace=True)
    assert all(slots(target)[k] is objects[k] for k in objects)
    expected, persistent = tensors(source), flat(TensorTree.from_module(source))
    for name, t in tensors(target).items():
        if name in persistent:
            assert raw_bytes(t) == raw_bytes(expected[name]), name
    swap.to_module(target, inplace=True)
    assert unchanged(target, objects, values)


def _break(tree: TensorTree, how: str, pick: int) -> None:
    """Make ``tree`` hostile the way ``how`` names, at its ``pick``-th leaf."""
    names = [k for k in tree.keys(include_nested=True, leaves_only=True) if k != TIED_KEY]
    name = names[pick % len(names)]
    leaf = tree[name]
    if how == "shape":
        tree[name] = torch.zeros(*leaf.shape, 1, dtype=leaf.dtype)
    elif how == "dtype":
        tree[name] = leaf.to(torch.int32 if leaf.is_floating_point() else torch.float32)
    elif how == "unknown":
        tree["not_a_slot"] = torch.zeros(1)
    elif how == "missing":
        del tree[name]


@SETTINGS
@given(
    structure=structures,
    seed=st.integers(0, 2**16),
    how=st.sampled_from(["shape", "dtype", "unknown", "missing"]),
    pick=st.integers(0, 100),
    inplace=st.booleans(),
)
def test_a_hostile_tree_raises_and_leaves_every_slot_and_bit_as_it_was(structure, seed, how, pick, inplace) -> None:
    target = build(structure, seed)
    tree = TensorTree.from_module(build(structure, seed + 1)).apply(lambda t: t.detach().clone())
    _break(tree, how, pick)
    objects, values = slots(target), bits(target)
    with pytest.raises(MemtreeError):
        tree.to_module(target, inplace=inplace)
    assert unchanged(target, objects, values)


def _one_slot(module: nn.Module, a: str, b: str) -> bool:
    """Whether the dotted names ``a`` and ``b`` are one attribute of one sub-module object."""
    (pa, _, xa), (pb, _, xb) = a.rpartition("."), b.rpartition(".")
    return xa == xb and module.get_submodule(pa) is module.get_submodule(pb)


@SETTINGS
@given(structure=structures, seed=st.integers(0, 2**16), inplace=st.booleans())
@example(structure=[("linear", 1, False), ("tie", 0), ("share", 1)], seed=0, inplace=False)  # two aliases, one slot
def test_tied_names_given_different_tensors_bind_apart_unless_one_slot_holds_both(structure, seed, inplace) -> None:
    target = build(structure, seed)
    tree = TensorTree.from_module(build(structure, seed + 1)).apply(lambda t: t.detach().clone())
    record = dict(tree[TIED_KEY]) if TIED_KEY in tree else {}
    if record:
        del tree[TIED_KEY]
    for alias, stored in record.items():  # every alias its own tensor, with other bits
        tree[tuple(alias.split("."))] = tree[tuple(stored.split("."))] + 1
    objects, values = slots(target), bits(target)
    groups: dict[str, list[str]] = {}  # each stored name with its aliases: each name its own tensor now
    for alias, stored in record.items():
        groups.setdefault(stored, [stored]).append(alias)
    one_slot = any(_one_slot(target, a, b) for names in groups.values() for a, b in itertools.combinations(names, 2))
    refused = one_slot or (inplace and bool(record))
    if refused:
        with pytest.raises(MemtreeError, match="different values"):
            tree.to_module(target, inplace=inplace)
        assert unchanged(target, objects, values)
        return
    swap = tree.to_module(target, inplace=inplace)
    leaves, now = flat(tree), tensors(target)
    for name, leaf in leaves.items():
        if inplace:
            assert raw_bytes(now[name]) == raw_bytes(leaf), name
        else:
            assert now[name].data_ptr() == leaf.data_ptr(), name
    swap.to_module(target, inplace=inplace)
    assert unchanged(target, objects, values)
