"""``Checkpointer.restore``: it verifies what save recorded by default (a flipped bit in a leaf or a
``meta.json``, a write through a hard link shared with another step), and restores partially
(``keys=``, ``into=`` with ``strict=False``, ``prefix=``, ``ignore_mismatched=``), reporting what
each object of ``into`` received in ``ckpt.last_restore``.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
from torch import nn

import memtree
from memtree.training import RestoreReport
from test_training import assert_same
from treeutil import flip_bit


@pytest.fixture
def ckpt(tmp_path):
    return memtree.Checkpointer(tmp_path / "ckpt")


def _model(head: int = 2, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, head))


def _trained_state():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt, {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 3}


# ---------------------------------------------------------------------------------------------
# verify=True by default


def test_a_flipped_bit_in_a_leaf_is_refused_and_verify_false_reads_it(ckpt):
    w = torch.arange(256, dtype=torch.float32)
    ckpt.save(1, {"model": {"w": w}})
    (leaf,) = glob.glob(os.path.join(ckpt.path(1), "model", "w*.memmap"))
    flip_bit(leaf, 9)
    with pytest.raises(memtree.IntegrityError, match=r"leaf .*w.* is damaged: its meta.json records checksum"):
        ckpt.restore()
    with pytest.raises(memtree.IntegrityError):
        ckpt.restore(into={"model": nn.Module()}, strict=False)
    assert ckpt.last_restore is None
    got = ckpt.restore(verify=False)["model"]["w"]  # the opt-out reads what is on disk
    assert not torch.equal(got, w) and ckpt.last_restore.verified is False


def test_a_changed_meta_json_below_the_root_is_refused(ckpt):
    ckpt.save(1, {"model": {"w": torch.ones(4)}, "sched": {"last_epoch": 7, "w": torch.ones(1)}})
    meta = os.path.join(ckpt.path(1), "sched", "meta.json")
    with open(meta, "rb") as f:
        data = f.read()
    assert b'"value":7' in data
    with open(meta, "wb") as f:  # a valid meta.json that says something else
        f.write(data.replace(b'"value":7', b'"value":8'))
    with pytest.raises(memtree.IntegrityError, match="tree"):
        ckpt.restore()
    assert ckpt.restore(verify=False)["sched"]["last_epoch"] == 8


def test_a_leaf_written_through_a_hard_link_of_another_step_is_never_restored_silently(ckpt):
    """Incremental steps share unchanged leaves. A write through step 2's name of the file
    (by hand, or any tool) changes step 1's bytes too: restore(1) refuses it."""
    w = torch.arange(1024, dtype=torch.float32)
    ckpt.save(1, {"w": w})
    ckpt.save(2, {"w": w})
    assert ckpt.last_stats.files_linked == 1
    (leaf2,) = glob.glob(os.path.join(ckpt.path(2), "w*.memmap"))
    with open(leaf2, "r+b") as f:
        f.write(b"\x00\x00\x80\x7f")  # w[0] = inf, through step 2's name
    for step in (1, 2):
        with pytest.raises(memtree.IntegrityError, match=r"leaf 'w'"):
            ckpt.restore(step)


def test_a_write_through_memtree_into_a_linked_step_never_reaches_another_step_silently(ckpt):
    """Through ``load_memmap(step, mode="r+")``: the other step's leaf either keeps its bytes
    (the link is broken before the write) or is refused by restore's checksum; never changed
    values returned."""
    w = torch.arange(1024, dtype=torch.float32)
    ckpt.save(1, {"w": w})
    ckpt.save(2, {"w": w})
    tree = memtree.load_memmap(ckpt.path(2), mode="r+")
    tree["w"][0] = 12345.0
    del tree
    try:
        got = ckpt.restore(1)["w"]
    except memtree.IntegrityError:
        return
    assert torch.equal(got, w)


def test_verify_false_and_true_return_the_same_state_of_a_sound_step(ckpt):
    _, _, state = _trained_state()
    ckpt.save(1, state)
    assert_same(ckpt.restore(), state)
    assert ckpt.last_restore == RestoreReport(1, ckpt.path(1), True)
    assert_same(ckpt.restore(verify=False), state)
    for bad in (None, 1, "yes"):
        with pytest.raises(memtree.InvalidArgumentError, match="verify"):
            ckpt.restore(verify=bad)


def test_a_step_saved_without_checksums_is_reported_unverified(ckpt):
    from memtree.store.reading.options import WriteOptions
    from memtree.store.writing.write import write_tree
    from memtree.training.state import state_to_level

    write_tree(ckpt.path(3), state_to_level({"w": torch.ones(2)}), WriteOptions.of(checksum=None))
    assert_same(ckpt.restore(), {"w": torch.ones(2)})
    assert ckpt.last_restore.step == 3 and ckpt.last_restore.verified is False  # nothing to check


# ---------------------------------------------------------------------------------------------
# partial restore: keys=, into= with strict=False, prefix=, ignore_mismatched=


def test_fine_tuning_into_a_model_with_a_new_head(ckpt):
    """Issue 29: no load_into_module(..., ckpt.path(step), ...) by hand any more."""
    model, _, state = _trained_state()
    ckpt.save(100, state)
    new = _model(head=5, seed=1)
    head_before = new[2].weight.clone()
    out = ckpt.restore(into={"model": new}, strict=False, ignore_mismatched=True)
    assert out["model"] is new and out["epoch"] == 3
    report = ckpt.last_restore
    assert (report.step, report.loaded, report.missing) == (100, ["model"], [])
    assert report.modules["model"].mismatched == ["2.weight", "2.bias"]
    assert torch.equal(new[0].weight, model[0].weight) and torch.equal(new[2].weight, head_before)


def test_into_a_module_with_a_prefix_and_keys(ckpt):
    model, _, state = _trained_state()
    ckpt.save(1, state)
    fresh = _model(seed=3)
    out = ckpt.restore(into=fresh, keys=["model"], prefix="model.")  # strict: every name matches
    assert out is fresh  # into itself was filled: restore returns it
    assert ckpt.last_restore.modules[""] == ([], []) and ckpt.last_restore.loaded == [""]
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))
    with pytest.raises(memtree.MemtreeKeyError, match="prefix='model.'"):  # the whole state: optim too
        ckpt.restore(into=_model(seed=3))
    lenient = _model(seed=3)
    ckpt.restore(into=lenient, prefix="model.", strict=False)
    assert ckpt.last_restore.modules[""].missing == []
    assert ckpt.last_restore.modules[""].unexpected[0].startswith("optim.state.0.")
    assert all(torch.equal(a, b) for a, b in zip(lenient.parameters(), model.parameters()))


def test_strict_into_checks_every_key_before_filling_anything(ckpt):
    model, _, state = _trained_state()
    ckpt.save(1, state)
    fresh = _model(seed=4)
    before = [p.clone() for p in fresh.parameters()]
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(fresh.parameters(), lr=1), step_size=3)
    with pytest.raises(memtree.MemtreeKeyError, match=r"into\['sched'\].*nothing was filled.*strict=False"):
        ckpt.restore(into={"model": fresh, "sched": sched})
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), before))
    ckpt.restore(into={"model": fresh, "sched": sched}, strict=False)
    assert ckpt.last_restore.loaded == ["model"] and ckpt.last_restore.missing == ["sched"]
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), model.parameters()))


def test_keys_selects_what_is_read_and_an_unknown_key_is_an_error(ckpt):
    _, opt, state = _trained_state()
    ckpt.save(1, {**state, "seq": [torch.ones(2), 5]})
    got = ckpt.restore(keys=[("optim", "state"), "epoch"])
    assert list(got) == ["optim", "epoch"] and list(got["optim"]) == ["state"]
    assert_same(got["optim"]["state"], opt.state_dict()["state"])  # int keys come back as ints
    assert_same(ckpt.restore(keys=[("optim", "state", "0", "exp_avg")])["optim"]["state"][0]["exp_avg"],
                opt.state_dict()["state"][0]["exp_avg"])
    with pytest.raises(memtree.MemtreeKeyError, match="'nope'"):
        ckpt.restore(keys=["nope"])
    with pytest.raises(memtree.InvalidArgumentError, match="inside the list at \\('seq',\\)"):
        ckpt.restore(keys=[("seq", "1")])
    assert_same(ckpt.restore(keys=["seq"])["seq"], [torch.ones(2), 5])


def test_filling_options_without_into_or_a_module_are_errors(ckpt):
    _, opt, state = _trained_state()
    ckpt.save(1, state)
    for kwargs in ({"strict": False}, {"prefix": "model."}, {"ignore_mismatched": True}):
        with pytest.raises(memtree.InvalidArgumentError, match="into="):
            ckpt.restore(**kwargs)
    with pytest.raises(memtree.InvalidArgumentError, match="holds none"):
        ckpt.restore(into={"optim": opt}, prefix="model.")
    with pytest.raises(memtree.InvalidArgumentError, match=r"into\['x'\] must be an nn.Module.*got int"):
        ckpt.restore(into={"x": 1, "model": _model()}, strict=False)


def test_an_object_whose_load_state_dict_refuses_the_state_is_a_memtree_error(ckpt):
    _, _, state = _trained_state()
    ckpt.save(1, state)
    other = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)  # one group, another layout
    with pytest.raises(memtree.SourceError, match=r"into\['optim'\]\.load_state_dict") as info:
        ckpt.restore(into={"optim": other})
    assert isinstance(info.value.__cause__, (ValueError, KeyError))


def test_a_dotted_name_met_twice_cannot_fill_a_module(ckpt):
    ckpt.save(1, {"model": {"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}})
    with pytest.raises(memtree.SourceError, match="'model.a.b'"):
        ckpt.restore(into=nn.Module(), strict=False)
