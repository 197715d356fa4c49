"""Binding trees into modules (``to_module``, tensordict's semantics) and ``from_module(use_state_dict=True)``.

``tree.to_module(module)`` binds: every parameter and buffer of the module becomes the tree's
tensor (its memory, zero-copy: a mapped leaf stays the mapping, a meta leaf makes a meta
parameter), and the swap it returns binds the previous objects back. ``inplace=True``,
``load_into_module`` and ``Checkpointer.restore`` fill in place instead (``test_load_into_live.py``).
``from_module(use_state_dict=True)`` is what ``module.state_dict()`` returns.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

import memtree
from memtree import (
    MemtreeKeyError,
    ShapeMismatchError,
    SourceError,
    TensorTree,
    empty_init,
    load_into_module,
    load_memmap,
)
from memtree.tree.parts.bind import TIED_KEY
from treeutil import random_tensor, raw_bytes


# ------------------------------------------------------------------------------------ helpers
class Tied(nn.Module):
    """An embedding and an output projection tied by the constructor, and a non-persistent mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("mask", torch.ones(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(tokens))


class WithExtra(nn.Linear):
    """A module with an extra state (``get_extra_state``/``set_extra_state``)."""

    fail = False

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.scale = 1

    def get_extra_state(self) -> dict[str, int]:
        return {"scale": self.scale}

    def set_extra_state(self, state: dict[str, int]) -> None:
        if WithExtra.fail:
            raise RuntimeError("set_extra_state refused")
        self.scale = state["scale"]


def shared_twice() -> nn.Sequential:
    lin = nn.Linear(3, 3)
    return nn.Sequential(lin, nn.ReLU(), lin)


def weight_normed() -> nn.Module:
    return parametrizations.weight_norm(nn.Linear(3, 4))


MODULES = {
    "linear": lambda: nn.Linear(3, 2),
    "batchnorm": lambda: nn.BatchNorm1d(3),
    "tied": Tied,
    "shared_twice": shared_twice,
    "parametrized": weight_normed,
    "extra_state": WithExtra,
}


def slots(module: nn.Module) -> dict[str, Any]:
    """Every parameter and buffer object by name, duplicates and non-persistent ones included."""
    out: dict[str, Any] = {f"p:{n}": t for n, t in module.named_parameters(remove_duplicate=False)}
    out.update({f"b:{n}": t for n, t in module.named_buffers(remove_duplicate=False)})
    return out


def same_slots(module: nn.Module, before: dict[str, Any]) -> bool:
    now = slots(module)
    return now.keys() == before.keys() and all(now[k] is before[k] for k in now)


def leaves(tree: TensorTree) -> dict[str, Any]:
    """The tree's leaves by dotted name, the tie record resolved (as ``state_dict()`` names them)."""
    out = {k if isinstance(k, str) else ".".join(k): v for k, v in tree.items(include_nested=True, leaves_only=True)}
    for alias, target in dict(out.pop(TIED_KEY, {})).items():
        out[alias] = out[target]
    return out


def same_value(a: Any, b: Any) -> bool:
    """Bit-exact equality of state_dict values (tensors, quantized tensors, tuples, plain values)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.is_quantized or b.is_quantized:
            return a.is_quantized and b.is_quantized and a.qscheme() == b.qscheme() and (
                same_value(a.int_repr(), b.int_repr()) and same_value(a.dequantize(), b.dequantize())
            )
        return a.dtype == b.dtype and a.shape == b.shape and raw_bytes(a) == raw_bytes(b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    return bool(type(a) is type(b) and a == b)


def randomised(module: nn.Module, seed: int = 5) -> nn.Module:
    """``module`` with recognisable values in its floating-point tensors."""
    with torch.no_grad():
        for i, t in enumerate(module.state_dict(keep_vars=True).values()):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.copy_(random_tensor(tuple(t.shape), torch.float32, seed + i).clamp(-1e3, 1e3).nan_to_num())
    return module


# ---------------------------------------------------------------- binding: zero-copy, any module
def test_a_loaded_tree_binds_into_a_live_model_as_the_mapped_files(tmp_path) -> None:
    saved = randomised(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)))
    TensorTree.from_module(saved).memmap(tmp_path / "m")
    tree = load_memmap(tmp_path / "m")
    live = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))  # built the usual way
    tree.to_module(live)
    for name, t in live.state_dict(keep_vars=True).items():
        leaf = tree[tuple(name.split("."))]
        assert t.data_ptr() == leaf.data_ptr(), f"{name} is a copy, not the mapped file"
    assert isinstance(live[0].weight, nn.Parameter) and live[0].weight.requires_grad
    assert not isinstance(live[1].running_mean, nn.Parameter)
    tree["0", "bias"][0] = 123.0  # the module's parameter is the file
    assert live[0].bias[0].item() == 123.0 and load_memmap(tmp_path / "m")["0", "bias"][0].item() == 123.0


@pytest.mark.parametrize("kind", list(MODULES))
def test_binding_is_zero_copy_and_the_swap_binds_every_old_object_back(kind) -> None:
    source, target = randomised(MODULES[kind]()), MODULES[kind]()
    tree = TensorTree.from_module(source).apply(lambda t: t.detach().clone())  # its own memory
    before = slots(target)
    swap = tree.to_module(target)
    flat = leaves(tree)
    for name, t in target.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor):
            assert t.data_ptr() == flat[name].data_ptr(), name
    assert all(type(p) is nn.Parameter for p in target.parameters())
    swap.to_module(target)
    assert same_slots(target, before)


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_meta_tree_binds_meta_tensors_into_a_live_module(kind) -> None:
    target = MODULES[kind]()
    before = slots(target)
    meta = TensorTree.from_module(MODULES[kind]()).apply(lambda t: t.detach().to("meta"))
    swap = meta.to_module(target)  # binding, as tensordict's td.to("meta").to_module(m)
    bound = [t for t in target.state_dict(keep_vars=True).values() if isinstance(t, torch.Tensor)]
    assert bound and all(t.is_meta for t in bound)
    assert all(type(p) is nn.Parameter for p in target.parameters())
    swap.to_module(target)
    assert same_slots(target, before)


def test_filling_a_live_module_from_a_meta_tree_is_refused_and_changes_nothing(tmp_path) -> None:
    TensorTree.from_module(nn.Linear(3, 2)).memmap(tmp_path / "m")
    meta = load_memmap(tmp_path / "m", device="meta")
    live = nn.Linear(3, 2)
    before, values = slots(live), raw_bytes(live.weight)
    with pytest.raises(SourceError, match=r"to_module\(inplace=True\).*'weight', 'bias'.*meta device.*bind"):
        meta.to_module(live, inplace=True)
    with pytest.raises(SourceError, match=r"load_into_module.*'weight', 'bias'.*meta device"):
        load_into_module(live, meta)
    assert same_slots(live, before) and raw_bytes(live.weight) == values


def test_binding_a_mapped_tree_of_mode_r_keeps_its_files_when_the_model_trains(tmp_path) -> None:
    saved = randomised(nn.Linear(4, 4))
    TensorTree.from_module(saved).memmap(tmp_path / "m")
    model = nn.Linear(4, 4)
    load_memmap(tmp_path / "m", mode="r").to_module(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # built after binding: it trains the binding
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    assert raw_bytes(model.weight) != raw_bytes(saved.weight)
    assert raw_bytes(load_memmap(tmp_path / "m")["weight"]) == raw_bytes(saved.weight)


# -------------------------------------------------------- parameters, gradients, functional calls
def test_parameters_stay_parameters_with_the_modules_requires_grad() -> None:
    target = nn.Linear(3, 2)
    target.bias.requires_grad_(False)
    TensorTree({"weight": torch.ones(2, 3), "bias": torch.zeros(2)}).to_module(target)
    assert type(target.weight) is nn.Parameter and target.weight.requires_grad
    assert type(target.bias) is nn.Parameter and not target.bias.requires_grad


@pytest.mark.parametrize("computed", [False, True], ids=["leaves", "computed"])
def test_a_call_through_the_bound_module_gives_gradients_wrt_the_trees_tensors(computed) -> None:
    module = randomised(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)))
    base = TensorTree.from_module(module).apply(lambda t: t.detach().clone().requires_grad_())
    params = base.apply(lambda t: t * 1.0) if computed else base  # a functional update's result
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    with params.to_module(module):
        loss = module(x).square().sum()
        assert module[0].weight is params["0", "weight"]  # the tree's tensor, as functional_call does
    loss.backward()
    reference = torch.func.functional_call(
        module, {k: v for k, v in leaves(base).items()}, (x,)
    ).square().sum()
    expected = torch.autograd.grad(reference, [base["0", "weight"], base["2", "bias"]])
    assert base["0", "weight"].grad is not None and torch.equal(base["0", "weight"].grad, expected[0])
    assert torch.equal(base["2", "bias"].grad, expected[1])
    assert type(module[0].weight) is nn.Parameter  # bound back on exit


def test_the_swap_binds_back_on_exit_even_when_the_block_raises() -> None:
    module = nn.Linear(2, 2)
    before = slots(module)
    with pytest.raises(KeyError):
        with TensorTree.from_module(nn.Linear(2, 2)).clone().to_module(module):
            assert not same_slots(module, before)
            raise KeyError("inside")
    assert same_slots(module, before)
    with pytest.raises(memtree.InvalidArgumentError, match="only the swap returned by tree.to_module"):
        with TensorTree({"x": torch.ones(1)}):
            pass


def test_an_in_place_swap_fills_the_old_values_back_on_exit() -> None:
    module = nn.Linear(2, 2)
    weight, values = module.weight, raw_bytes(module.weight)
    with TensorTree.from_module(randomised(nn.Linear(2, 2))).to_module(module, inplace=True):
        assert module.weight is weight and raw_bytes(weight) != values
    assert module.weight is weight and raw_bytes(weight) == values


# ------------------------------------------------------------------------------ ties and buffers
def test_the_tie_record_ties_names_again_and_the_swap_unties_them() -> None:
    class Untied(Tied):
        def __init__(self) -> None:
            super().__init__()
            self.head.weight = nn.Parameter(torch.zeros(7, 4))

    target = Untied()
    before = slots(target)
    swap = TensorTree.from_module(Tied()).to_module(target)
    assert target.head.weight is target.emb.weight
    swap.to_module(target)
    assert same_slots(target, before) and target.head.weight is not target.emb.weight


def test_one_attribute_of_a_sub_module_used_twice_cannot_take_two_tensors() -> None:
    target = shared_twice()
    before = slots(target)
    tree = TensorTree.from_module(shared_twice()).clone()
    del tree[TIED_KEY]
    tree["2"] = {"weight": torch.ones(3, 3), "bias": torch.ones(3)}
    with pytest.raises(SourceError, match=r"'0.weight' and '2.weight' different values.*cannot hold both"):
        tree.to_module(target)
    assert same_slots(target, before)


def test_non_persistent_buffers_are_bound_when_given_and_never_required() -> None:
    target = Tied()
    tree = TensorTree.from_module(Tied())
    assert "mask" not in tree
    mask = target.mask
    tree.to_module(target)  # not given: kept
    assert target.mask is mask
    tree["mask"] = torch.zeros(3)
    swap = tree.to_module(target)
    assert target.mask.data_ptr() == tree["mask"].data_ptr() and "mask" not in target.state_dict()
    swap.to_module(target)
    assert target.mask is mask


# --------------------------------------------------------------------- refusals change nothing
def test_a_failing_set_extra_state_puts_every_slot_back() -> None:
    target = WithExtra()
    before, values = slots(target), raw_bytes(target.weight)
    source = randomised(WithExtra())
    source.scale = 3
    tree = TensorTree.from_module(source, use_state_dict=True)
    WithExtra.fail = True
    try:
        for inplace in (False, True):
            with pytest.raises(RuntimeError, match="set_extra_state refused"):
                tree.to_module(target, inplace=inplace)
            assert same_slots(target, before) and raw_bytes(target.weight) == values and target.scale == 1
    finally:
        WithExtra.fail = False
    tree.to_module(target)
    assert target.scale == 3


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda t: t.__setitem__("bias", torch.ones(3)), ShapeMismatchError),
        (lambda t: t.__setitem__("bias", torch.ones(2, dtype=torch.float64)), ShapeMismatchError),
        (lambda t: t.__setitem__("other", torch.ones(2)), MemtreeKeyError),
        (lambda t: t.__delitem__("bias"), MemtreeKeyError),
    ],
    ids=["shape", "dtype", "unknown", "missing"],
)
@pytest.mark.parametrize("inplace", [False, True])
def test_a_bad_tree_is_refused_before_any_slot_changes(change, error, inplace) -> None:
    target = nn.Linear(3, 2)
    before, values = slots(target), raw_bytes(target.weight)
    tree = TensorTree.from_module(randomised(nn.Linear(3, 2))).clone()
    change(tree)
    with pytest.raises(error):
        tree.to_module(target, inplace=inplace)
    assert same_slots(target, before) and raw_bytes(target.weight) == values


# --------------------------------------------------------- from_module(use_state_dict=True)
def _hooks_rebinding_data() -> nn.Module:
    """The issue's module: a pre-hook adds 1 to each parameter, a post-hook rebinds p.data."""
    m = nn.Linear(3, 2)

    def pre(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        for p in module.parameters():
            p.data = p.data + 1

    def post(module: nn.Module, sd: dict[str, Any], prefix: str, meta: Any) -> None:
        for p in module.parameters():
            p.data = p.data - 1

    m.register_state_dict_pre_hook(pre)
    m.register_state_dict_post_hook(post)
    return m


def _replacing_hook() -> nn.Module:
    m = nn.Sequential(nn.Linear(2, 2))
    m._register_state_dict_hook(lambda module, sd, prefix, meta: {k: v * 2 for k, v in sd.items()})
    return m


def _none_and_non_persistent_buffers() -> nn.Module:
    m = nn.Linear(2, 2)
    m.register_buffer("gone", None)
    m.register_buffer("scratch", torch.ones(2), persistent=False)
    m.register_buffer("kept", torch.arange(3))
    return m


def _old_weight_norm() -> nn.Module:
    return torch.nn.utils.weight_norm(nn.Linear(3, 4))


def _quantized() -> nn.Module:
    return torch.ao.nn.quantized.Linear(4, 3)


def _trained_batchnorm() -> nn.Module:
    bn = nn.BatchNorm1d(3)
    bn(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))  # moves the statistics
    return bn


STATE_DICT_MODULES = {
    "linear": lambda: nn.Linear(3, 2),
    "batchnorm_trained": _trained_batchnorm,
    "tied": Tied,
    "shared_twice": shared_twice,
    "parametrize_weight_norm": weight_normed,
    "old_weight_norm": _old_weight_norm,
    "hooks_rebinding_data": _hooks_rebinding_data,
    "replacing_hook": _replacing_hook,
    "none_and_non_persistent_buffers": _none_and_non_persistent_buffers,
    "extra_state": WithExtra,
    "quantized": _quantized,
}


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")  # old weight_norm, quantized
@pytest.mark.parametrize("kind", list(STATE_DICT_MODULES))
def test_from_module_with_use_state_dict_is_exactly_what_state_dict_returns(kind) -> None:
    torch.manual_seed(0)
    module = STATE_DICT_MODULES[kind]()
    expected = module.state_dict()
    got = leaves(TensorTree.from_module(module, use_state_dict=True))
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert same_value(got[name], value), name


def test_hooks_that_rebind_p_data_give_the_values_state_dict_returns() -> None:
    module = _hooks_rebinding_data()
    weight = raw_bytes(module.weight)
    tree = TensorTree.from_module(module, use_state_dict=True)
    assert raw_bytes(tree["weight"]) == raw_bytes(module.state_dict()["weight"])
    assert raw_bytes(tree["weight"]) == raw_bytes(module.weight + 1) != weight


def test_use_state_dict_shares_the_modules_memory_and_keeps_ties() -> None:
    module = Tied()
    tree = TensorTree.from_module(module, use_state_dict=True)
    assert tree["emb", "weight"].data_ptr() == module.emb.weight.data_ptr()  # detached, no copy
    assert tree[TIED_KEY] == {"head.weight": "emb.weight"}
    with empty_init():
        meta = Tied()
    assert TensorTree.from_module(meta, use_state_dict=True)[TIED_KEY] == {"head.weight": "emb.weight"}


def test_a_pickled_or_copied_swap_is_a_plain_tree_without_the_module() -> None:
    module = nn.Linear(2, 2)
    swap = TensorTree.from_module(nn.Linear(2, 2)).to_module(module)
    for other in (pickle.loads(pickle.dumps(swap)), copy.deepcopy(swap)):
        assert torch.equal(other["weight"], swap["weight"])
        with pytest.raises(memtree.InvalidArgumentError, match="only the swap returned by tree.to_module"):
            with other:
                pass
