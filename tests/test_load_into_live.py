"""Loading into live modules (filled in place) and load_into_module's prefix/dtype/ignore_mismatched.

A module built the usual way has real parameters; the usual resume order builds the model, then
the optimizer, then loads the checkpoint. Loading must fill those parameters in place, or the
optimizer updates orphaned tensors and the model never trains.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from memtree import (
    InvalidArgumentError,
    LoadResult,
    MemtreeKeyError,
    ShapeMismatchError,
    SourceError,
    TensorTree,
    empty_init,
    init_missing,
    load_into_module,
    load_memmap,
)
from memtree.interop import save_safetensors


def net(classes: int = 3) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, classes))


def trained_net(classes: int = 3) -> nn.Sequential:
    """A net whose weights and BatchNorm statistics differ from a fresh one's."""
    torch.manual_seed(0)
    model = net(classes)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        train_step(model, opt)
    return model


_X = torch.randn(8, 6, generator=torch.Generator().manual_seed(3))


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.train()
    loss = model(_X).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_source(model: nn.Module, kind: str, tmp_path: Any) -> Any:
    state = _state(model)
    if kind == "directory":
        TensorTree.from_module(model).memmap(tmp_path / "d")
        return tmp_path / "d"
    if kind == "state_dict":
        return state
    if kind == "tree":
        return TensorTree.from_module(model).clone()
    if kind == "safetensors":
        save_safetensors(state, tmp_path / "m.safetensors")
        return tmp_path / "m.safetensors"
    torch.save(state, tmp_path / "m.pt")
    return tmp_path / "m.pt"


KINDS = ["directory", "state_dict", "tree", "safetensors", "torch.save"]
OPTIMIZERS: list[Callable[..., torch.optim.Optimizer]] = [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.AdamW(params, lr=0.01),
]


def _load(how: str, model: nn.Module, source: Any) -> None:
    if how == "load_into_module":
        load_into_module(model, source)
    elif isinstance(source, TensorTree):
        source.to_module(model, return_swap=False, inplace=True)
    else:  # to_module of a directory's tree
        load_memmap(source, mode="r").to_module(model, return_swap=False, inplace=True)


# ------------------------------------------------------------------ part 1: the resume order
@pytest.mark.parametrize("make_opt", OPTIMIZERS, ids=["SGD", "AdamW"])
@pytest.mark.parametrize(
    "how, kind",
    [("load_into_module", k) for k in KINDS] + [("to_module(inplace)", "tree"), ("to_module(inplace)", "directory")],
)
def test_model_then_optimizer_then_load_trains_the_module(tmp_path, make_opt, how, kind) -> None:
    saved = trained_net()
    source = make_source(saved, kind, tmp_path)
    torch.manual_seed(1)
    model = net()
    opt = make_opt(model.parameters())  # the usual resume order: model, optimizer, then load
    _load(how, model, source)
    loaded = _state(model)
    assert all(torch.equal(loaded[k], v) for k, v in saved.state_dict().items())
    train_step(model, opt)
    assert not torch.equal(model[0].weight, loaded["0.weight"]), "the optimizer must update the module"
    # exactly as a model that was loaded first and given its optimizer afterwards
    reference = net()
    reference.load_state_dict(saved.state_dict())
    train_step(reference, make_opt(reference.parameters()))
    for (name, mine), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(mine, theirs), name


def test_live_tensors_keep_their_objects_storage_hooks_and_references(tmp_path) -> None:
    saved = trained_net()
    TensorTree.from_module(saved).memmap(tmp_path / "d")
    model = net()
    before = {n: (t, t.data_ptr(), t.device, t.requires_grad) for n, t in model.state_dict(keep_vars=True).items()}
    grads: list[torch.Tensor] = []
    model[0].weight.register_hook(grads.append)
    held = model[3].weight  # a reference kept elsewhere (an EMA copy's source, a logger...)
    assert load_into_module(model, tmp_path / "d") == LoadResult([], [])
    for name, t in model.state_dict(keep_vars=True).items():
        obj, ptr, device, requires_grad = before[name]
        assert t is obj and t.data_ptr() == ptr and t.device == device and t.requires_grad == requires_grad
        assert t.grad_fn is None  # still a leaf: the copy is not recorded by autograd
        assert torch.equal(t, saved.state_dict()[name])
    assert torch.equal(held, saved[3].weight)
    model(_X).sum().backward()
    assert len(grads) == 1  # the hook registered before the load still fires
    # the checkpoint is read, never written
    assert torch.equal(load_memmap(tmp_path / "d")["0", "weight"], saved[0].weight)


def test_a_partly_meta_module_binds_its_meta_tensors_and_fills_its_live_ones(tmp_path) -> None:
    saved = trained_net()
    TensorTree.from_module(saved).memmap(tmp_path / "d")
    tree = load_memmap(tmp_path / "d", mode="r")
    with empty_init():
        model = net()
    model[0] = nn.Linear(6, 16)  # live
    live = model[0].weight
    tree.to_module(model, return_swap=False, inplace=True)
    assert model[0].weight is live and torch.equal(live, saved[0].weight)
    assert model[3].weight.data_ptr() == tree["3", "weight"].data_ptr()  # bound, zero-copy
    assert torch.equal(model.eval()(_X), saved.eval()(_X))


@pytest.mark.parametrize("how", ["load_into_module(assign)", "to_module"])
def test_assign_and_to_module_bind_even_live_tensors(tmp_path, how) -> None:
    saved = trained_net()
    tree = TensorTree.from_module(saved).clone()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if how == "to_module":
        tree.to_module(model)  # binding: the default
    else:
        load_into_module(model, tree, assign=True)
    assert model[0].weight.data_ptr() == tree["0", "weight"].data_ptr()  # shares the source
    train_step(model, opt)  # an optimizer built before an assign=True load holds the old tensors
    assert torch.equal(model[0].weight, saved[0].weight)


def test_device_of_live_tensors_is_kept_and_a_conflicting_device_raises() -> None:
    saved = trained_net()
    model = net()
    weight = model[0].weight
    with pytest.raises(InvalidArgumentError, match=r"device='meta'.*'0.weight \(cpu\)'.*move the module first"):
        load_into_module(model, saved.state_dict(), device="meta")
    assert model[0].weight is weight and not torch.equal(weight, saved[0].weight)  # nothing changed
    load_into_module(model, saved.state_dict(), device="meta", assign=True)  # bound: moved there
    assert model[0].weight.is_meta


# ----------------------------------------------------------------------------- part 2: prefix=
class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(self.embed(tokens)))


class LM(nn.Module):
    """A task model around a backbone: names ``model.*`` and ``lm_head.weight``."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.model = Backbone()
        self.lm_head = nn.Linear(8, 20, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(tokens))


_TOKENS = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(0))


def test_prefix_strips_from_the_source_for_a_base_model(tmp_path) -> None:
    lm = LM(tie=False).eval()
    TensorTree.from_module(lm).memmap(tmp_path / "lm")
    base = Backbone().eval()
    result = load_into_module(base, tmp_path / "lm", prefix="model.", strict=False)
    assert result == LoadResult([], ["lm_head.weight"])  # names without the prefix: as they are
    assert torch.equal(base(_TOKENS), lm.model(_TOKENS))


@pytest.mark.parametrize("tie", [True, False])
def test_prefix_adds_to_the_source_for_a_task_model(tmp_path, tie) -> None:
    base = Backbone().eval()
    save_safetensors(_state(base), tmp_path / "base.safetensors")  # a lazy file source
    lm = LM(tie=tie).eval()
    result = load_into_module(lm, tmp_path / "base.safetensors", prefix="model", strict=False)
    assert result == LoadResult([] if tie else ["lm_head.weight"], [])  # the tie shares embed
    assert torch.equal(lm.model(_TOKENS), base(_TOKENS))


def test_prefix_renames_the_tie_record_too(tmp_path) -> None:
    lm = LM(tie=True).eval()
    TensorTree.from_module(lm).memmap(tmp_path / "lm")  # records {"lm_head.weight": "model.embed.weight"}
    with empty_init():
        wrapped = nn.ModuleDict({"net": LM(tie=False)})
    assert load_into_module(wrapped, tmp_path / "lm", prefix="net.") == LoadResult([], [])
    assert wrapped["net"].lm_head.weight is wrapped["net"].model.embed.weight
    assert torch.equal(wrapped["net"](_TOKENS), lm(_TOKENS))


def test_prefix_of_a_training_checkpoint_file(tmp_path) -> None:
    base = Backbone().eval()
    torch.save({"state_dict": base.state_dict(), "epoch": 3}, tmp_path / "last.ckpt")
    fresh = Backbone().eval()
    with pytest.raises(MemtreeKeyError, match=r"pass prefix='state_dict\.'"):
        load_into_module(fresh, tmp_path / "last.ckpt")
    assert load_into_module(fresh, tmp_path / "last.ckpt", prefix="state_dict") == LoadResult([], [])
    assert torch.equal(fresh(_TOKENS), base(_TOKENS))


def test_prefix_on_both_sides_matches_names_as_they_are() -> None:
    lm = LM(tie=False)
    fresh = LM(tie=False)
    assert load_into_module(fresh, _state(lm), prefix="model.") == LoadResult([], [])
    assert torch.equal(fresh.lm_head.weight, lm.lm_head.weight)


@pytest.mark.parametrize("prefix", ["decoder.", "mod", "model.embed.weight.x"])
def test_a_prefix_on_neither_side_raises(prefix) -> None:
    with pytest.raises(MemtreeKeyError, match="starts no name of the source and no name of the module"):
        load_into_module(Backbone(), _state(LM()), prefix=prefix)


@pytest.mark.parametrize("prefix", ["", ".", 3, ("model",)])
def test_a_malformed_prefix_raises(prefix) -> None:
    with pytest.raises(InvalidArgumentError, match="prefix="):
        load_into_module(Backbone(), _state(Backbone()), prefix=prefix)


def test_a_prefix_that_makes_two_source_names_equal_raises() -> None:
    state = _state(Backbone())
    state["model.body.bias"] = torch.zeros(8)
    with pytest.raises(SourceError, match=r"'model.body.bias' and 'body.bias'|'body.bias' and 'model.body.bias'"):
        load_into_module(Backbone(), state, prefix="model.")


def test_strict_error_suggests_the_prefix_in_both_directions() -> None:
    lm_state, base_state = _state(LM(tie=False)), _state(Backbone())
    base = Backbone()
    before = base.body.weight.detach().clone()
    with pytest.raises(MemtreeKeyError, match=r"differ by a prefix: pass prefix='model\.' \(5 more names"):
        load_into_module(base, lm_state)
    with pytest.raises(MemtreeKeyError, match=r"differ by a prefix: pass prefix='model\.'") as err:
        load_into_module(LM(tie=False), base_state)
    assert "strict=False" not in str(err.value)
    assert torch.equal(base.body.weight, before)


def test_strict_error_says_when_nothing_matches_and_when_some_names_do() -> None:
    unrelated = {"conv.weight": torch.ones(1), "conv.bias": torch.ones(1)}
    with pytest.raises(MemtreeKeyError, match="strict=False would load nothing") as err:
        load_into_module(Backbone(), unrelated)
    assert "pass strict=False" not in str(err.value)
    partial = {k: v for k, v in _state(Backbone()).items() if k != "norm.bias"}
    with pytest.raises(MemtreeKeyError, match="pass strict=False to load the 4 tensors that match"):
        load_into_module(Backbone(), partial)


# ------------------------------------------------------------------------------ part 2: dtype=
def test_dtype_casts_a_bf16_checkpoint_into_a_live_fp32_model() -> None:
    saved = trained_net()
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _state(saved).items()}
    model = net()
    weight = model[0].weight
    with pytest.raises(ShapeMismatchError, match=r"source bfloat16\[16, 6\], module float32.*dtype="):
        load_into_module(model, bf16)
    assert load_into_module(model, bf16, dtype=torch.float32) == LoadResult([], [])
    assert model[0].weight is weight and weight.dtype == torch.float32
    for name, value in model.state_dict().items():
        assert torch.equal(value, bf16[name].to(value.dtype)), name
    assert model[1].num_batches_tracked.dtype == torch.int64  # integers keep their dtype


def test_dtype_casts_a_file_into_a_meta_model_tensor_by_tensor(tmp_path) -> None:
    saved = trained_net().eval()
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in _state(saved).items()}
    save_safetensors(bf16, tmp_path / "bf16.safetensors")
    with empty_init():
        model = net().eval()
    assert load_into_module(model, tmp_path / "bf16.safetensors", dtype=torch.float32) == LoadResult([], [])
    assert model[0].weight.dtype == torch.float32 and isinstance(model[0].weight, nn.Parameter)
    assert torch.equal(model[0].weight, bf16["0.weight"].float())
    low = net().to(torch.bfloat16)  # and down: an fp32 checkpoint into a bf16 model
    load_into_module(low, _state(saved), dtype=torch.bfloat16)
    assert torch.equal(low[3].weight, saved[3].weight.to(torch.bfloat16))


def test_dtype_must_then_match_the_module_and_must_be_floating() -> None:
    state = _state(net())
    with pytest.raises(ShapeMismatchError, match=r"source float32\[16, 6\] \(cast to float16\), module float32"):
        load_into_module(net(), state, dtype=torch.float16)
    with pytest.raises(InvalidArgumentError, match="floating-point dtype"):
        load_into_module(net(), state, dtype=torch.int64)


_CAST_RSS_CHILD = textwrap.dedent(
    """
    import json
    import torch
    from torch import nn
    import memtree

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024

    torch.manual_seed(0)
    model = nn.ModuleList([nn.Linear(2048, 4096, bias=False) for _ in range(8)])  # 8 x 32 MiB fp32
    state = {f"{i}.weight": torch.randn(4096, 2048).to(torch.bfloat16) for i in range(8)}
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    before = status("VmRSS")
    result = memtree.load_into_module(model, state, dtype=torch.float32)
    peak = status("VmHWM")
    same = all(torch.equal(model[i].weight, state[f"{i}.weight"].float()) for i in range(8))
    print(json.dumps({"growth": peak - before, "same": same, "result": list(result)}))
    """
)


def test_dtype_cast_holds_no_copy_of_the_checkpoint() -> None:
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to measure peak RSS")
    out = subprocess.run(
        [sys.executable, "-c", _CAST_RSS_CHILD], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["same"] and result["result"] == [[], []]
    tensor = 4096 * 2048 * 4  # one fp32 tensor; the model is 8 of them
    assert result["growth"] < 2 * tensor, result


# ----------------------------------------------------------------- part 2: ignore_mismatched=
def test_ignore_mismatched_skips_a_new_head_and_reports_it(tmp_path) -> None:
    saved = trained_net(classes=3)
    TensorTree.from_module(saved).memmap(tmp_path / "d")
    model = net(classes=5)
    head = model[3].weight.detach().clone()
    with pytest.raises(ShapeMismatchError, match=r"'3.weight'.*ignore_mismatched=True"):
        load_into_module(model, tmp_path / "d", strict=False)  # strict=False alone still raises
    result = load_into_module(model, tmp_path / "d", ignore_mismatched=True)  # strict=True passes
    assert result.mismatched == ["3.weight", "3.bias"] and list(result) == [[], []]
    assert torch.equal(model[3].weight, head)  # the new head keeps its own values
    assert torch.equal(model[0].weight, saved[0].weight)
    with empty_init():
        meta = net(classes=5)
    assert load_into_module(meta, tmp_path / "d", ignore_mismatched=True).mismatched == ["3.weight", "3.bias"]
    assert meta[3].weight.is_meta and init_missing(meta) == ["3.weight", "3.bias"]
    assert meta(_X).shape == (8, 5)


def test_ignore_mismatched_does_not_hide_a_dtype_mismatch() -> None:
    state = _state(net())
    state["0.weight"] = state["0.weight"].double()
    with pytest.raises(ShapeMismatchError, match=r"'0.weight'.*float64"):
        load_into_module(net(), state, ignore_mismatched=True)


def test_load_result_stays_a_pair_and_carries_mismatched() -> None:
    r = LoadResult(["a"], ["b"], ["c"])
    missing, unexpected = r
    assert (missing, unexpected, r.mismatched) == (["a"], ["b"], ["c"])
    assert r == (["a"], ["b"]) and len(r) == 2
    assert repr(r) == "LoadResult(missing=['a'], unexpected=['b'], mismatched=['c'])"
    assert repr(LoadResult([], [])) == "LoadResult(missing=[], unexpected=[])"
    back = pickle.loads(pickle.dumps(r))
    assert back.mismatched == ["c"] and back == r
