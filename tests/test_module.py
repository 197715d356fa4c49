"""Modules: from_module / to_module / load_into_module / empty_init / init_missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping

import pytest
import torch
from torch import nn

import memtree
from memtree import (
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
from memtree.tree.parts.bind import TIED_KEY


# --------------------------------------------------------------------------------- models
class TinyLM(nn.Module):
    """A small causal transformer language model; ``tie`` shares embedding and output weights."""

    def __init__(self, vocab: int = 61, d: int = 32, layers: int = 2, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(16, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight
        mask = torch.triu(torch.full((16, 16), float("-inf")), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:n]
        h = self.encoder(h, mask=self.causal[:n, :n])
        return self.head(self.norm(h))


def convnet(classes: int = 10) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, stride=2),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, classes),
    )


def trained_convnet() -> nn.Sequential:
    """A conv net whose BatchNorm running statistics moved away from their initial values."""
    torch.manual_seed(0)
    net = convnet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(3):
        loss = net(torch.randn(4, 3, 12, 12)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(1))


def _files(path: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs)


# ---------------------------------------------------------------------------- from_module
def test_from_module_nests_by_module_path_and_shares_the_tensors() -> None:
    model = TinyLM(tie=False)
    tree = TensorTree.from_module(model)
    assert tree["encoder", "layers", "0", "self_attn", "in_proj_weight"] is (
        model.encoder.layers[0].self_attn.in_proj_weight
    )
    assert isinstance(tree["embed", "weight"], nn.Parameter)
    flat = {".".join(k) if isinstance(k, tuple) else k for k in tree.keys(True, True)}
    assert flat == set(model.state_dict())  # params + persistent buffers, same dotted names


def test_from_module_leaves_out_non_persistent_buffers_and_keeps_persistent_ones() -> None:
    model = nn.Sequential(nn.BatchNorm1d(3))
    model.register_buffer("scratch", torch.ones(2), persistent=False)
    tree = TensorTree.from_module(model)
    assert "scratch" not in tree
    assert torch.equal(tree["0", "running_var"], torch.ones(3))
    assert tree["0", "num_batches_tracked"].dtype == torch.int64


def test_from_module_of_a_meta_module_can_be_allocated_with_memmap_like(tmp_path) -> None:
    with empty_init():
        model = TinyLM()
    like = TensorTree.from_module(model).memmap_like(tmp_path / "m")
    assert like["embed", "weight"].shape == (61, 32) and like.is_memmap()


def test_from_module_with_state_dict_honours_hooks_and_extra_state() -> None:
    class WithExtra(nn.Linear):
        def get_extra_state(self) -> dict:
            return {"scale": 2}

        def set_extra_state(self, state: dict) -> None:
            self.scale = state["scale"]

    model = nn.Sequential(WithExtra(2, 2))
    tree = TensorTree.from_module(model, use_state_dict=True)
    assert tree["0", "_extra_state"] == {"scale": 2}
    fresh = nn.Sequential(WithExtra(2, 2))
    weight = fresh[0].weight
    tree.to_module(fresh, inplace=True)
    assert fresh[0].scale == 2 and fresh[0].weight is weight  # filled in place
    assert torch.equal(fresh[0].weight, model[0].weight)
    other = nn.Sequential(WithExtra(2, 2))
    tree.to_module(other)  # bound: the state_dict's tensor (detached, model's memory)
    assert other[0].scale == 2 and other[0].weight.data_ptr() == model[0].weight.data_ptr()


def test_from_module_with_state_dict_stores_tied_tensors_once() -> None:
    model = TinyLM(tie=True)
    model.register_buffer("empty_a", torch.zeros(0))
    model.register_buffer("empty_b", torch.zeros(0))  # no data: never taken for a tie
    tree = TensorTree.from_module(model, use_state_dict=True)
    assert tree[TIED_KEY] == {"head.weight": "embed.weight"}
    assert "empty_a" in tree and "empty_b" in tree


def test_from_module_refuses_uninitialized_lazy_parameters() -> None:
    with pytest.raises(SourceError, match="uninitialized parameter of a lazy module"):
        TensorTree.from_module(nn.LazyLinear(3))


# ------------------------------------------------------- round trips through the disk
def test_transformer_forward_is_bit_identical_after_memmap_and_to_module(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyLM().eval()
    TensorTree.from_module(model).memmap(tmp_path / "lm")
    with empty_init():
        fresh = TinyLM().eval()
    loaded = load_memmap(tmp_path / "lm")
    loaded.to_module(fresh)
    with torch.no_grad():
        assert torch.equal(fresh(tokens()), model(tokens()))
    assert torch.equal(fresh(tokens()), model(tokens()))  # also with autograd on (slow path)
    # the weights are the files: same memory as the mapped leaves, no copy
    ffn = fresh.encoder.layers[1].linear1.weight
    assert type(ffn) is nn.Parameter and ffn.requires_grad
    assert ffn.data_ptr() == loaded["encoder", "layers", "1", "linear1", "weight"].data_ptr()


def test_convnet_with_batchnorm_buffers_round_trips_bit_exactly(tmp_path) -> None:
    model = trained_convnet()
    assert int(model[1].num_batches_tracked) == 3
    TensorTree.from_module(model).memmap(tmp_path / "cnn")
    with empty_init():
        fresh = convnet().eval()
    load_memmap(tmp_path / "cnn").to_module(fresh)
    assert not isinstance(fresh[1].running_mean, nn.Parameter)
    assert torch.equal(fresh[1].running_mean, model[1].running_mean)
    assert int(fresh[4].num_batches_tracked) == 3
    x = torch.randn(2, 3, 12, 12)
    assert torch.equal(fresh(x), model(x))


def test_tied_weights_are_stored_once_and_tied_again_after_load(tmp_path) -> None:
    torch.manual_seed(0)
    model = TinyLM(tie=True).eval()
    tree = TensorTree.from_module(model)
    assert tree[TIED_KEY] == {"head.weight": "embed.weight"}
    assert "head" not in tree
    tree.memmap(tmp_path / "lm")
    assert "embed/weight.memmap" in _files(tmp_path / "lm")
    assert not any(f.startswith("head") for f in _files(tmp_path / "lm"))
    root_meta = json.loads((tmp_path / "lm" / "meta.json").read_bytes())
    assert {"key": TIED_KEY, "kind": "json", "value": {"head.weight": "embed.weight"}} in root_meta["entries"]

    with empty_init():
        fresh = TinyLM(tie=True).eval()
    load_memmap(tmp_path / "lm").to_module(fresh)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh(tokens()), model(tokens()))


@pytest.mark.parametrize("live", [False, True])
def test_tie_record_ties_a_module_that_does_not_tie_itself(tmp_path, live) -> None:
    model = TinyLM(tie=True).eval()
    TensorTree.from_module(model).memmap(tmp_path / "lm")
    if live:
        untied = TinyLM(tie=False).eval()
    else:
        with empty_init():
            untied = TinyLM(tie=False).eval()
    assert untied.head.weight is not untied.embed.weight
    # bound (meta, or assign=True): the record ties them; live: both filled with the values
    assert load_into_module(untied, tmp_path / "lm", assign=live) == LoadResult([], [])
    assert untied.head.weight is untied.embed.weight
    assert torch.equal(untied(tokens()), model(tokens()))


def test_filling_a_live_module_keeps_its_own_ties_and_creates_none(tmp_path) -> None:
    model = TinyLM(tie=True).eval()
    TensorTree.from_module(model).memmap(tmp_path / "lm")
    untied, tied = TinyLM(tie=False).eval(), TinyLM(tie=True).eval()
    load_into_module(untied, tmp_path / "lm")
    load_into_module(tied, tmp_path / "lm")
    assert untied.head.weight is not untied.embed.weight  # filled with the same values
    assert torch.equal(untied.head.weight, untied.embed.weight)
    assert tied.head.weight is tied.embed.weight
    assert torch.equal(untied(tokens()), model(tokens())) and torch.equal(tied(tokens()), model(tokens()))


def test_a_sub_module_used_twice_is_stored_once() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    tree = TensorTree.from_module(model)
    assert tree[TIED_KEY] == {"2.weight": "0.weight", "2.bias": "0.bias"}
    fresh_shared = nn.Linear(3, 3)
    fresh = nn.Sequential(fresh_shared, nn.ReLU(), fresh_shared)
    tree.to_module(fresh, inplace=True)
    assert fresh[0].weight is fresh[2].weight and torch.equal(fresh[0].weight, model[0].weight)
    tree.to_module(fresh)
    assert fresh[0].weight is fresh[2].weight and fresh[0].weight is model[0].weight


# -------------------------------------------------------------------------- to_module
def test_to_module_binds_and_returns_the_swapped_out_objects_which_bind_back() -> None:
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.bias.requires_grad_(False)
    old_weight, old_bias = b.weight, b.bias
    swap = TensorTree.from_module(a).to_module(b)
    assert swap["weight"] is old_weight and swap["bias"] is old_bias
    assert b.weight is a.weight  # a source nn.Parameter is bound as it is
    swap.to_module(b)
    assert b.weight is old_weight and b.bias is old_bias


def test_to_module_in_place_swap_holds_copies_of_the_old_values_never_aliases() -> None:
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    old_weight, old_values = b.weight, b.weight.detach().clone()
    swap = TensorTree.from_module(a).to_module(b, inplace=True)
    assert b.weight is old_weight and torch.equal(b.weight, a.weight)  # filled in place
    assert torch.equal(swap["weight"], old_values)  # the values before the fill ...
    assert swap["weight"].data_ptr() != b.weight.data_ptr()  # ... in their own memory
    with torch.no_grad():
        b.weight.add_(1.0)
    assert torch.equal(swap["weight"], old_values)
    swap.to_module(b, inplace=True)
    assert b.weight is old_weight and torch.equal(b.weight, old_values)


def test_to_module_wraps_plain_tensors_in_parameters_keeping_requires_grad() -> None:
    m = nn.Linear(2, 2)
    m.bias.requires_grad_(False)
    new = TensorTree({"weight": torch.ones(2, 2), "bias": torch.zeros(2)})
    out = new.to_module(m, return_swap=False)
    assert out is None
    assert isinstance(m.weight, nn.Parameter) and m.weight.requires_grad
    assert isinstance(m.bias, nn.Parameter) and not m.bias.requires_grad
    assert m.weight.data_ptr() == new["weight"].data_ptr()


def test_to_module_refuses_unknown_keys_before_changing_anything() -> None:
    m = nn.Linear(2, 2)
    before = m.weight
    bad = TensorTree({"weight": torch.ones(2, 2), "extra": {"w": torch.ones(1)}})
    with pytest.raises(MemtreeKeyError, match="extra.w"):
        bad.to_module(m)
    assert m.weight is before


def test_to_module_refuses_a_shape_mismatch_naming_key_and_both_shapes() -> None:
    m = nn.Linear(2, 2)
    before = m.weight
    with pytest.raises(ShapeMismatchError, match=r"'weight'.*float32\[3, 2\].*float32\[2, 2\]"):
        TensorTree({"weight": torch.ones(3, 2), "bias": torch.ones(2)}).to_module(m)
    assert m.weight is before


def test_to_module_accepts_a_flat_tree_with_dotted_keys() -> None:
    model, fresh = convnet(), convnet()
    TensorTree(model.state_dict()).to_module(fresh)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in fresh.state_dict().items())


# ------------------------------------------------------------------ load_into_module
def test_load_into_module_from_a_directory_maps_the_files_copy_on_write(tmp_path) -> None:
    model = trained_convnet()
    TensorTree.from_module(model).memmap(tmp_path / "cnn")
    with empty_init():
        fresh = convnet().eval()
    assert load_into_module(fresh, tmp_path / "cnn") == LoadResult([], [])
    x = torch.randn(2, 3, 12, 12)
    assert torch.equal(fresh(x), model(x))
    with torch.no_grad():
        fresh[0].weight.add_(1.0)  # training the loaded model never changes the checkpoint
    assert torch.equal(load_memmap(tmp_path / "cnn")["0", "weight"], model[0].weight)


def test_load_into_module_from_a_flat_state_dict() -> None:
    model, fresh = trained_convnet(), convnet().eval()
    running_var = fresh[1].running_var
    result = load_into_module(fresh, model.state_dict())
    assert result == LoadResult([], [])
    assert fresh[1].running_var is running_var and torch.equal(running_var, model[1].running_var)


def test_strict_partial_load_raises_before_changing_anything(tmp_path) -> None:
    source = convnet()
    TensorTree.from_module(source).exclude(("8", "bias")).memmap(tmp_path / "part")
    target = convnet()
    before = {k: v.data_ptr() for k, v in target.state_dict().items()}
    with pytest.raises(MemtreeKeyError, match="missing from the source: '8.bias'"):
        load_into_module(target, tmp_path / "part")
    assert {k: v.data_ptr() for k, v in target.state_dict().items()} == before


def test_non_strict_partial_load_reports_missing_and_unexpected() -> None:
    source = TensorTree.from_module(convnet()).flatten_keys()
    del source["8.bias"]
    source["9.weight"] = torch.ones(1)
    target = convnet()
    old_bias = target[8].bias
    result = load_into_module(target, source, strict=False)
    assert result.missing == ["8.bias"] and result.unexpected == ["9.weight"]
    missing, unexpected = result  # unpacks like torch's load_state_dict result
    assert target[8].bias is old_bias
    assert torch.equal(target[8].weight, source["8.weight"])


def test_unexpected_keys_fail_a_strict_load() -> None:
    source = dict(convnet().state_dict(), **{"head.weight": torch.ones(2)})
    with pytest.raises(MemtreeKeyError, match="unexpected in the source: 'head.weight'"):
        load_into_module(convnet(), source)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"0.weight": torch.ones(8, 3, 5, 5)}, r"'0.weight'.*source float32\[8, 3, 5, 5\], module float32\[8, 3, 3, 3\]"),
        ({"0.weight": torch.ones(8, 3, 3, 3, dtype=torch.float16)}, r"'0.weight'.*source float16\[8, 3, 3, 3\], module float32"),
    ],
)
def test_shape_and_dtype_mismatches_name_the_key_and_both_sides(bad, message) -> None:
    source = dict(convnet().state_dict(), **bad)
    target = convnet()
    before = target[0].weight
    with pytest.raises(ShapeMismatchError, match=message):
        load_into_module(target, source, strict=False)  # raised even when not strict
    assert target[0].weight is before


def test_keys_restricts_the_load_to_dotted_prefixes_or_tuples(tmp_path) -> None:
    torch.manual_seed(0)
    source = TinyLM(tie=False)
    TensorTree.from_module(source).memmap(tmp_path / "lm")
    with empty_init():
        target = TinyLM(tie=False)
    result = load_into_module(target, tmp_path / "lm", keys=["encoder.layers.0", ("norm",)])
    assert result == LoadResult([], [])
    assert torch.equal(target.encoder.layers[0].linear1.weight, source.encoder.layers[0].linear1.weight)
    assert torch.equal(target.norm.weight, source.norm.weight)
    assert target.encoder.layers[1].linear1.weight.is_meta and target.embed.weight.is_meta


def test_keys_computes_missing_within_the_selection() -> None:
    source = {k: v for k, v in convnet().state_dict().items() if not k.startswith("4.")}
    target = convnet()
    with pytest.raises(MemtreeKeyError, match="missing from the source: '4.weight'"):
        load_into_module(target, source, keys="4")
    assert load_into_module(target, source, keys=["0", "1"]) == LoadResult([], [])


def test_new_head_partial_load_then_init_missing_gives_a_runnable_model(tmp_path) -> None:
    torch.manual_seed(0)
    TensorTree.from_module(convnet(classes=10)).memmap(tmp_path / "cnn")
    loaded = load_memmap(tmp_path / "cnn")
    with empty_init():
        model = convnet(classes=4).eval()  # a new head: 4 classes instead of 10
    with pytest.raises(ShapeMismatchError, match=r"'8.weight'.*float32\[10, 16\].*float32\[4, 16\]"):
        load_into_module(model, tmp_path / "cnn", strict=False)
    result = load_into_module(model, tmp_path / "cnn", keys=[str(i) for i in range(8)])
    assert result == LoadResult([], [])
    assert model[8].weight.is_meta
    assert init_missing(model) == ["8.weight", "8.bias"]
    assert model[8].weight.abs().sum() > 0  # initialised by Linear.reset_parameters
    assert torch.equal(model[0].weight, loaded["0", "weight"])  # loaded tensors untouched
    assert model(torch.randn(2, 3, 12, 12)).shape == (2, 4)


def test_init_missing_keeps_loaded_tensors_of_a_partly_loaded_module() -> None:
    with empty_init():
        m = nn.Linear(3, 2)
    load_into_module(m, {"weight": torch.full((2, 3), 7.0)}, strict=False)
    assert init_missing(m) == ["bias"]
    assert torch.equal(m.weight, torch.full((2, 3), 7.0)) and not m.bias.is_meta


def test_init_missing_zero_fills_tensors_of_modules_without_reset_parameters() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(3))

    with empty_init():
        m = Scale()
    with pytest.warns(UserWarning, match="Scale.gain"):
        assert init_missing(m) == ["gain"]
    assert torch.equal(m.gain, torch.zeros(3)) and m.gain.requires_grad


def test_load_into_module_device_copies_the_tensors_there() -> None:
    source = convnet().state_dict()
    with empty_init():
        target = convnet()
    load_into_module(target, source, device="cpu")  # already there: still zero-copy
    assert target[0].weight.data_ptr() == source["0.weight"].data_ptr()
    with empty_init():
        meta_target = convnet()
    load_into_module(meta_target, source, device="meta")
    assert meta_target[0].weight.is_meta


class LazyCheckpoint(Mapping):
    """A checkpoint that reads a tensor only when it is accessed (like memtree.interop's)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors
        self.reads: list[str] = []

    def __getitem__(self, key: str) -> torch.Tensor:
        self.reads.append(key)
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def tensor_spec(self, key: str) -> tuple[torch.Size, torch.dtype]:
        t = self._tensors[key]
        return t.shape, t.dtype


def test_a_lazy_mapping_is_checked_from_its_specs_and_only_bound_keys_are_read() -> None:
    state = convnet().state_dict()
    lazy = LazyCheckpoint(dict(state, **{"8.weight": torch.ones(3, 16)}))
    with pytest.raises(ShapeMismatchError, match="'8.weight'"):
        load_into_module(convnet(), lazy)
    assert lazy.reads == []  # refused from the specs alone
    lazy = LazyCheckpoint(state)
    target = convnet()
    assert load_into_module(target, lazy, keys=["0"]) == LoadResult([], [])
    assert sorted(lazy.reads) == ["0.bias", "0.weight"]


def test_a_file_source_loads_through_memtree_interop(tmp_path) -> None:
    interop = pytest.importorskip("memtree.interop")
    if not hasattr(interop, "open_checkpoint"):
        pytest.skip("memtree.interop.open_checkpoint is not available")
    model = trained_convnet()
    torch.save(model.state_dict(), tmp_path / "model.pt")
    fresh = convnet().eval()
    assert load_into_module(fresh, tmp_path / "model.pt") == LoadResult([], [])
    x = torch.randn(2, 3, 12, 12)
    assert torch.equal(fresh(x), model(x))


def test_unknown_source_kinds_are_refused() -> None:
    with pytest.raises(SourceError, match="cannot load from a list"):
        load_into_module(convnet(), [torch.ones(1)])
    with pytest.raises(memtree.NotAMemtreeError):
        load_into_module(convnet(), "/nonexistent/memtree/dir")


# ------------------------------------------------------------------------- empty_init
def test_empty_init_puts_parameters_and_persistent_buffers_on_meta() -> None:
    with empty_init():
        model = TinyLM()
        bn = nn.BatchNorm1d(4)
    assert all(p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.weight  # ties made by the constructor survive
    assert bn.running_mean.is_meta and bn.weight.requires_grad
    # non-persistent buffers are never in a checkpoint: computed as usual
    assert not model.causal.is_meta and model.causal[0, 1] == float("-inf")
    assert not nn.Linear(2, 2).weight.is_meta  # the patch is gone after the context


def test_empty_init_restores_the_patch_after_an_exception() -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with empty_init():
            raise RuntimeError("boom")
    assert not nn.Linear(2, 2).weight.is_meta


_RSS_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    import memtree

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024

    def big():
        return nn.Sequential(*[nn.Linear(4096, 8192) for _ in range(8)])

    tree = memtree.load_memmap(sys.argv[1])       # maps the files; reads no data
    with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
        f.write("5")
    before = status("VmRSS")
    with memtree.empty_init():
        model = big()
    tree.to_module(model)
    peak = status("VmHWM")
    w = model[7].weight
    print(json.dumps({
        "growth": peak - before,
        "bound": type(w).__name__ == "Parameter" and w.data_ptr() == tree["7", "weight"].data_ptr(),
        "meta": sum(p.is_meta for p in model.parameters()),
    }))
    """
)


def test_empty_init_and_to_module_bind_a_1gb_model_without_raising_rss(tmp_path) -> None:
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to measure peak RSS")
    with empty_init():
        meta = nn.Sequential(*[nn.Linear(4096, 8192) for _ in range(8)])
    model_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
    assert model_bytes > 1_000_000_000
    TensorTree.from_module(meta).memmap_like(tmp_path / "big")  # real files, 1 GB, sparse
    out = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(tmp_path / "big")],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bound"] and result["meta"] == 0
    assert result["growth"] < 0.10 * model_bytes, result
