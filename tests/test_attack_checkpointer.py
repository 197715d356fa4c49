"""Attacks on memtree.Checkpointer: unusual orders, unusual state contents, incremental dedup
against a previous step that is damaged, changed or removed, and concurrent savers.

The ordinary behaviour is tested in ``test_training.py``; this file holds what an attacker or a
surprised new user would try.
"""

from __future__ import annotations

import glob
import math
import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree.training import checkpointer as ckpt_module
from test_training import assert_same


@pytest.fixture
def ckpt(tmp_path):
    return memtree.Checkpointer(tmp_path / "ckpt")


def _leaf_file(ckpt, step, key="w"):
    (path,) = glob.glob(os.path.join(ckpt.path(step), f"{key}*.memmap"))
    return path


def _flip_keep_mtime(path, offset=0):
    st_ = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns))  # bit rot: the mtime does not move


# ---------------------------------------------------------------------------------------------
# incremental dedup against hostile or changed previous steps


@pytest.mark.parametrize("blocking", [True, False])
def test_a_damaged_leaf_of_the_previous_step_is_never_linked(ckpt, blocking):
    w = torch.arange(64, dtype=torch.float32)
    ckpt.save(1, {"w": w})
    _flip_keep_mtime(_leaf_file(ckpt, 1), 5)
    out = ckpt.save(2, {"w": w}, blocking=blocking)
    if not blocking:
        out.result()
    assert ckpt.last_stats.files_linked == 0 and ckpt.last_stats.link_fallbacks == 1
    assert not os.path.samefile(_leaf_file(ckpt, 1), _leaf_file(ckpt, 2))
    assert torch.equal(memtree.load_memmap(ckpt.path(2), verify=True)["w"], w)


@pytest.mark.parametrize(
    "old, new",
    [
        (torch.zeros(4, dtype=torch.float32), torch.zeros(4, dtype=torch.int32)),  # dtype, same bytes
        (torch.zeros(4, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32)),  # shape, same bytes
        (torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.bool)),
    ],
)
def test_equal_bytes_with_another_dtype_or_shape_are_written_not_linked(ckpt, old, new):
    ckpt.save(1, {"w": old})
    ckpt.save(2, {"w": new})
    assert ckpt.last_stats.files_linked == 0
    got = ckpt.restore(2)["w"]
    assert (got.dtype, got.shape) == (new.dtype, new.shape) and torch.equal(got, new)


def test_a_leaf_changed_back_to_an_older_value_is_correct(ckpt):
    a, b = torch.zeros(16), torch.ones(16)
    ckpt.save(1, {"w": a})
    ckpt.save(2, {"w": b})
    ckpt.save(3, {"w": a})  # links against step 2 only: written
    assert ckpt.last_stats.files_linked == 0
    for step, want in ((1, a), (2, b), (3, a)):
        assert torch.equal(ckpt.restore(step)["w"], want)


def test_the_previous_step_deleted_by_the_user_mid_save(ckpt, monkeypatch):
    """The link source disappears between choosing it and linking: the leaf is written."""
    import shutil

    from memtree.store.writing import linking

    w = torch.arange(32.0)
    ckpt.save(1, {"w": w})
    real = linking.LinkSource.link

    def link_after_rmtree(self, *args, **kwargs):
        shutil.rmtree(ckpt.path(1), ignore_errors=True)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(linking.LinkSource, "link", link_after_rmtree)
    ckpt.save(2, {"w": w})
    assert ckpt.steps() == [2]
    assert torch.equal(memtree.load_memmap(ckpt.path(2), verify=True)["w"], w)


def test_a_leaf_of_the_previous_step_replaced_by_a_symlink_or_fifo_is_not_followed(ckpt, tmp_path):
    secret = tmp_path / "secret.bin"
    w = torch.arange(16, dtype=torch.float32)
    secret.write_bytes(w.numpy().tobytes())
    ckpt.save(1, {"w": w, "v": w.clone()})
    target = _leaf_file(ckpt, 1, "w")
    os.unlink(target)
    os.symlink(secret, target)
    fifo = _leaf_file(ckpt, 1, "v")
    os.unlink(fifo)
    os.mkfifo(fifo)
    ckpt.save(2, {"w": w, "v": w.clone()})  # must not hang on the FIFO, nor link the symlink
    assert ckpt.last_stats.files_linked == 0
    for key in ("w", "v"):
        assert not os.path.islink(_leaf_file(ckpt, 2, key))
        assert os.stat(_leaf_file(ckpt, 2, key)).st_nlink == 1
    assert torch.equal(memtree.load_memmap(ckpt.path(2), verify=True)["w"], w)


# ---------------------------------------------------------------------------------------------
# unusual orders


def test_restore_before_any_save_and_of_a_deleted_step(ckpt):
    with pytest.raises(memtree.CheckpointNotFoundError):
        ckpt.restore()
    ckpt.save(1, {"w": torch.ones(1)})
    ckpt.save(2, {"w": torch.ones(1)})
    import shutil

    shutil.rmtree(ckpt.path(2))
    with pytest.raises(memtree.CheckpointNotFoundError, match="step 2"):
        ckpt.restore(2)
    assert ckpt.latest() == 1 and torch.equal(ckpt.restore()["w"], torch.ones(1))


def test_save_after_restore_keeps_the_restored_tensors_independent(ckpt):
    ckpt.save(1, {"w": torch.zeros(8)})
    state = ckpt.restore()
    state["w"] += 5  # training updates the restored tensors in place
    ckpt.save(2, state, blocking=False).result()
    assert torch.equal(ckpt.restore(1)["w"], torch.zeros(8))
    assert torch.equal(ckpt.restore(2)["w"], torch.full((8,), 5.0))


def test_saves_from_several_threads_on_one_checkpointer(ckpt):
    errors = []

    def worker(i):
        try:
            out = ckpt.save(i, {"w": torch.full((4096,), float(i))}, blocking=bool(i % 2))
            if not isinstance(out, str):
                out.result()
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ckpt.wait()
    assert errors == [] and ckpt.steps() == list(range(8))
    for i in range(8):
        assert torch.equal(memtree.load_memmap(ckpt.path(i), verify=True)["w"], torch.full((4096,), float(i)))


def test_a_root_through_a_symlink(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "link")
    ckpt = memtree.Checkpointer(tmp_path / "link", keep_last=1)
    ckpt.save(1, {"w": torch.ones(2)})
    ckpt.save(2, {"w": torch.ones(2)})
    assert os.listdir(real) == ["2"] or sorted(os.listdir(real))[0] == "2"
    assert memtree.Checkpointer(real).steps() == [2]


# ---------------------------------------------------------------------------------------------
# state contents


def test_views_expanded_and_shared_tensors_round_trip(ckpt):
    base = torch.arange(24.0)
    state = {
        "base": base,
        "view": base[3:9],
        "strided": base[::3],
        "t": base.view(4, 6).t(),
        "expanded": torch.ones(1, 3).expand(5, 3),
        "again": base,
        "param": torch.nn.Parameter(torch.ones(3)),
        "grad": torch.ones(3, requires_grad=True) * 2,
    }
    want = {k: v.detach().clone() for k, v in state.items()}
    fut = ckpt.save(1, state, blocking=False)
    base.add_(100)  # the loop changes the tensor right after save returns
    fut.result()
    got = ckpt.restore()
    for k, v in want.items():
        assert type(got[k]) is torch.Tensor and not got[k].requires_grad, k
        assert_same(got[k], v, k)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 2**64, -(2**63) - 1, {1, 2}, object()])
def test_values_json_would_change_are_refused_and_nothing_is_written(ckpt, value):
    with pytest.raises(memtree.NonTensorValueError, match=r"state\[.x.\]\[.y.\]") as excinfo:
        ckpt.save(1, {"x": {"y": value}, "w": torch.ones(1)})
    assert ckpt.steps() == [] and os.listdir(ckpt.root) == []
    assert "allow_pickle" not in str(excinfo.value)


def test_a_tensortree_in_an_async_save_is_left_alone(ckpt):
    tree = memtree.TensorTree({"x": torch.ones(3), "sub": {"y": torch.zeros(2)}})
    x, y = tree["x"], tree["sub", "y"]
    ckpt.save(1, {"tree": tree}, blocking=False).result()
    ckpt.save(2, {"other": torch.full((64,), 7.0)}, blocking=False).result()  # reuses the buffer
    assert tree["x"] is x and tree["sub", "y"] is y
    assert torch.equal(tree["x"], torch.ones(3)) and torch.equal(ckpt.restore(1)["tree"]["x"], torch.ones(3))


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8),
)
keys = st.one_of(st.integers(0, 2**40), st.text(min_size=1, max_size=6).filter(lambda k: not k.isdigit()))
tensors = st.builds(
    lambda n, dt: torch.arange(n).to(dt), st.integers(0, 5), st.sampled_from([torch.float32, torch.int64, torch.bool])
)
states = st.recursive(
    st.one_of(json_scalars, tensors),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(keys, inner, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(state=st.dictionaries(keys, states, max_size=4), blocking=st.booleans())
def test_any_state_with_int_and_str_keys_round_trips(tmp_path_factory, state, blocking):
    ckpt = memtree.Checkpointer(tmp_path_factory.mktemp("c"))
    out = ckpt.save(0, state, blocking=blocking)
    if not blocking:
        out.result()
    assert_same(ckpt.restore(), state)


def test_restore_into_a_model_with_tied_weights_and_an_optimizer_built_after(ckpt):
    def build():
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 4)
        head = torch.nn.Linear(4, 10, bias=False)
        head.weight = emb.weight
        return torch.nn.ModuleDict({"emb": emb, "head": head})

    model = build()
    with torch.no_grad():
        model["emb"].weight.mul_(3)
    ckpt.save(1, {"model": model.state_dict()})
    fresh = build()
    ckpt.restore(into={"model": fresh})
    assert fresh["head"].weight is fresh["emb"].weight
    assert torch.equal(fresh["emb"].weight, model["emb"].weight)
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    assert len(opt.param_groups[0]["params"]) == 1  # the tie survived: one parameter
