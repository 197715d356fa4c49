"""Attacks on memtree.Checkpointer: unusual orders, unusual state contents, incremental dedup
against a previous step that is damaged, changed or removed, and concurrent savers; by class:
retention orders (saves below the newest step, the step just written, steps open lazily), the
step rule (entries named like steps that are not: one rule for steps(), ``memtree info`` and
``memtree du``), failed retention (hostile lock files: a warning, never a failed or poisoned
save), and encrypted roots (no key, another key, a key added later, steps copied or renamed to
another number or root, hostile root records).

The ordinary behaviour is tested in ``test_training.py``; this file holds what an attacker or a
surprised new user would try.
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import threading
import warnings

import orjson
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree.training import commit as commit_module  # a Checkpointer's steps go through its write_tree
from test_training import assert_same
from treeutil import flip_bit, snapshot


@pytest.fixture
def ckpt(tmp_path):
    return memtree.Checkpointer(tmp_path / "ckpt")


def _leaf_file(ckpt, step, key="w"):
    (path,) = glob.glob(os.path.join(ckpt.path(step), f"{key}*.memmap"))
    return path


# ---------------------------------------------------------------------------------------------
# incremental dedup against hostile or changed previous steps


@pytest.mark.parametrize("blocking", [True, False])
def test_a_damaged_leaf_of_the_previous_step_is_never_linked(ckpt, blocking):
    w = torch.arange(64, dtype=torch.float32)
    ckpt.save(1, {"w": w})
    flip_bit(_leaf_file(ckpt, 1), 5)
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
    """Threads save steps 0..7 in any order: each save commits, or is refused because a newer
    step is committed already (StepOrderError, nothing written); what is committed is exact."""
    refused, errors = [], []

    def worker(i):
        try:
            out = ckpt.save(i, {"w": torch.full((4096,), float(i))}, blocking=bool(i % 2))
            if not isinstance(out, str):
                out.result()
        except memtree.StepOrderError as err:
            refused.append((i, str(err)))
        except Exception as err:  # noqa: BLE001 - collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ckpt.wait()
    steps = ckpt.steps()
    assert errors == [] and 7 in steps and sorted(steps + [i for i, _ in refused]) == list(range(8))
    for i, message in refused:
        assert f"step {i} is below the newest step" in message and "Nothing was written" in message
    for i in steps:
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


# ---------------------------------------------------------------------------------------------
# retention orders: a save below latest(), the step just written, a step open lazily


def _w(step):
    return {"model": {"w": torch.full((64,), float(step))}, "step": step}


@pytest.mark.parametrize("blocking", [True, False])
def test_a_roll_back_save_is_refused_naming_the_newer_steps_until_discard_newer(tmp_path, blocking):
    """The issue's order: steps 40 and 50, roll back to 40, save 41 (keep_last=1). The save is
    refused, nothing written; with discard_newer=True 50 goes first, 41 is kept and restored."""
    ckpt = memtree.Checkpointer(tmp_path, keep_last=1)
    ckpt.save(40, _w(40))
    ckpt.save(50, _w(50))
    assert ckpt.steps() == [50]
    before = snapshot(tmp_path)
    with pytest.raises(memtree.StepOrderError, match=r"step 41 is below the newest step .*, 50 .*\[50\].*discard_newer=True") as info:
        ckpt.save(41, _w(41), blocking=blocking)
    assert isinstance(info.value, ValueError) and snapshot(tmp_path) == before
    assert_same(ckpt.restore(), _w(50))
    out = ckpt.save(41, _w(41), blocking=blocking, discard_newer=True)
    assert (out if blocking else out.result(timeout=60)) == ckpt.path(41)
    assert ckpt.steps() == [41] and ckpt.latest() == 41
    assert_same(ckpt.restore(), _w(41))


def test_discard_newer_removes_every_newer_step_milestones_included_and_only_those(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path, keep_last=2, keep_every=10)
    for step in (5, 10, 20, 21, 22):
        ckpt.save(step, _w(step))
    assert ckpt.steps() == [10, 20, 21, 22]
    with pytest.raises(memtree.NonTensorValueError):  # input errors first: nothing is deleted
        ckpt.save(11, {"x": math.nan}, discard_newer=True)
    assert ckpt.steps()[-3:] == [20, 21, 22]
    ckpt.save(11, _w(11), discard_newer=True)
    assert ckpt.steps() == [10, 11]  # 20 (a milestone), 21, 22 rolled back; 11 and 10 kept
    assert_same(ckpt.restore(10), _w(10))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    keep_last=st.one_of(st.none(), st.integers(1, 3)),
    keep_every=st.one_of(st.none(), st.integers(2, 4)),
    ops=st.lists(st.tuples(st.integers(0, 9), st.booleans(), st.booleans()), min_size=1, max_size=7),
)
def test_retention_orders_follow_the_rule(tmp_path_factory, keep_last, keep_every, ops):
    """Any order of saves (step, discard_newer, overwrite) against a model of the rule: a save
    below the newest is refused unless discard_newer; retention keeps the newest keep_last, the
    multiples of keep_every, the newest and the step just written; every listed step restores
    the state last saved as it."""
    ckpt = memtree.Checkpointer(tmp_path_factory.mktemp("r"), keep_last=keep_last, keep_every=keep_every)
    model: dict[int, int] = {}  # step -> the save (index) it holds
    for i, (step, discard, overwrite) in enumerate(ops):
        state = {"w": torch.full((4,), float(i)), "i": i}
        newer = [s for s in model if s > step]
        if newer and not discard:
            with pytest.raises(memtree.StepOrderError):
                ckpt.save(step, state, overwrite=overwrite)
            continue
        if step in model and not overwrite:
            with pytest.raises(memtree.DestinationExistsError):
                ckpt.save(step, state, discard_newer=discard)  # refused before anything is discarded
            continue
        assert ckpt.save(step, state, overwrite=overwrite, discard_newer=discard) == ckpt.path(step)
        for s in newer:
            del model[s]
        model[step] = i
        if keep_last is not None:
            ranked = sorted(model)
            keep = set(ranked[-keep_last:]) | {step, ranked[-1]}
            keep |= {s for s in ranked if keep_every and s % keep_every == 0}
            model = {s: v for s, v in model.items() if s in keep}
        assert ckpt.steps() == sorted(model), (i, step)
    for step, i in model.items():
        assert_same(ckpt.restore(step), {"w": torch.full((4,), float(i)), "i": i})


def test_retention_never_deletes_the_step_just_written(tmp_path, monkeypatch):
    """Another writer commits a newer step while this one writes step 5 (keep_last=1): the
    retention pass of step 5 keeps it (and the newest); save() returns a path that exists."""
    ckpt = memtree.Checkpointer(tmp_path, keep_last=1)
    other = memtree.Checkpointer(tmp_path)
    real = commit_module.write_tree

    def write_then_other_commits(path, *args, **kwargs):
        out = real(path, *args, **kwargs)
        if path == ckpt.path(5):
            monkeypatch.setattr(commit_module, "write_tree", real)
            other.save(9, _w(9))
        return out

    monkeypatch.setattr(commit_module, "write_tree", write_then_other_commits)
    assert ckpt.save(5, _w(5)) == ckpt.path(5)
    assert ckpt.steps() == [5, 9]
    assert_same(ckpt.restore(5), _w(5))


@pytest.mark.parametrize("mmap", [True, False])
def test_a_step_this_process_has_open_lazily_stays_readable_after_retention(tmp_path, mmap):
    ckpt = memtree.Checkpointer(tmp_path, keep_last=1)
    state = {"model": {"enc": {"w": torch.arange(32.0)}, "head": {"b": torch.ones(3)}}, "step": 1}
    ckpt.save(1, state)
    tree = memtree.load_memmap(ckpt.path(1), mmap=mmap, mode="r")  # levels load on first use
    ckpt.save(2, _w(2))
    assert ckpt.steps() == [2] and not os.path.exists(ckpt.path(1))
    assert torch.equal(tree["model", "enc", "w"], torch.arange(32.0))
    assert torch.equal(tree["model", "head", "b"], torch.ones(3))


# ---------------------------------------------------------------------------------------------
# the step rule: one rule for Checkpointer.steps(), memtree info and memtree du


def _plant(root, name, kind, outside):
    """An entry ``root/name`` that is not a step, of the given kind."""
    path = os.path.join(root, name)
    real = memtree.Checkpointer(outside).path(1)  # a complete tree, outside the root
    if not os.path.exists(real):
        memtree.Checkpointer(outside).save(1, _w(1))
    if kind == "empty_dir":
        os.mkdir(path)
    elif kind in ("empty_meta", "garbage_meta", "truncated_meta", "foreign_meta"):
        os.mkdir(path)
        with open(os.path.join(real, "meta.json"), "rb") as f:
            good = f.read()
        data = {"empty_meta": b"", "garbage_meta": b"\x00\xff{{", "truncated_meta": good[: len(good) // 2],
                "foreign_meta": b'{"shape": [], "device": null, "_type": "TensorDict"}'}[kind]
        with open(os.path.join(path, "meta.json"), "wb") as f:
            f.write(data)
    elif kind == "fifo_meta":
        os.mkdir(path)
        os.mkfifo(os.path.join(path, "meta.json"))
    elif kind == "symlink_meta":
        os.mkdir(path)
        os.symlink(os.path.join(real, "meta.json"), os.path.join(path, "meta.json"))
    elif kind == "dir_meta":
        os.makedirs(os.path.join(path, "meta.json"))
    elif kind == "symlink_out":
        os.symlink(real, path)
    elif kind == "symlink_in":
        os.symlink(os.path.join(root, "1"), path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "file":
        with open(path, "wb") as f:
            f.write(b"{}")
    return path


def _entry(root, name):
    """``snapshot`` of one entry of ``root`` (and what is below it)."""
    return {k: v for k, v in snapshot(root).items() if k == name or k.startswith(name + os.sep)}


STRAYS = ["empty_dir", "empty_meta", "garbage_meta", "truncated_meta", "foreign_meta", "fifo_meta",
          "symlink_meta", "dir_meta", "symlink_out", "symlink_in", "fifo", "file"]


@pytest.mark.parametrize("kind", STRAYS)
def test_an_entry_named_like_a_step_that_is_not_one_is_ignored_by_every_reader(tmp_path, kind):
    """A stray ``7`` above the real steps: not a step for steps(), restore(), retention, save's
    order rule, ``memtree info`` or ``memtree du`` (on main, one such directory made every save
    with keep_last=1 delete itself and restore() fail); retention never touches it."""
    from memtree.cli.du import disk_usage
    from memtree.cli.info import describe_root

    root = str(tmp_path / "root")
    ckpt = memtree.Checkpointer(root, keep_last=1)
    ckpt.save(1, _w(1))
    stray = _plant(root, "7", kind, str(tmp_path / "outside"))
    stray_before = _entry(root, "7")
    assert ckpt.save(2, _w(2)) == ckpt.path(2)
    assert ckpt.steps() == [2] and ckpt.latest() == 2
    assert_same(ckpt.restore(), _w(2))
    info = describe_root(root)
    assert [s["step"] for s in info["steps"]] == [2] and info["latest"] == 2
    assert [i["name"] for i in info["ignored"]] == ["7"] and info["ignored"][0]["reason"]
    assert [s.name for s in disk_usage(root).steps] == ["2"]
    assert disk_usage(root).apparent_bytes == disk_usage(ckpt.path(2)).apparent_bytes  # nothing of 7 counted
    assert _entry(root, "7") == stray_before  # never deleted, followed, or written
    with pytest.raises(memtree.StepOrderError, match="newest step .*, 2 "):
        ckpt.save(1, _w(1))  # 7 is not a newer step, 2 is


@pytest.mark.parametrize("overwrite", [False, True])
def test_saving_onto_an_entry_that_is_not_a_step_is_refused_and_it_is_left_alone(tmp_path, overwrite):
    root = str(tmp_path / "root")
    ckpt = memtree.Checkpointer(root)
    ckpt.save(1, _w(1))
    for kind in ("empty_meta", "symlink_out"):
        stray = _plant(root, "7", kind, str(tmp_path / "outside"))
        before = snapshot(tmp_path)
        with pytest.raises(memtree.DestinationExistsError, match=r"/7 exists but is not a step \(.*never replaces it"):
            ckpt.save(7, _w(7), overwrite=overwrite)
        assert snapshot(tmp_path) == before
        if os.path.islink(stray):
            os.unlink(stray)
        else:
            shutil.rmtree(stray)


def test_a_complete_staging_directory_is_not_a_step_and_opening_the_root_removes_it(tmp_path):
    ckpt = memtree.Checkpointer(tmp_path)
    ckpt.save(1, _w(1))
    staging = os.path.join(tmp_path, ".3.memtree-tmp-" + "ab" * 16)
    shutil.copytree(ckpt.path(1), staging)  # a writer killed right before its rename
    assert ckpt.steps() == [1]
    memtree.Checkpointer(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["1"]


# ---------------------------------------------------------------------------------------------
# failed retention: the step is committed, the save succeeds, later saves are not poisoned


def _plant_lock(root, step, kind, outside):
    lock = os.path.join(root, f".{step}.memtree.lock")
    victim = os.path.join(outside, "victim")
    os.makedirs(outside, exist_ok=True)
    with open(victim, "wb") as f:
        f.write(b"keep me")
    {"symlink": lambda: os.symlink(victim, lock), "fifo": lambda: os.mkfifo(lock),
     "directory": lambda: os.mkdir(lock), "hardlink": lambda: os.link(victim, lock)}[kind]()
    return lock, victim


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "hardlink"])
def test_a_retention_that_cannot_delete_a_step_warns_and_the_save_succeeds(tmp_path, kind, blocking):
    root = str(tmp_path / "root")
    ckpt = memtree.Checkpointer(root, keep_last=1)
    ckpt.save(1, _w(1))
    lock, victim = _plant_lock(root, 1, kind, str(tmp_path / "outside"))
    for step in (2, 3):  # not poisoned: every later save commits and returns its path too
        with pytest.warns(memtree.RetentionWarning, match=rf"step {step} was saved and committed to .*/{step}, but retention could not delete \[1\] .*step 1: .*\.1\.memtree\.lock"):
            out = ckpt.save(step, _w(step), blocking=blocking)
            assert (out if blocking else out.result(timeout=60)) == ckpt.path(step)
        ckpt.wait()  # nothing to report: the save succeeded
        assert ckpt.steps() == [1, step]
        assert_same(ckpt.restore(), _w(step))
    with open(victim, "rb") as f:
        assert f.read() == b"keep me"  # never written through the planted name
    (shutil.rmtree if kind == "directory" else os.unlink)(lock)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memtree.RetentionWarning)
        ckpt.save(4, _w(4))
    assert ckpt.steps() == [4]


def test_wait_says_whether_a_failed_background_save_was_committed(ckpt, monkeypatch):
    real = commit_module.write_tree

    def fail_after(*args, **kwargs):
        real(*args, **kwargs)
        raise memtree.StorageError("injected after the commit")

    monkeypatch.setattr(commit_module, "write_tree", fail_after)
    fut = ckpt.save(1, _w(1), blocking=False)
    with pytest.raises(memtree.StorageError):
        fut.result(timeout=60)
    with pytest.raises(memtree.CheckpointSaveError, match=r"step 1 .*injected after the commit; step 1 was committed \(.*/1\)"):
        ckpt.wait()
    assert ckpt.steps() == [1]

    def fail_before(*args, **kwargs):
        raise memtree.StorageError("injected before the commit")

    monkeypatch.setattr(commit_module, "write_tree", fail_before)
    ckpt.save(2, _w(2), blocking=False)
    with pytest.raises(memtree.CheckpointSaveError, match="injected before the commit; nothing of step 2 was committed"):
        ckpt.wait()
    assert ckpt.steps() == [1]


def test_a_discard_that_cannot_delete_a_newer_step_writes_nothing(tmp_path):
    root = str(tmp_path / "root")
    ckpt = memtree.Checkpointer(root)
    for step in (1, 5, 6):
        ckpt.save(step, _w(step))
    _plant_lock(root, 5, "symlink", str(tmp_path / "outside"))
    with pytest.raises(memtree.CheckpointSaveError, match=r"step 5 of .* could not be deleted: .*\(steps deleted already: \[6\]\)\. Nothing of step 3 was written"):
        ckpt.save(3, _w(3), discard_newer=True)
    assert ckpt.steps() == [1, 5] and not os.path.exists(ckpt.path(3))


# ---------------------------------------------------------------------------------------------
# encrypted roots: misuse, and steps rolled back by copying or renaming them


@pytest.fixture
def key():
    pytest.importorskip("cryptography")
    return memtree.EncryptionKey.generate()


@pytest.mark.parametrize("opener", ["no key", "another key"])
def test_an_encrypted_root_refuses_a_checkpointer_without_its_key_before_any_write(tmp_path, key, opener):
    memtree.Checkpointer(tmp_path, keep_last=1, encryption=key).save(1, _w(1))
    before = snapshot(tmp_path)
    other = None if opener == "no key" else memtree.EncryptionKey.generate()
    with pytest.raises(memtree.DecryptionError, match="Pass the key"):
        memtree.Checkpointer(tmp_path, keep_last=1, encryption=other)
    assert snapshot(tmp_path) == before  # no plain step, no step of another key, none deleted
    assert_same(memtree.Checkpointer(tmp_path, encryption=key).restore(), _w(1))


def test_a_key_added_later_to_a_plain_root_is_refused(tmp_path, key):
    memtree.Checkpointer(tmp_path).save(1, _w(1))
    with pytest.raises(memtree.DecryptionError, match=r"plain \(unencrypted\) steps \[1\]"):
        memtree.Checkpointer(tmp_path, encryption=key)
    assert os.listdir(tmp_path) == ["1"]


def test_an_empty_root_opened_plain_then_encrypted_refuses_the_plain_writer(tmp_path, key):
    plain = memtree.Checkpointer(tmp_path)
    memtree.Checkpointer(tmp_path, encryption=key).save(1, _w(1))
    with pytest.raises(memtree.DecryptionError, match="has become encrypted.*nothing was written"):
        plain.save(2, _w(2))
    assert sorted(os.listdir(tmp_path)) == [".memtree-root.json", "1"]


@pytest.mark.parametrize("how", ["copy", "rename"])
def test_an_older_encrypted_step_copied_or_renamed_to_a_newer_number_is_refused(tmp_path, key, how):
    ckpt = memtree.Checkpointer(tmp_path, encryption=key)
    ckpt.save(1, _w(1))
    ckpt.save(2, _w(2))
    (shutil.copytree if how == "copy" else os.rename)(ckpt.path(1), ckpt.path(3))  # no key needed
    assert ckpt.latest() == 3
    for verify in (True, False):
        with pytest.raises(memtree.DecryptionError, match="not authenticated as step 3 of this root"):
            ckpt.restore(verify=verify)
    assert_same(ckpt.restore(2), _w(2))
    if how == "copy":
        assert_same(ckpt.restore(1), _w(1))


def test_an_encrypted_step_copied_from_another_root_of_the_same_key_is_refused(tmp_path, key):
    a = memtree.Checkpointer(tmp_path / "a", encryption=key)
    b = memtree.Checkpointer(tmp_path / "b", encryption=key)
    a.save(1, _w(1))
    b.save(1, {"model": {"w": torch.zeros(64)}, "step": 1})
    shutil.copytree(b.path(1), a.path(2))
    with pytest.raises(memtree.DecryptionError, match="another step number or another root"):
        a.restore()


def test_a_whole_encrypted_root_moved_or_copied_restores_every_step(tmp_path, key):
    ckpt = memtree.Checkpointer(tmp_path / "a", encryption=key)
    ckpt.save(1, _w(1))
    ckpt.save(2, _w(2))
    os.rename(tmp_path / "a", tmp_path / "moved")
    shutil.copytree(tmp_path / "moved", tmp_path / "copy")
    for where in ("moved", "copy"):
        again = memtree.Checkpointer(tmp_path / where, encryption=key)
        assert_same(again.restore(1), _w(1))
        assert_same(again.restore(), _w(2))
        again.save(3, _w(3))
        assert_same(again.restore(), _w(3))


@pytest.mark.parametrize(
    "kind, error",
    [("symlink", memtree.UnsafePathError), ("fifo", memtree.UnsafePathError), ("directory", memtree.UnsafePathError),
     ("garbage", memtree.MetaFormatError), ("newer", memtree.UnsupportedVersionError),
     ("extra_field", memtree.MetaFormatError), ("huge", memtree.MetaFormatError), ("deleted", memtree.DecryptionError)],
)
def test_a_hostile_root_record_is_refused_clearly(tmp_path, key, kind, error):
    root = tmp_path / "root"
    memtree.Checkpointer(root, encryption=key).save(1, _w(1))
    record = root / ".memtree-root.json"
    good = record.read_bytes()
    record.unlink()
    if kind == "symlink":
        (tmp_path / "elsewhere.json").write_bytes(good)
        os.symlink(tmp_path / "elsewhere.json", record)
    elif kind == "fifo":
        os.mkfifo(record)
    elif kind == "directory":
        record.mkdir()
    elif kind != "deleted":
        doc = orjson.loads(good)
        if kind == "garbage":
            data = b"\x00not json"
        elif kind == "newer":
            data = orjson.dumps({**doc, "version": 2})
        elif kind == "extra_field":
            data = orjson.dumps({**doc, "trusted": True})
        else:
            data = good + b" " * 8192
        record.write_bytes(data)
    for opener in (key, None):
        with pytest.raises(error, match=r"\.memtree-root\.json"):
            memtree.Checkpointer(root, encryption=opener)
    assert os.listdir(root / "1")  # nothing deleted


def test_encrypted_steps_of_a_root_without_record_are_refused(tmp_path, key):
    """Steps encrypted with the key itself (memtree before step authentication, or a record
    deleted): their number and root are not authenticated, so the root is refused."""
    from memtree.store.reading.options import WriteOptions
    from memtree.store.writing.write import write_tree
    from memtree.training.state import state_to_level

    write_tree(tmp_path / "4", state_to_level(_w(4)), WriteOptions.of(encryption=key))
    for opener in (key, None):
        with pytest.raises(memtree.DecryptionError, match=r"encrypted steps \[4\] but no \.memtree-root\.json.*load_memmap"):
            memtree.Checkpointer(tmp_path, encryption=opener)
    assert sorted(os.listdir(tmp_path)) == ["4"]


def test_a_plain_step_planted_in_an_encrypted_root_is_refused_on_restore(tmp_path, key):
    from memtree.store.writing.write import write_tree
    from memtree.training.state import state_to_level

    ckpt = memtree.Checkpointer(tmp_path, encryption=key)
    ckpt.save(1, _w(1))
    write_tree(ckpt.path(9), state_to_level(_w(9)))  # written without the key
    with pytest.raises(memtree.DecryptionError, match="is not encrypted"):
        ckpt.restore()
    with pytest.raises(memtree.StepOrderError, match=r"\[9\]"):
        ckpt.save(2, _w(2))  # the planted step is a step: the order rule names it
    assert_same(ckpt.restore(1), _w(1))


def test_two_checkpointers_making_the_record_of_an_empty_root_at_once(tmp_path, key, monkeypatch):
    """Both read "no record", one writes it first: the other reads the winner's and is refused
    with another key (accepted with the same one); a record is never written over another."""
    from memtree.store.reading.steps import list_steps
    from memtree.training import root as root_module

    memtree.Checkpointer(tmp_path, encryption=key)  # the winner
    winner = (tmp_path / ".memtree-root.json").read_bytes()
    real = root_module.read_record
    calls = []

    def stale_first(path):
        calls.append(path)
        return None if len(calls) == 1 else real(path)

    monkeypatch.setattr(root_module, "read_record", stale_first)
    with pytest.raises(memtree.DecryptionError, match="another key"):
        root_module.open_root(str(tmp_path), memtree.EncryptionKey.generate(), list_steps(str(tmp_path)), fsync=False)
    calls.clear()
    record = root_module.open_root(str(tmp_path), key, list_steps(str(tmp_path)), fsync=False)
    assert len(calls) == 2 and record == real(str(tmp_path))
    assert (tmp_path / ".memtree-root.json").read_bytes() == winner
    assert [n for n in os.listdir(tmp_path) if "memtree-tmp" in n] == []


def test_a_root_record_replaced_after_opening_stops_the_next_save(tmp_path, key):
    ckpt = memtree.Checkpointer(tmp_path / "a", encryption=key)
    ckpt.save(1, _w(1))
    memtree.Checkpointer(tmp_path / "b", encryption=key)
    shutil.copyfile(tmp_path / "b" / ".memtree-root.json", tmp_path / "a" / ".memtree-root.json")
    before = snapshot(tmp_path / "a")
    with pytest.raises(memtree.DecryptionError, match="has another record than when it was opened.*nothing was written"):
        ckpt.save(2, _w(2))
    assert snapshot(tmp_path / "a") == before
