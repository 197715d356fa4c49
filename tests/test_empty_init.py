"""``empty_init``: meta parameters, no initialiser runs, nesting, exceptions, threads, fresh processes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from memtree import empty_init, init_missing
from memtree.nn import empty_init as empty_init_module
from memtree.nn.empty_init import INIT_FUNCTIONS

REPO = Path(__file__).resolve().parent.parent


def _originals() -> dict[str, Any]:
    """Everything empty_init patches, as it is now."""
    found = {f"init.{n}": getattr(nn.init, n) for n in INIT_FUNCTIONS}
    found["register_parameter"] = nn.Module.register_parameter
    found["register_buffer"] = nn.Module.register_buffer
    return found


class Counting(nn.Module):
    """Initialises with several torch.nn.init functions; counts the calls that reach torch."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 3))
        self.e = nn.Parameter(torch.empty(5, 2))
        self.register_buffer("stat", torch.empty(3))
        self.register_buffer("freqs", torch.arange(4.0) * 2, persistent=False)
        nn.init.kaiming_uniform_(self.w)
        nn.init.normal_(self.e)
        nn.init.trunc_normal_(self.e)
        nn.init.zeros_(self.stat)


def test_parameters_and_persistent_buffers_are_meta_and_non_persistent_ones_computed() -> None:
    before = _originals()
    with empty_init():
        m = Counting()
        emb = nn.Embedding(10, 4, padding_idx=0)
        lin = nn.Linear(3, 2)
    assert _originals() == before
    assert all(t.is_meta for t in (m.w, m.e, m.stat, emb.weight, lin.weight, lin.bias))
    assert type(m.w) is nn.Parameter and m.w.requires_grad
    assert torch.equal(m.freqs, torch.arange(4.0) * 2)  # kept as the constructor computed it


def test_no_initialiser_runs_on_meta_tensors_but_does_on_real_ones(monkeypatch) -> None:
    calls: list[str] = []
    for name in ("normal_", "kaiming_uniform_", "trunc_normal_", "zeros_"):
        real = getattr(nn.init, name)
        monkeypatch.setattr(nn.init, name, lambda t, *a, _n=name, _r=real, **k: (calls.append(_n), _r(t, *a, **k))[1])
    with empty_init():
        m = Counting()
        assert calls == []  # every initialiser call was skipped: the tensors are meta
        real = torch.empty(3)
        assert nn.init.zeros_(real) is real and calls == ["zeros_"] and torch.equal(real, torch.zeros(3))
    calls.clear()
    Counting()  # outside: the initialisers run again
    assert calls == ["kaiming_uniform_", "normal_", "trunc_normal_", "zeros_"]
    assert m.w.is_meta


def test_nested_contexts_restore_only_at_the_outermost_exit() -> None:
    before = _originals()
    with empty_init():
        patched = _originals()
        assert patched != before
        with empty_init():
            inner = nn.Linear(2, 2)
            assert _originals() == patched
        assert _originals() == patched  # still inside the outer one
        outer = nn.Linear(2, 2)
    assert _originals() == before
    assert inner.weight.is_meta and outer.weight.is_meta
    assert not nn.Linear(2, 2).weight.is_meta


def test_an_exception_inside_restores_everything() -> None:
    before = _originals()
    with pytest.raises(ZeroDivisionError):
        with empty_init():
            with empty_init():
                nn.Linear(2, 2)
                1 / 0
    assert _originals() == before
    assert empty_init_module._active_contexts == 0 and empty_init_module._patches == []
    assert not nn.Embedding(3, 2).weight.is_meta
    with pytest.raises(RuntimeError, match="boom"):  # a failing constructor too
        with empty_init():

            class Failing(nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.w = nn.Parameter(torch.zeros(2))
                    raise RuntimeError("boom")

            Failing()
    assert _originals() == before


def test_a_patch_laid_over_ours_meanwhile_is_left_in_place(monkeypatch) -> None:
    before = nn.init.normal_
    with empty_init():
        theirs = nn.init.normal_

        def over(t: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            return theirs(t, *a, **k)

        monkeypatch.setattr(nn.init, "normal_", over)
    assert nn.init.normal_ is over  # not clobbered with our saved original
    t = torch.empty(1000)
    nn.init.normal_(t)  # ours under theirs passes the call through outside the context
    assert 0.5 < float(t.std()) < 1.5
    monkeypatch.undo()  # theirs restores what it found: ours, which only passes calls through
    assert nn.init.normal_.__wrapped__ is before
    nn.init.normal_ = before


def test_other_threads_build_normally_while_one_thread_is_inside() -> None:
    inside, done = threading.Event(), threading.Event()
    built: dict[str, nn.Module] = {}

    def meta_builder() -> None:
        with empty_init():
            inside.set()
            assert done.wait(60)
            built["meta"] = nn.Embedding(4, 3)

    thread = threading.Thread(target=meta_builder)
    thread.start()
    assert inside.wait(60)
    try:
        torch.manual_seed(0)
        built["real"] = nn.Embedding(4, 3)  # this thread is not inside: real, initialised
    finally:
        done.set()
        thread.join(60)
    assert not thread.is_alive()
    assert built["meta"].weight.is_meta
    assert not built["real"].weight.is_meta and float(built["real"].weight.detach().abs().sum()) > 0


def test_many_threads_entering_and_leaving_in_any_order_leave_nothing_patched() -> None:
    before = _originals()
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            barrier.wait(60)
            for _ in range(20):
                with empty_init():
                    m = nn.Linear(3, 3)
                    assert m.weight.is_meta
                    if i % 2:
                        with empty_init():
                            assert nn.LayerNorm(3).weight.is_meta
                assert not nn.Linear(2, 2).weight.is_meta  # this thread left: real again
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert _originals() == before and empty_init_module._active_contexts == 0


def test_init_missing_after_empty_init_initialises_with_the_real_functions() -> None:
    with empty_init():
        m = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3))
        assert init_missing(m) == ["0.weight", "1.weight", "1.bias"]  # works inside the context too
    assert float(m[0].weight.detach().std()) > 0.1 and float(m[1].weight.detach().abs().sum()) > 0


def test_transformers_models_skip_their_own_initialisation(monkeypatch) -> None:
    tf = pytest.importorskip("transformers")
    from transformers import initialization as hf_init

    calls: list[str] = []
    real = hf_init.TORCH_INIT_FUNCTIONS["normal_"]
    monkeypatch.setitem(hf_init.TORCH_INIT_FUNCTIONS, "normal_", lambda t, *a, **k: (calls.append("n"), real(t, *a, **k))[1])
    cfg = tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    with empty_init():
        model = tf.GPT2LMHeadModel(cfg)
    assert calls == [] and all(p.is_meta for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    tf.GPT2LMHeadModel(cfg)
    assert calls  # restored: a normal build initialises again


def test_a_fresh_process_never_imports_dynamo(tmp_path) -> None:
    """The meta kernel of normal_ (nn.Embedding's init) imports torch._dynamo: about a second."""
    script = (
        "import sys, torch, memtree\n"
        "from torch import nn\n"
        "with memtree.empty_init():\n"
        "    m = nn.Sequential(nn.Embedding(1000, 64), nn.Linear(64, 64), nn.LayerNorm(64),\n"
        "                      nn.MultiheadAttention(64, 4), nn.Conv2d(3, 8, 3), nn.LSTM(8, 8))\n"
        "assert all(p.is_meta for p in m.parameters())\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no dynamo", out.stdout + out.stderr
