"""``memtree.integrations.transformers`` under the Trainer's own entry points: ``train()``,
``train(resume_from_checkpoint=True | path)`` compared bit for bit with an uninterrupted run and
with the plain Trainer's own resume, ``save_total_limit`` with ``load_best_model_at_end``, hard
links between checkpoints, ``from_pretrained`` of an exported step, the callback, refusals,
damaged checkpoints and a ``kill -9`` in the middle of a save. GPT-2 built from a small config:
nothing is downloaded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed  # noqa: E402

import memtree  # noqa: E402
from memtree.errors import (  # noqa: E402
    CheckpointNotFoundError,
    DestinationExistsError,
    IntegrityError,
    InvalidArgumentError,
    ShapeMismatchError,
)
from memtree.integrations.transformers import (  # noqa: E402
    MemtreeCallback,
    MemtreeTrainer,
    MemtreeTrainerMixin,
    export_pretrained,
    is_checkpoint,
)
from treeutil import assert_identical  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
CONFIG = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16)
STEPS = 10  # 24 samples, batch 4: 6 steps an epoch, so step 10 is in the second epoch


def data(n: int = 24) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        x = torch.randint(0, CONFIG.vocab_size, (16,), generator=g)
        out.append({"input_ids": x, "labels": x})
    return out


class StopAt(TrainerCallback):
    """Ends training after step ``at``, saved: an interruption."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            control.should_training_stop = True
            control.should_save = True


def make(out: Path, *, cls: Any = MemtreeTrainer, stop: int | None = None, callbacks: list[Any] = (),
         model: Any = None, eval_dataset: Any = None, **args: Any) -> Any:
    set_seed(0)
    model = model if model is not None else GPT2LMHeadModel(CONFIG)
    defaults = dict(max_steps=STEPS, save_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True,
                    disable_tqdm=True, seed=0, logging_steps=1, save_total_limit=None)
    training = TrainingArguments(str(out), **(defaults | args))
    extra = [StopAt(stop)] if stop else []
    return cls(model=model, args=training, train_dataset=data(), eval_dataset=eval_dataset, callbacks=[*extra, *callbacks])


def run(out: Path, resume: Any = None, **kw: Any) -> Any:
    trainer = make(out, **kw)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def outcome(trainer: Any) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": trainer.optimizer.state_dict(),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "step": trainer.state.global_step,
    }


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Ten steps in one go with the plain Trainer (dropout on: the RNG matters)."""
    return outcome(run(tmp_path_factory.mktemp("plain"), cls=Trainer))


# -- the Trainer's entry points ----------------------------------------------------------------


@pytest.mark.parametrize("stop, resume", [(6, True), (5, "checkpoint-4")], ids=["epoch-boundary", "mid-epoch"])
def test_resume_is_bit_exact(tmp_path, uninterrupted, stop, resume):
    run(tmp_path, stop=stop)
    trainer = run(tmp_path, resume=resume if resume is True else str(tmp_path / resume))
    assert_identical(uninterrupted, outcome(trainer))


def test_a_checkpoint_is_a_directory_of_json_files_and_a_memtree_tree(tmp_path):
    run(tmp_path, max_steps=2)
    ckpt = tmp_path / "checkpoint-2"
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2"]
    assert sorted(os.listdir(ckpt)) == ["config.json", "generation_config.json", "state", "trainer_state.json"]
    assert is_checkpoint(ckpt) and memtree.verify_tree(ckpt / "state").ok
    tree = memtree.load_memmap(ckpt / "state")
    assert sorted(tree.keys()) == ["__memtree_types__", "model", "optimizer", "rng", "scheduler"]
    record = tree["__memtree_types__"]["values"]  # the values kept with their types: the rest is plain
    assert [entry[:2] for entry in record] == [[["model"], "ordered"], [["rng", "numpy", 1], "ndarray"]]
    assert tree["optimizer", "state", "0", "exp_avg"].shape == tree["model", "transformer.wte.weight"].shape
    assert not [p for p in ckpt.rglob("*") if p.suffix in (".pt", ".pth", ".bin", ".safetensors", ".pickle")]


def test_save_total_limit_keeps_the_newest_and_the_best(tmp_path):
    trainer = make(tmp_path, save_total_limit=2, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                   metric_for_best_model="loss", eval_dataset=data(8))
    trainer.train()
    best = trainer.state.best_model_checkpoint
    kept = sorted(os.listdir(tmp_path))
    assert f"checkpoint-{STEPS}" in kept and Path(best).name in kept and len(kept) <= 3, (kept, best)
    assert all(is_checkpoint(tmp_path / name) for name in kept)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging directory or lock left
    weights = memtree.load_memmap(Path(best) / "state", keys=["model"])["model"]
    for name, value in trainer.model.state_dict().items():  # load_best_model_at_end loaded it
        assert torch.equal(value, weights[name]), name


def test_unchanged_tensors_are_hard_links_to_the_previous_checkpoint(tmp_path):
    # 2,048 positions: the frozen embeddings (128 KiB) have a file of their own; under 64 KiB they
    # would share a pack with trained tensors, written again with them (docs/format.md)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=2048))
    model.transformer.wpe.requires_grad_(False)  # frozen: never changes
    run(tmp_path, model=model, max_steps=4)

    def inode(step: int, key: str) -> int:
        tree = memtree.load_memmap(tmp_path / f"checkpoint-{step}" / "state", keys=["model"], mode="r")
        return os.stat(tree["model", key].filename).st_ino

    assert inode(2, "transformer.wpe.weight") == inode(4, "transformer.wpe.weight")
    assert inode(2, "transformer.wte.weight") != inode(4, "transformer.wte.weight")


def test_an_exported_step_loads_with_from_pretrained(tmp_path):
    trainer = run(tmp_path / "out", max_steps=2)
    export = export_pretrained(tmp_path / "out" / "checkpoint-2", tmp_path / "export", max_shard_size="20KB")
    assert any(name.endswith(".safetensors") for name in os.listdir(export))
    loaded = GPT2LMHeadModel.from_pretrained(export)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    with pytest.raises(DestinationExistsError):
        export_pretrained(tmp_path / "out" / "checkpoint-2", tmp_path / "export")


# -- the callback ------------------------------------------------------------------------------


def test_the_callback_alone_refuses_to_let_the_trainer_write_its_own_checkpoints(tmp_path):
    with pytest.raises(InvalidArgumentError, match="install"):
        run(tmp_path, cls=Trainer, callbacks=[MemtreeCallback()], max_steps=2)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("checkpoint")]


def test_install_gives_an_existing_trainer_the_mixin_and_its_options(tmp_path, uninterrupted):
    callback = MemtreeCallback(fsync=True)
    trainer = callback.install(make(tmp_path, cls=Trainer, stop=6))
    assert isinstance(trainer, MemtreeTrainerMixin) and isinstance(trainer, Trainer)
    assert trainer._memtree() is callback
    trainer.train()
    assert is_checkpoint(tmp_path / "checkpoint-6")
    resumed = MemtreeCallback().install(make(tmp_path, cls=Trainer))
    resumed.train(resume_from_checkpoint=True)
    assert_identical(uninterrupted, outcome(resumed))


# -- refusals and damage -----------------------------------------------------------------------


def test_resuming_what_is_not_a_memtree_checkpoint_is_refused_clearly(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint in"):
        run(tmp_path / "empty", resume=True)
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint directory"):
        run(tmp_path / "x", resume=str(tmp_path / "missing"))
    run(tmp_path / "plain", cls=Trainer, max_steps=2)  # the Trainer's own files
    with pytest.raises(CheckpointNotFoundError, match="plain Trainer"):
        run(tmp_path / "plain", resume=True)


def test_resuming_with_a_different_model_fails_naming_the_tensor(tmp_path):
    run(tmp_path, max_steps=2)
    other = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    with pytest.raises(ShapeMismatchError, match="transformer.wte.weight"):
        run(tmp_path, model=other, resume=True)


def test_a_damaged_checkpoint_is_refused_before_training(tmp_path):
    run(tmp_path, max_steps=2)
    tree = memtree.load_memmap(tmp_path / "checkpoint-2" / "state")
    with open(tree["model", "transformer.h.0.mlp.c_fc.weight"].filename, "r+b") as f:
        f.write(b"\x7f")
    with pytest.raises(IntegrityError):
        run(tmp_path, resume=True)


def test_unsupported_setups_are_refused(tmp_path):
    trainer = make(tmp_path, max_steps=2)
    trainer.args.push_to_hub = True
    with pytest.raises(InvalidArgumentError, match="push_to_hub"):
        trainer._memtree_check_supported()


KILLED = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from test_integration_transformers import run
    run(Path({root!r}))
    print("finished")
    """
)


@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_save_leaves_the_previous_checkpoints_whole(tmp_path, uninterrupted):
    script = tmp_path / "killed.py"
    script.write_text(KILLED.format(tests=str(TESTS), root=str(tmp_path / "out")))
    # the third checkpoint (step 6) dies after its state/ tree is committed inside the staging
    # directory, before the checkpoint directory itself is renamed into place
    env = dict(os.environ, MEMTREE_FAULT="before_publish:6", PYTHONPATH=os.pathsep.join([str(REPO), str(TESTS)]))
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 137, proc.stderr[-3000:]
    visible = sorted(n for n in os.listdir(tmp_path / "out") if not n.startswith("."))
    assert visible == ["checkpoint-2", "checkpoint-4"], visible
    trainer = run(tmp_path / "out", resume=True)  # from checkpoint-4; the leftovers are cleaned
    assert_identical(uninterrupted, outcome(trainer))
