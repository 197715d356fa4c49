"""``memtree.integrations.lightning.MemtreeCheckpointIO`` under Lightning's own entry points.

``Trainer(plugins=[MemtreeCheckpointIO()])`` with ``ModelCheckpoint`` (top-k, ``last.ckpt``),
``fit(ckpt_path=...)`` resume compared bit for bit with an uninterrupted run, the asynchronous
form, what ``load_checkpoint`` returns compared with ``torch.load`` of Lightning's own files,
hard links between checkpoints, values that need pickle, hostile paths, damaged files, a
``kill -9`` in the middle of a save, and two Trainers writing into one directory at once.
"""

from __future__ import annotations

import argparse
import collections
import math
import multiprocessing as mp
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning", reason="the lightning extra is not installed")

from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import memtree  # noqa: E402
from memtree.errors import (  # noqa: E402
    CheckpointNotFoundError,
    CheckpointSaveError,
    DestinationExistsError,
    IntegrityError,
    InvalidArgumentError,
    NonTensorValueError,
    PickleNotAllowedError,
)
from memtree.integrations import lightning as mt_lightning  # noqa: E402
from memtree.integrations.lightning import MemtreeCheckpointIO  # noqa: E402
from treeutil import assert_identical, run_children  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FORK = mp.get_context("fork")
TIMEOUT = 300.0


class TinyModule(L.LightningModule):
    """A linear layer, batch norm (buffers, ``_metadata`` version 2), an optional frozen layer,
    Adam and ``ReduceLROnPlateau`` (whose state holds ``inf``)."""

    def __init__(self, lr: float = 0.05, frozen: bool = False, width: int = 2, losses: tuple[float, ...] = ()) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.frozen = torch.nn.Linear(width, 2) if frozen else None
        if self.frozen is not None:
            self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn(self.net(x))
        return self.frozen(y) if self.frozen is not None else y[:, :2]

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, _: int) -> None:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        if self.hparams.losses:  # a scripted metric: ModelCheckpoint deletes in the order it says
            loss = torch.tensor(self.hparams.losses[self.current_epoch])
        self.log("val_loss", loss)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.Adam(filter(lambda p: p.requires_grad, self.parameters()), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=1)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


def data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 2, generator=g)), batch_size=8)


def fit(root: Path, epochs: int, *, io: Any = None, ckpt_path: str | None = None, top_k: int = 1,
        callbacks: list[Any] | None = None, **model: Any) -> tuple[TinyModule, L.Trainer]:
    L.seed_everything(0, verbose=False)
    module = TinyModule(**model)
    checkpoint = ModelCheckpoint(dirpath=root / "ck", monitor="val_loss", save_top_k=top_k, save_last=True)
    trainer = L.Trainer(
        max_epochs=epochs, plugins=[io if io is not None else MemtreeCheckpointIO()], accelerator="cpu",
        enable_progress_bar=False, enable_model_summary=False, logger=False, deterministic=True,
        default_root_dir=root, callbacks=[checkpoint] + (callbacks or []),
    )
    trainer.fit(module, data(), data(), ckpt_path=ckpt_path)
    return module, trainer


def training_state(module: TinyModule, trainer: L.Trainer) -> dict[str, Any]:
    return {
        "model": dict(module.state_dict()),
        "optimizer": trainer.optimizers[0].state_dict(),
        "scheduler": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
    }


def assert_resumed_exactly(reference: dict[str, Any], module: TinyModule, trainer: L.Trainer) -> None:
    """A run resumed through memtree checkpoints ends where the uninterrupted run ends (model and
    optimizer, bit for bit), and exactly where Lightning's own resume (``TorchCheckpointIO``)
    ends (everything: Lightning steps ``ReduceLROnPlateau`` once less around a resume)."""
    ours = training_state(module, trainer)
    assert_identical(reference["uninterrupted"]["model"], ours["model"], "model")
    assert_identical(reference["uninterrupted"]["optimizer"], ours["optimizer"], "optimizer")
    assert_identical(reference["resumed"], ours, "resumed")


def checkpoints(root: Path) -> list[str]:
    return sorted(os.listdir(root / "ck"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Lightning's own TorchCheckpointIO: four epochs in one go, and two then resumed to four."""
    root = tmp_path_factory.mktemp("torch")
    uninterrupted = training_state(*fit(root / "once", 4, io=TorchCheckpointIO()))
    fit(root / "twice", 2, io=TorchCheckpointIO())
    resumed = training_state(*fit(root / "twice", 4, io=TorchCheckpointIO(), ckpt_path="last"))
    return {"uninterrupted": uninterrupted, "resumed": resumed}


# -- Lightning's entry points ------------------------------------------------------------------


def test_fit_resumed_from_last_is_bit_exact_and_every_checkpoint_is_a_tree(tmp_path, reference):
    fit(tmp_path, 2)
    module, trainer = fit(tmp_path, 4, ckpt_path="last")
    assert_resumed_exactly(reference, module, trainer)
    names = checkpoints(tmp_path)
    assert names == ["epoch=3-step=16.ckpt", "last.ckpt"], names  # top-1 and last: older ones removed
    for name in names:
        path = tmp_path / "ck" / name
        assert (path / "meta.json").is_file()
        assert memtree.verify_tree(path).ok
        assert not [f for f in path.rglob("*") if f.suffix in (".pickle", ".pkl", ".pt")]
    # ModelCheckpoint's paths are what the Trainer recorded, and they load as torch.load would
    best = trainer.checkpoint_callback.best_model_path
    assert Path(best).name == "epoch=3-step=16.ckpt"
    state = MemtreeCheckpointIO().load_checkpoint(best)
    assert state["global_step"] == 16 and math.isinf(state["lr_schedulers"][0]["mode_worse"])


def test_fit_resumed_from_an_explicit_path_and_validate_with_best(tmp_path, reference):
    _, first = fit(tmp_path / "a", 2, top_k=-1)
    path = tmp_path / "a" / "ck" / "epoch=1-step=8.ckpt"
    assert path.is_dir()
    module, trainer = fit(tmp_path / "b", 4, ckpt_path=str(path))
    assert_resumed_exactly(reference, module, trainer)
    metrics = trainer.validate(module, data(), ckpt_path="best", verbose=False)
    assert metrics and "val_loss" in metrics[0]


def test_the_asynchronous_form_trains_the_same_and_keeps_the_same_checkpoints(tmp_path, reference):
    io = MemtreeCheckpointIO(blocking=False)
    assert io.fsync  # durable before committed, by default
    module, trainer = fit(tmp_path, 4, io=io)
    assert_identical(reference["uninterrupted"], training_state(module, trainer))
    assert checkpoints(tmp_path) == ["epoch=3-step=16.ckpt", "last.ckpt"]
    again, trainer2 = fit(tmp_path, 5, io=MemtreeCheckpointIO(blocking=False), ckpt_path="last")
    assert trainer2.global_step == 20
    assert MemtreeCheckpointIO().load_checkpoint(tmp_path / "ck" / "last.ckpt")["global_step"] == 20


def test_model_checkpoint_top_k_deletes_in_the_order_its_metric_says(tmp_path):
    losses = (5.0, 1.0, 4.0, 0.5, 3.0, 0.7)  # the 2nd best changes out of saving order
    _, trainer = fit(tmp_path, len(losses), top_k=2, losses=losses)
    kept = {Path(p).name for p in trainer.checkpoint_callback.best_k_models}
    assert kept == {"epoch=3-step=16.ckpt", "epoch=5-step=24.ckpt"}
    assert set(checkpoints(tmp_path)) == kept | {"last.ckpt"}
    io = MemtreeCheckpointIO()
    for name in checkpoints(tmp_path):
        assert io.load_checkpoint(tmp_path / "ck" / name)["epoch"] in (3, 5)


def test_save_last_link_is_a_symlink_that_loads_and_resumes(tmp_path, reference):
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ck", save_top_k=1, monitor="val_loss", save_last="link")
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_epochs=2, plugins=[MemtreeCheckpointIO()], accelerator="cpu", logger=False,
                        enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                        callbacks=[checkpoint], default_root_dir=tmp_path)
    trainer.fit(TinyModule(), data(), data())
    last = tmp_path / "ck" / "last.ckpt"
    assert last.is_symlink() and last.resolve().is_dir()
    module, resumed = fit(tmp_path / "again", 4, ckpt_path=str(last))
    assert_resumed_exactly(reference, module, resumed)


# -- what a checkpoint holds -------------------------------------------------------------------


class Recorder(TorchCheckpointIO):
    """Lightning's own IO, keeping the last dict it was handed."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.last = checkpoint
        super().save_checkpoint(checkpoint, path, storage_options)


def test_load_checkpoint_returns_what_torch_load_returns(tmp_path):
    recorder = Recorder()
    fit(tmp_path / "fit", 2, io=recorder)
    ckpt = dict(recorder.last)
    ckpt["extra"] = {"nan": float("nan"), 1: (float("-inf"), [torch.float16, torch.device("cpu")]),
                     "size": torch.Size([2, 3]), "array": torch.arange(3).numpy(), "empty": collections.OrderedDict()}
    TorchCheckpointIO().save_checkpoint(ckpt, tmp_path / "torch.ckpt")
    MemtreeCheckpointIO().save_checkpoint(ckpt, tmp_path / "memtree.ckpt")
    theirs = torch.load(tmp_path / "torch.ckpt", weights_only=False)
    ours = MemtreeCheckpointIO().load_checkpoint(tmp_path / "memtree.ckpt")
    array = ours["extra"].pop("array")
    assert array.tolist() == [0, 1, 2] and array.dtype == theirs["extra"].pop("array").dtype
    assert_identical(theirs, ours)
    assert type(ours["state_dict"]) is collections.OrderedDict and ours["state_dict"]._metadata["bn"] == {"version": 2}


def test_a_torch_save_checkpoint_of_an_earlier_run_still_loads(tmp_path):
    ckpt = {"state_dict": collections.OrderedDict(w=torch.arange(4.0)), "epoch": 3}
    TorchCheckpointIO().save_checkpoint(ckpt, tmp_path / "old.ckpt")
    assert_identical(ckpt, MemtreeCheckpointIO().load_checkpoint(tmp_path / "old.ckpt"))


def test_unchanged_tensors_are_hard_links_to_the_previous_checkpoint(tmp_path):
    fit(tmp_path, 3, top_k=-1, frozen=True)
    ck = tmp_path / "ck"
    trees = [memtree.load_memmap(ck / f"epoch={e}-step={4 * (e + 1)}.ckpt", mode="r") for e in range(3)]

    def inode(tree: Any, key: str) -> int:
        return os.stat(tree["state_dict"][key].filename).st_ino

    for a, b in zip(trees, trees[1:]):
        assert inode(a, "frozen.weight") == inode(b, "frozen.weight")  # never changes: linked
        assert inode(a, "net.weight") != inode(b, "net.weight")  # trained: written
    assert os.stat(trees[-1]["state_dict"]["frozen.weight"].filename).st_nlink >= 3
    # the links are standalone: removing the first checkpoint loses nothing of the others
    MemtreeCheckpointIO().remove_checkpoint(ck / "epoch=0-step=4.ckpt")
    assert memtree.verify_tree(ck / "epoch=2-step=12.ckpt").ok


def test_incremental_false_writes_every_byte(tmp_path):
    io = MemtreeCheckpointIO(incremental=False)
    for name in ("a", "b"):
        io.save_checkpoint({"w": torch.ones(16)}, tmp_path / name)
    assert os.stat(memtree.load_memmap(tmp_path / "b")["w"].filename).st_nlink == 1


def test_values_json_cannot_hold_need_allow_pickle_both_ways(tmp_path):
    ckpt = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": {"args": argparse.Namespace(lr=0.1)}}
    with pytest.raises(NonTensorValueError, match=r"\['hyper_parameters'\]\['args'\] is a Namespace.*allow_pickle=True"):
        MemtreeCheckpointIO().save_checkpoint(ckpt, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    MemtreeCheckpointIO(allow_pickle=True).save_checkpoint(ckpt, tmp_path / "a.ckpt")
    assert MemtreeCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "a.ckpt")["hyper_parameters"]["args"].lr == 0.1
    with pytest.raises(PickleNotAllowedError, match=r"\['args'\] was saved pickled.*allow_pickle=True"):
        MemtreeCheckpointIO().load_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(PickleNotAllowedError, match="weights_only=False"):
        MemtreeCheckpointIO(allow_pickle=True).load_checkpoint(tmp_path / "a.ckpt", weights_only=True)


def test_a_checkpoint_holding_the_reserved_key_is_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="__memtree_types__"):
        MemtreeCheckpointIO().save_checkpoint({"__memtree_types__": 1}, tmp_path / "a.ckpt")


def test_map_location_moves_the_tensors_and_refuses_what_it_cannot_honour(tmp_path):
    io = MemtreeCheckpointIO()
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "a.ckpt")
    assert io.load_checkpoint(tmp_path / "a.ckpt", map_location="meta")["w"].is_meta
    with pytest.raises(InvalidArgumentError, match="map_location"):
        io.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, loc: storage)


# -- hostile paths, damaged files, order of calls ----------------------------------------------


@pytest.mark.parametrize("url", ["s3://bucket/epoch=0.ckpt", "https://host/x.ckpt", "memory://x.ckpt"])
def test_remote_paths_are_refused_clearly(url):
    with pytest.raises(InvalidArgumentError, match="local"):
        MemtreeCheckpointIO().save_checkpoint({"w": torch.ones(1)}, url)
    with pytest.raises(InvalidArgumentError, match="local"):
        MemtreeCheckpointIO().load_checkpoint(url)


def test_storage_options_are_refused(tmp_path):
    with pytest.raises(InvalidArgumentError, match="storage_options"):
        MemtreeCheckpointIO().save_checkpoint({"w": torch.ones(1)}, tmp_path / "a", storage_options={"x": 1})


def test_a_file_url_is_its_local_path(tmp_path):
    io = MemtreeCheckpointIO()
    io.save_checkpoint({"w": torch.ones(1)}, f"file://{tmp_path}/a.ckpt")
    assert (tmp_path / "a.ckpt" / "meta.json").is_file()


def test_saving_over_a_file_or_a_foreign_directory_is_refused_and_changes_nothing(tmp_path):
    (tmp_path / "file.ckpt").write_bytes(b"torch.save bytes")
    (tmp_path / "dir.ckpt").mkdir()
    (tmp_path / "dir.ckpt" / "notes.txt").write_text("mine")
    for name in ("file.ckpt", "dir.ckpt"):
        with pytest.raises(DestinationExistsError):
            MemtreeCheckpointIO().save_checkpoint({"w": torch.ones(1)}, tmp_path / name)
    assert (tmp_path / "file.ckpt").read_bytes() == b"torch.save bytes"
    assert (tmp_path / "dir.ckpt" / "notes.txt").read_text() == "mine"


def test_remove_checkpoint_removes_trees_files_and_links_but_never_a_foreign_directory(tmp_path):
    io = MemtreeCheckpointIO()
    io.save_checkpoint({"w": torch.ones(1)}, tmp_path / "tree.ckpt")
    (tmp_path / "link.ckpt").symlink_to("tree.ckpt")
    (tmp_path / "file.ckpt").write_bytes(b"x")
    (tmp_path / "foreign").mkdir()
    io.remove_checkpoint(tmp_path / "link.ckpt")  # the link only
    assert (tmp_path / "tree.ckpt" / "meta.json").is_file()
    io.remove_checkpoint(tmp_path / "tree.ckpt")
    io.remove_checkpoint(tmp_path / "file.ckpt")
    io.remove_checkpoint(tmp_path / "missing.ckpt")  # nothing there: nothing to do
    with pytest.raises(InvalidArgumentError, match="did not write"):
        io.remove_checkpoint(tmp_path / "foreign")
    assert sorted(os.listdir(tmp_path)) == ["foreign"]  # no staging directory or lock left


def test_a_damaged_checkpoint_is_refused_and_a_missing_one_is_reported(tmp_path):
    io = MemtreeCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.arange(64.0)}}, tmp_path / "a.ckpt")
    leaf = memtree.load_memmap(tmp_path / "a.ckpt")["state_dict"]["w"].filename
    with open(leaf, "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    with pytest.raises(IntegrityError):
        io.load_checkpoint(tmp_path / "a.ckpt")
    with pytest.raises(CheckpointNotFoundError):
        io.load_checkpoint(tmp_path / "missing.ckpt")


def test_resume_with_a_different_model_fails_naming_the_tensor(tmp_path):
    fit(tmp_path, 1)
    with pytest.raises(RuntimeError, match="size mismatch for net.weight"):
        fit(tmp_path / "other", 2, ckpt_path=str(tmp_path / "ck" / "last.ckpt"), width=3)


def test_an_async_removal_waits_for_the_save_before_it_and_is_skipped_when_it_fails(tmp_path, monkeypatch):
    io = MemtreeCheckpointIO(blocking=False)
    io.save_checkpoint({"w": torch.zeros(4)}, tmp_path / "a.ckpt")
    io.wait()
    real = mt_lightning.write_level
    monkeypatch.setattr(mt_lightning, "write_level", lambda *a, **k: (_ for _ in ()).throw(OSError("disk gone")))
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "b.ckpt")
    with pytest.raises(CheckpointSaveError, match="disk gone") as err:
        io.remove_checkpoint(tmp_path / "a.ckpt")  # Lightning's top-1: drop the old one...
        io.wait()  # ...raised here, or by remove_checkpoint if the save failed already
    assert isinstance(err.value.__cause__, OSError)
    assert (tmp_path / "a.ckpt" / "meta.json").is_file() and not (tmp_path / "b.ckpt").exists()
    monkeypatch.setattr(mt_lightning, "write_level", real)
    io.save_checkpoint({"w": torch.ones(4)}, tmp_path / "b.ckpt")  # the error was raised once
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.teardown()
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]


def test_an_async_save_writes_the_tensors_as_they_were_when_it_was_asked(tmp_path):
    io = MemtreeCheckpointIO(blocking=False, fsync=False)
    w = torch.zeros(1 << 16)
    io.save_checkpoint({"w": w, "lr": [0.1]}, tmp_path / "a.ckpt")
    w.fill_(1.0)  # training goes on while the save runs
    assert io.load_checkpoint(tmp_path / "a.ckpt")["w"].sum() == 0


# -- processes ---------------------------------------------------------------------------------

KILLED = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from test_integration_lightning import fit
    fit(Path({root!r}), 3, top_k=-1)
    print("finished")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["after_leaf:90", "before_publish:4"])
def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_checkpoints_whole(tmp_path, reference, fault):
    # each epoch saves its top-k checkpoint, then replaces last.ckpt: the 4th write is epoch 1's
    # last.ckpt (killed before its rename), and so is the 90th leaf written (25 or 26 a write)
    script = tmp_path / "killed.py"
    script.write_text(KILLED.format(tests=str(TESTS), root=str(tmp_path)))
    env = dict(os.environ, MEMTREE_FAULT=fault, PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert proc.returncode == 137, proc.stderr[-3000:]
    assert "finished" not in proc.stdout
    ck = tmp_path / "ck"
    visible = sorted(n for n in os.listdir(ck) if not n.startswith("."))
    assert visible == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"], visible
    io = MemtreeCheckpointIO()
    assert io.load_checkpoint(ck / "last.ckpt")["global_step"] == 4  # the old last.ckpt, whole
    assert io.load_checkpoint(ck / "epoch=1-step=8.ckpt")["global_step"] == 8
    memtree.recover(ck)
    assert sorted(os.listdir(ck)) == visible  # the staging directory and lock are gone
    module, trainer = fit(tmp_path, 4, ckpt_path=str(ck / "epoch=1-step=8.ckpt"))
    assert_resumed_exactly(reference, module, trainer)


def _trainer_child(root: str, barrier: Any, lr: float) -> None:
    barrier.wait(TIMEOUT)
    fit(Path(root), 3, top_k=-1, lr=lr)


@pytest.mark.slow
def test_two_trainers_saving_into_one_directory_leave_only_whole_checkpoints(tmp_path):
    """Two runs (different learning rates) write the same names at once: each name ends up one
    run's checkpoint, whole (its hyper-parameters and optimizer agree, every checksum holds)."""
    barrier = FORK.Barrier(2)
    run_children(FORK, _trainer_child, (str(tmp_path), barrier, 0.05), (str(tmp_path), barrier, 0.01))
    names = checkpoints(tmp_path)  # the second run to a name takes the next (-v1): Lightning's rule
    assert "last.ckpt" in names and len(names) >= 4, names
    assert all(re.fullmatch(r"(epoch=\d-step=\d+|last)(-v\d)?\.ckpt", n) for n in names), names
    io = MemtreeCheckpointIO()
    for name in checkpoints(tmp_path):
        assert memtree.verify_tree(tmp_path / "ck" / name).ok
        state = io.load_checkpoint(tmp_path / "ck" / name)
        lr = state["hyper_parameters"]["lr"]
        current = state["optimizer_states"][0]["param_groups"][0]["lr"]  # lr, or reduced by 10x
        assert lr in (0.05, 0.01) and any(math.isclose(current, lr * 0.1**k) for k in range(4)), (lr, current)


def test_an_async_save_waits_when_two_are_already_queued(tmp_path, monkeypatch):
    """At most two copies of the state wait for the writer thread: the third save blocks."""
    import threading

    release, began = threading.Event(), threading.Event()
    started: list[str] = []
    real = mt_lightning.write_level

    def slow(path: str, *args: Any, **kwargs: Any) -> Any:
        started.append(os.path.basename(path))
        began.set()
        assert release.wait(TIMEOUT)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(mt_lightning, "write_level", slow)
    io = MemtreeCheckpointIO(blocking=False, fsync=False)
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "a")
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "b")  # queued: returns at once
    assert began.wait(TIMEOUT)  # the writer thread is in "a"
    third = threading.Thread(target=io.save_checkpoint, args=({"w": torch.full((2,), 2.0)}, tmp_path / "c"))
    third.start()
    third.join(0.5)
    assert third.is_alive() and started == ["a"]  # still waiting for "a" to be written
    release.set()
    third.join(TIMEOUT)
    io.teardown()
    assert [io.load_checkpoint(tmp_path / n)["w"][0].item() for n in "abc"] == [0.0, 1.0, 2.0]
