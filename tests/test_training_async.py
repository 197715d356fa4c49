"""The snapshot of an async save (``memtree/training/snapshot.py``) holds every tensor's values.

Whatever a state holds (conjugate and negative views, transposed, strided, expanded and
zero-element tensors, 0-dim tensors, views sharing one storage, every dtype of the format),
``save(..., blocking=False)`` writes the same bytes as a blocking save, and both restore the
values ``torch.load(torch.save(state))`` gives, with the same Python containers. On CUDA: the
copies of every device are waited for before the writer reads the staging buffer and before the
buffer is reused.
"""

from __future__ import annotations

import io
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import memtree
from memtree.format.dtypes import DTYPE_NAMES, V3_DTYPE_NAMES, dtype_from_name
from memtree.format.level import Level
from memtree.training.snapshot import StagingBuffer
from test_training import assert_same
from treeutil import random_tensor

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

# torch can neither torch.save nor print (hypothesis reprs its strategies) the dtypes of format
# version 3; the Checkpointer stores them all: tests/test_subclass_format.py
DTYPES = [d for d in map(dtype_from_name, DTYPE_NAMES) if d is not None and str(d)[6:] not in V3_DTYPE_NAMES]


def _negatable(dtype):
    """Whether a negative view of ``dtype`` can be resolved (torch has a negation kernel)."""
    try:
        torch._neg_view(torch.zeros(1, dtype=dtype)).resolve_neg()
    except (RuntimeError, TypeError):
        return False
    return True


NEGATABLE = frozenset(d for d in DTYPES if _negatable(d))


def _flat(t):
    return t.reshape(-1) if t.is_contiguous() else t.flatten()


#: Views of a tensor, each sharing its storage where torch can (else the tensor itself).
VIEWS = {
    "same": lambda t: t,
    "conj": lambda t: t.conj() if t.is_complex() else t,
    "neg": lambda t: torch._neg_view(t) if t.dtype in NEGATABLE else t,
    "transposed": lambda t: t.permute(tuple(reversed(range(t.dim())))),
    "strided": lambda t: t[::2] if t.dim() else t,
    "expanded": lambda t: t.unsqueeze(0).expand(3, *t.shape),
    "head": lambda t: _flat(t)[:-1] if t.is_contiguous() else t,  # overlaps "tail"
    "tail": lambda t: _flat(t)[1:] if t.is_contiguous() else t,
    "element": lambda t: _flat(t)[t.numel() // 2] if t.numel() and t.is_contiguous() else t,  # 0-dim
    "empty": lambda t: t[:0] if t.dim() else t,
}


@st.composite
def _view_groups(draw):
    """A few views (chains of up to 3 of ``VIEWS``) of one random tensor: they share its storage."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    base = random_tensor(shape, dtype, seed=draw(st.integers(0, 2**16)))
    chains = draw(st.lists(st.lists(st.sampled_from(sorted(VIEWS)), min_size=1, max_size=3), min_size=1, max_size=3))
    out = []
    for chain in chains:
        t = base
        for name in chain:
            t = VIEWS[name](t)
        out.append(t)
    return out


_keys = st.one_of(st.text(st.characters(codec="utf-8", exclude_characters="\x00/"), min_size=1, max_size=4), st.integers(-3, 99))


def _unique(d):
    return len({str(k) for k in d}) == len(d)  # 1 and "1" would share a name: refused elsewhere


@st.composite
def _states(draw):
    leaves = [t for group in draw(st.lists(_view_groups(), min_size=1, max_size=3)) for t in group]
    tensors = st.sampled_from(leaves)
    nested = st.recursive(
        st.one_of(tensors, st.integers(0, 10)),
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.lists(children, max_size=3).map(tuple),
            st.dictionaries(_keys, children, max_size=3).filter(_unique),
        ),
        max_leaves=8,
    )
    state = draw(st.dictionaries(_keys, nested, max_size=4).filter(_unique))
    state["all"] = leaves  # every view of every group, at least once
    return state


def _torch_round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _save_both_ways(root, state):
    """(blocking restore, async restore) of ``state``; leaves written in full (no hard links)."""
    ckpt = memtree.Checkpointer(root, incremental=False)
    ckpt.save(0, state)
    ckpt.save(1, state, blocking=False).result(timeout=120)
    return ckpt.restore(0), ckpt.restore(1)


_z = random_tensor((3, 2), torch.complex64, seed=1)
_x = random_tensor((5,), torch.float32, seed=2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(state=_states())
@example(state={"z": _z, "conj": _z.conj()})  # the case: async stored z.conj() as z
@example(state={"x": _x, "neg": torch._neg_view(_x), "conj_of_neg": [torch._neg_view(_z).conj(), _z]})
def test_async_bytes_equal_blocking_bytes_equal_torch_save_values(tmp_path_factory, state):
    want = _torch_round_trip(state)
    blocking, background = _save_both_ways(tmp_path_factory.mktemp("snap"), state)
    assert_same(blocking, want)
    assert_same(background, want)


@pytest.mark.parametrize(
    "first, second",
    [
        ("same", "conj"),
        ("conj", "same"),
        ("same", "neg"),
        ("neg", "conj"),
        ("conj", "conj_of_neg"),
    ],
)
def test_a_tensor_and_another_view_of_its_memory_each_keep_their_values(tmp_path, first, second):
    z = random_tensor((4, 3), torch.complex128, seed=3)
    views = {"same": z, "conj": z.conj(), "neg": torch._neg_view(z), "conj_of_neg": torch._neg_view(z).conj()}
    state = {"a": views[first], "b": views[second]}
    blocking, background = _save_both_ways(tmp_path, state)
    assert_same(blocking, state)
    assert_same(background, state)


def test_tied_weights_are_copied_once_and_both_keys_written(tmp_path):
    w = torch.randn(64, 32)
    state = {"embed": w.detach(), "head": w.detach(), "head_t": w.t()}
    staging = StagingBuffer()
    level = memtree.training.state.state_to_level(state)
    staging.take(level).wait()
    copies = level.entries
    assert copies["embed"] is copies["head"] and copies["head_t"] is not copies["embed"]
    assert staging.buffer.numel() == 2 * w.nbytes  # the tied pair once, the transposed view apart
    blocking, background = _save_both_ways(tmp_path, state)
    assert_same(background, state)
    assert_same(blocking, state)


def test_a_leaf_that_cannot_be_stored_is_refused_before_anything_is_copied(tmp_path):
    staging = StagingBuffer()
    level = Level((), {"a": torch.ones(3), "sub": Level((), {"q": torch.ones(2, 2).to_sparse()})})
    with pytest.raises(memtree.DtypeError, match=r"leaf \('sub', 'q'\): torch.sparse_coo"):
        staging.take(level)
    assert staging.buffer is None and type(level.entries["a"]) is torch.Tensor
    ckpt = memtree.Checkpointer(tmp_path)
    for bad, match in [(torch.empty(2, device="meta"), "meta device"), (torch.ones(2).to_sparse(), "sparse")]:
        with pytest.raises(memtree.DtypeError, match=match):
            ckpt.save(1, {"ok": torch.ones(2), "m": {"bad": bad}}, blocking=False)
    assert ckpt.steps() == []


def _torch_calls(fn):
    """The names of the C functions ``fn`` calls from Python, each with its count."""
    calls = {}

    def count(frame, event, arg):
        if event == "c_call":
            calls[arg.__name__] = calls.get(arg.__name__, 0) + 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_the_pause_copies_every_host_tensor_in_one_call():
    # the training loop waits for take(): its host copies go back to back in one call, with no
    # Python step (a detach, a resolve, a dtype view) per tensor between them
    tensors = {f"t{i}": torch.randn(8, 4) for i in range(64)}
    tensors["conj"] = torch.randn(3, dtype=torch.complex64).conj()
    tensors["strided"] = torch.randn(6, 5)[::2]
    level = Level((), dict(tensors))
    calls = _torch_calls(lambda: StagingBuffer().take(level).wait())
    assert calls.get("_foreach_copy_") == 1
    for per_tensor in ("copy_", "detach", "resolve_conj", "resolve_neg"):
        assert calls.get(per_tensor, 0) == 0, calls
    assert calls.get("view", 0) <= 3, calls  # the buffer as float32 and complex64; the strided leaf
    for key, t in tensors.items():
        copy = level.entries[key]
        assert copy is not t and not copy.is_conj() and copy.is_contiguous()
        assert torch.equal(copy, t.resolve_conj()), key


def test_tensors_the_one_call_cannot_copy_are_copied_one_by_one(monkeypatch):
    def no_kernel(dests, sources):
        raise NotImplementedError("no copy kernel for this dtype")

    monkeypatch.setattr(torch, "_foreach_copy_", no_kernel)
    z = torch.randn(4, dtype=torch.complex64)
    tensors = {"w": torch.randn(3, 2), "conj": z.conj(), "neg": torch._neg_view(torch.randn(5))}
    level = Level((), dict(tensors))
    StagingBuffer().take(level).wait()
    for key, t in tensors.items():
        assert torch.equal(level.entries[key], t.resolve_conj().resolve_neg()), key


def test_dtypes_without_a_copy_kernel_are_left_out_of_the_one_call(monkeypatch):
    seen = []
    original = torch._foreach_copy_

    def recording(dests, sources):
        seen.extend(t.dtype for t in sources)
        return original(dests, sources)

    monkeypatch.setattr(torch, "_foreach_copy_", recording)
    tensors = {"w": torch.randn(3), "q": random_tensor((6,), torch.int4, seed=1), "b": torch.ones(2)}
    level = Level((), dict(tensors))
    StagingBuffer().take(level).wait()
    assert seen == [torch.float32, torch.float32]  # int4 copied as bytes, on its own
    for key, t in tensors.items():
        assert torch.equal(level.entries[key].view(torch.uint8), t.view(torch.uint8)), key


def test_copies_of_parameters_that_require_grad_are_plain_tensors():
    w = torch.nn.Parameter(torch.randn(4, 3))
    level = Level((), {"w": w, "t": w.t()})
    StagingBuffer().take(level).wait()
    for copy in level.entries.values():
        assert not copy.requires_grad and copy.grad_fn is None
    assert torch.equal(level.entries["t"], w.detach().t())


# ---------------------------------------------------------------------------------------------
# CUDA: the fences (skipped without a GPU)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
_SLEEP_CYCLES = 200_000_000  # about 0.1 s of a GPU's time: the copies land well after save returns


@cuda
def test_cuda_conjugate_and_negative_views_are_snapshot_with_their_values(tmp_path):
    z = torch.randn(1 << 20, dtype=torch.complex64, device="cuda")
    x = torch.randn(1 << 20, device="cuda")
    state = {"conj": z.conj(), "neg": torch._neg_view(x), "imag": z.conj().imag, "t": z.view(1024, -1).conj().t()}
    want = {k: v.resolve_conj().resolve_neg().cpu() for k, v in state.items()}
    ckpt = memtree.Checkpointer(tmp_path, incremental=False)
    torch.cuda._sleep(_SLEEP_CYCLES)  # the copies are queued behind it: the host runs ahead
    fut = ckpt.save(1, state, blocking=False)
    fut.result(timeout=120)
    assert_same(ckpt.restore(1), want)


@cuda
def test_the_writer_waits_for_copies_queued_on_the_current_stream(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path, incremental=False)
    w = torch.zeros(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a stream of the caller's, not the default one
        side.wait_stream(torch.cuda.default_stream())
        torch.cuda._sleep(_SLEEP_CYCLES)
        w.fill_(7)  # queued after the sleep; the snapshot's copy after it
        fut = ckpt.save(1, {"w": w}, blocking=False)
    fut.result(timeout=120)
    assert ckpt.restore(1)["w"].eq(7).all()


@cuda
def test_the_buffer_is_reused_only_after_the_previous_copies_landed():
    staging = StagingBuffer()
    w = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(_SLEEP_CYCLES)
    w.fill_(1)
    first = Level((), {"w": w})
    staging.take(first)  # the copy is still queued behind the sleep
    second = Level((), {"w": torch.full((1 << 20,), 2.0)})
    staging.take(second).wait()  # a CPU copy into the same bytes: after the first one landed
    assert staging.buffer.data_ptr() == first.entries["w"].data_ptr() == second.entries["w"].data_ptr()
    assert second.entries["w"].eq(2).all()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_every_device_copied_from_is_fenced(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path, incremental=False)
    tensors = {}
    for d in range(torch.cuda.device_count()):
        with torch.cuda.device(d):
            t = torch.zeros(1 << 20, device=f"cuda:{d}")
            torch.cuda._sleep(_SLEEP_CYCLES)  # on this device's current stream
            t.fill_(d + 1)
            tensors[f"cuda{d}"] = t
    with torch.cuda.device(0):  # the current device is only one of them
        fut = ckpt.save(1, tensors, blocking=False)
    fut.result(timeout=120)
    back = ckpt.restore(1)
    assert all(back[f"cuda{d}"].eq(d + 1).all() for d in range(torch.cuda.device_count()))


def _refuse_pinning(monkeypatch) -> list[int]:
    """Make every pinned allocation fail as a memlock limit does; the sizes asked are listed."""
    asked: list[int] = []
    empty = torch.empty

    def fake_empty(*args, pin_memory=False, **kwargs):
        if pin_memory:
            asked.append(args[0])
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", fake_empty)
    return asked


def test_a_pinned_buffer_refused_falls_back_to_ordinary_memory_with_one_warning(monkeypatch):
    """Before, torch's raw RuntimeError from cudaHostAlloc failed the save."""
    asked = _refuse_pinning(monkeypatch)
    staging = StagingBuffer()
    with pytest.warns(RuntimeWarning, match=r"could not pin 4,096 bytes .*ulimit -l"):
        buf = staging._reserve(4096, pinned=True)
    assert buf.numel() == 4096 and not buf.is_pinned() and asked == [4096]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert staging._reserve(4096, pinned=True) is buf  # reused, not re-pinned each save
        assert staging._reserve(3 * 4096, pinned=True).numel() == 3 * 4096  # grown: no new try
    assert asked == [4096]


@cuda
def test_an_async_save_whose_pinning_fails_writes_the_same_bytes(tmp_path, monkeypatch):
    _refuse_pinning(monkeypatch)
    w = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    ckpt = memtree.Checkpointer(tmp_path, incremental=False)
    with pytest.warns(RuntimeWarning, match="could not pin"):
        fut = ckpt.save(1, {"w": w}, blocking=False)
    w.zero_()
    fut.result(timeout=120)
    assert torch.equal(ckpt.restore(1)["w"], torch.arange(1 << 16, dtype=torch.float32))
