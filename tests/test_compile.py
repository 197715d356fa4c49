"""torch.compile and torch.export of modules whose weights memtree bound or loaded.

Bound weights (``to_module`` / ``load_into_module`` on an ``empty_init`` model) are plain
tensors over the mapped files (``memtree.tree.parts.bind.plain``), so dynamo and export see
ordinary parameters; these tests keep it that way.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

import memtree
from memtree import MemoryMappedTensor


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.l2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.bn(self.l1(x))))


X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    ref = Tiny()
    with torch.no_grad():  # running stats other than the defaults
        ref.bn.running_mean.uniform_(-1, 1)
        ref.bn.running_var.uniform_(0.5, 2)
    ref.eval()
    memtree.TensorTree.from_module(ref).memmap(tmp_path / "m")
    with torch.no_grad():
        want = ref(X)
    return tmp_path / "m", want


def bound_model(path, how: str) -> tuple[nn.Module, memtree.TensorTree | None]:
    """The model loaded the way ``how`` names, and the tree it is bound to (if bound)."""
    if how == "live":
        model = Tiny()
        memtree.load_into_module(model, path)
        return model.eval(), None
    with memtree.empty_init():
        model = Tiny()
    if how == "load_into_module":
        memtree.load_into_module(model, path)
        return model.eval(), None
    tree = memtree.load_memmap(path, mode="r" if how == "to_module_r" else "r+")
    tree.to_module(model, return_swap=False)
    return model.eval(), tree


HOWS = ["to_module_r", "to_module_rw", "load_into_module", "live"]


@pytest.mark.parametrize("how", HOWS)
def test_compile_eager_backend_gives_the_same_outputs(saved, how):
    path, want = saved
    model, tree = bound_model(path, how)
    if tree is not None:  # zero-copy: the parameters are plain tensors over the mapped files
        for name, p in model.named_parameters():
            leaf = tree[tuple(name.split("."))]
            assert isinstance(leaf, MemoryMappedTensor) and type(p.data) is torch.Tensor
            assert p.data_ptr() == leaf.data_ptr()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(X), want)


def test_compiled_model_reads_the_mapped_files(saved):
    """Weights written into the files after compiling are what the compiled model computes with."""
    path, _ = saved
    model, tree = bound_model(path, "to_module_rw")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with torch.no_grad():
        compiled(X)
        tree["l2", "weight"][:] = 0
        tree["l2", "bias"][:] = torch.tensor([1.0, 2.0, 3.0])
        assert torch.equal(compiled(X), torch.tensor([[1.0, 2.0, 3.0]]).expand(5, 3))
    assert memtree.load_memmap(path, mode="r")["l2", "bias"].tolist() == [1.0, 2.0, 3.0]


def test_compiled_training_step_on_bound_weights(saved):
    path, _ = saved
    model, tree = bound_model(path, "to_module_rw")
    model.train()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager")
    before = tree["l1", "weight"].clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled(X).square().mean().backward()
    opt.step()
    assert not torch.equal(tree["l1", "weight"], before)  # the step wrote the mapped weights
    on_disk = memtree.load_memmap(path, mode="r")["l1", "weight"]
    assert torch.equal(on_disk, model.l1.weight.detach())


@pytest.mark.parametrize("how", HOWS)
def test_export_gives_the_same_outputs(saved, how):
    path, want = saved
    model, _ = bound_model(path, how)
    exported = torch.export.export(model, (X,))
    with torch.no_grad():
        assert torch.equal(exported.module()(X), want)
    for name, p in model.named_parameters():  # the program holds the module's weights
        assert torch.equal(exported.state_dict[name], p)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("how", ["to_module_r", "load_into_module"])
def test_compile_inductor_gives_the_same_outputs(saved, how):
    path, want = saved
    model, _ = bound_model(path, how)
    torch._dynamo.reset()
    compiled = torch.compile(model)  # the default backend, inductor (C++ on CPU)
    with torch.no_grad():
        torch.testing.assert_close(compiled(X), want)  # inductor fuses: not bit-exact
