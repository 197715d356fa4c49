"""Hugging Face ``Trainer`` checkpoints as memtree trees: ``MemtreeTrainer``, its mixin, its callback.

The ``Trainer`` writes each checkpoint itself (``_save_checkpoint``: ``model.safetensors``,
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``...) and reads it
back in five private methods; a ``TrainerCallback`` is called around those steps but cannot
replace them. :class:`MemtreeTrainerMixin` overrides them in one place, so that a checkpoint
``output_dir/checkpoint-<step>/`` is (``docs/guide/transformers.md``)::

    checkpoint-500/
    ├── trainer_state.json   the Trainer's own (it reads it when it resumes; JSON)
    ├── config.json          the model's configuration (and generation_config.json)
    ├── tokenizer files      the processing class's, when the Trainer has one
    └── state/               a memtree tree: model, optimizer, scheduler, scaler, rng

* the directory is **atomic**: staged and renamed whole (a ``kill -9`` leaves the previous
  checkpoints, never a partial one); ``fsync=True`` makes it durable first;
* ``state/`` is **checksummed** (verified when resumed from) and **incremental**: each tensor
  whose bytes equal the previous checkpoint's is a hard link to it (frozen weights, embeddings,
  a PEFT model's base weights cost nothing after the first checkpoint);
* **no pickle**: ``training_args.bin`` is not written; RNG states, optimizer and scheduler states
  keep their Python types (:mod:`memtree.integrations.values`);
* ``save_total_limit`` keeps the Trainer's rule (the newest and the best checkpoint are never
  deleted), and each deletion is atomic too (renamed away, then deleted);
* ``train(resume_from_checkpoint=True | path)`` restores the model, optimizer, scheduler, scaler,
  RNG and trainer state bit-exactly (the Trainer's own data skipping then replays the epoch);
* ``load_best_model_at_end`` loads the best step's ``state/``;
* :func:`export_pretrained` writes a step as a Hugging Face model directory
  (``model.safetensors`` shards and the configuration) for ``from_pretrained``.

Use ``MemtreeTrainer`` in place of ``Trainer``, or mix :class:`MemtreeTrainerMixin` into a
``Trainer`` subclass (``class T(MemtreeTrainerMixin, SFTTrainer)``). :class:`MemtreeCallback`
holds the options (``callbacks=[MemtreeCallback(fsync=True)]``); for a Trainer built by code you
do not control, ``MemtreeCallback().install(trainer)`` gives that very object the mixin. A
``MemtreeCallback`` in a Trainer without the mixin raises when training starts, instead of
letting the Trainer write its own checkpoints unnoticed. Supported: one process (CPU or one
GPU); DeepSpeed, FSDP, XLA, SageMaker and several processes are refused clearly.

Example:
    >>> import os, tempfile, torch, transformers
    >>> from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8))
    >>> data = [{"input_ids": torch.arange(8) % 50, "labels": torch.arange(8) % 50}] * 4
    >>> out = tempfile.mkdtemp()
    >>> args = TrainingArguments(out, max_steps=2, save_steps=1, per_device_train_batch_size=2,
    ...                          report_to=[], use_cpu=True, disable_tqdm=True)
    >>> trainer = MemtreeTrainer(model=model, args=args, train_dataset=data)
    >>> trainer.remove_callback(transformers.PrinterCallback)   # quiet here
    >>> _ = trainer.train()
    >>> sorted(os.listdir(out)), sorted(os.listdir(os.path.join(out, "checkpoint-2")))
    (['checkpoint-1', 'checkpoint-2'], ['config.json', 'generation_config.json', 'state', 'trainer_state.json'])
"""

from __future__ import annotations

import os
import random
import types
from typing import Any

import numpy as np
import torch

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint, sort_checkpoints
except ImportError as err:  # pragma: no cover - the extra is installed in the tests
    from ..errors import MissingDependencyError

    raise MissingDependencyError(
        "memtree.integrations.transformers needs transformers: pip install 'memtree[transformers]'"
    ) from err

from ..errors import CheckpointNotFoundError, InvalidArgumentError, ShapeMismatchError
from ..interop.sharded import write_model_directory
from ..store.writing.staged import staged_directory
from ..tree.tensortree import load_memmap
from .trees import is_tree, load_tree, remove_tree, save_tree

__all__ = ["MemtreeCallback", "MemtreeTrainerMixin", "MemtreeTrainer", "export_pretrained", "is_checkpoint"]

#: The Trainer's record of its state, in every checkpoint directory.
TRAINER_STATE_NAME = "trainer_state.json"
#: The memtree tree of a checkpoint directory.
STATE_DIR = "state"
_PICKLE_HINT = "pass MemtreeCallback(allow_pickle=True) to store it pickled"
_UNPICKLE_HINT = "pass MemtreeCallback(allow_pickle=True) if you trust this checkpoint"


def is_checkpoint(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a checkpoint directory written by :class:`MemtreeTrainerMixin`.

    Example:
        >>> import tempfile
        >>> is_checkpoint(tempfile.mkdtemp())
        False
    """
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, TRAINER_STATE_NAME)) and is_tree(os.path.join(path, STATE_DIR))


def _check_checkpoint(path: str) -> str:
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint directory at {path}")
    if not is_checkpoint(path):
        raise CheckpointNotFoundError(
            f"{path} is not a memtree checkpoint (no {STATE_DIR}/ tree with {TRAINER_STATE_NAME}): it was "
            "written by the plain Trainer; resume it with the plain Trainer, or start a new output_dir"
        )
    return path


class MemtreeCallback(TrainerCallback):
    """The options of the memtree checkpoints of a Trainer (and a guard against a Trainer
    without :class:`MemtreeTrainerMixin`).

    Args:
        fsync: make each checkpoint durable (files and directories) before it counts.
        incremental: hard-link the tensors equal to the previous checkpoint's.
        allow_pickle: store values neither tensors nor JSON can hold pickled (and load them);
            otherwise a state holding one is refused, naming its key.
        verify: check every tensor against its recorded checksum when resuming.

    Example:
        >>> MemtreeCallback(fsync=True)
        MemtreeCallback(fsync=True, incremental=True, allow_pickle=False, verify=True)
    """

    def __init__(
        self, *, fsync: bool = False, incremental: bool = True, allow_pickle: bool = False, verify: bool = True
    ) -> None:
        for name, flag in (("fsync", fsync), ("incremental", incremental), ("allow_pickle", allow_pickle),
                           ("verify", verify)):
            if type(flag) is not bool:
                raise InvalidArgumentError(f"{name} must be True or False, got {flag!r:.40}")
        self.fsync = fsync
        self.incremental = incremental
        self.allow_pickle = allow_pickle
        self.verify = verify
        self.bound = False  # set by the mixin that uses these options

    def __repr__(self) -> str:
        return (
            f"MemtreeCallback(fsync={self.fsync}, incremental={self.incremental}, "
            f"allow_pickle={self.allow_pickle}, verify={self.verify})"
        )

    def install(self, trainer: Trainer) -> Trainer:
        """Give ``trainer`` (an existing object) the mixin and these options; returns it.

        For a Trainer built by code you do not control: its class is replaced by a subclass
        that adds :class:`MemtreeTrainerMixin` (its other behaviour is unchanged).

        Example:
            >>> import tempfile
            >>> from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
            >>> model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
            >>> trainer = Trainer(model=model, args=TrainingArguments(tempfile.mkdtemp(), report_to=[]))
            >>> type(MemtreeCallback().install(trainer)).__name__
            'MemtreeTrainer'
        """
        if not isinstance(trainer, Trainer):
            raise InvalidArgumentError(f"install() takes a transformers.Trainer, got {type(trainer).__name__}")
        if not isinstance(trainer, MemtreeTrainerMixin):
            cls = type(trainer)
            trainer.__class__ = types.new_class(f"Memtree{cls.__name__}", (MemtreeTrainerMixin, cls))
        handler = trainer.callback_handler
        for old in [cb for cb in handler.callbacks if isinstance(cb, MemtreeCallback) and cb is not self]:
            handler.remove_callback(old)  # type: ignore[no-untyped-call]
        if self not in handler.callbacks:
            trainer.add_callback(self)
        self.bound = True
        return trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.bound:
            raise InvalidArgumentError(
                "MemtreeCallback is in a Trainer without MemtreeTrainerMixin: the Trainer would write its "
                "own checkpoints. Use MemtreeTrainer (or a subclass mixing in MemtreeTrainerMixin), or "
                "call MemtreeCallback().install(trainer) before train()"
            )


class MemtreeTrainerMixin:
    """Mix into a ``Trainer`` (first: ``class T(MemtreeTrainerMixin, Trainer)``) to keep its
    checkpoints as memtree trees (see the module docstring)."""

    # -- options and what is supported ---------------------------------------------------------

    def _memtree(self) -> MemtreeCallback:
        handler = self.callback_handler  # type: ignore[attr-defined]
        found = [cb for cb in handler.callbacks if isinstance(cb, MemtreeCallback)]
        if not found:
            found = [MemtreeCallback()]
            self.add_callback(found[0])  # type: ignore[attr-defined]
        found[0].bound = True
        return found[0]

    def _memtree_check_supported(self) -> None:
        t: Any = self
        refused = [
            name
            for name, on in (
                ("DeepSpeed", t.is_deepspeed_enabled),
                ("FSDP", t.is_fsdp_enabled),
                ("several processes", t.args.world_size > 1),
                ("push_to_hub (export a step with export_pretrained, then upload it)", t.args.push_to_hub),
            )
            if on
        ]
        from transformers.utils.import_utils import is_sagemaker_mp_enabled, is_torch_xla_available

        refused += [n for n, on in (("XLA", is_torch_xla_available()), ("SageMaker", is_sagemaker_mp_enabled())) if on]
        if refused:
            raise InvalidArgumentError(
                f"memtree checkpoints of a Trainer support one process on CPU or one GPU; this Trainer uses "
                f"{', '.join(refused)}: use the plain Trainer for it"
            )

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` (``True``: the newest in ``output_dir``)
        must be a memtree checkpoint, checked before training starts.

        Raises:
            CheckpointNotFoundError: no checkpoint at the path, or one the plain Trainer wrote.
        """
        t: Any = self
        self._memtree()
        if resume_from_checkpoint is True:
            found = None
            if os.path.isdir(t.args.output_dir):
                found = get_last_checkpoint(t.args.output_dir)  # type: ignore[no-untyped-call]
            if found is None:
                raise CheckpointNotFoundError(f"no checkpoint in {t.args.output_dir} to resume from")
            resume_from_checkpoint = found
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            resume_from_checkpoint = _check_checkpoint(os.fspath(resume_from_checkpoint))
        if resume_from_checkpoint:
            self._memtree_check_supported()
        return super().train(resume_from_checkpoint, *args, **kwargs)  # type: ignore[misc]

    # -- saving --------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        t: Any = self
        options = self._memtree()
        self._memtree_check_supported()
        run_dir = t._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{t.state.global_step}")
        if t.hp_search_backend is None and trial is None:
            t.store_flos()
        if t.args.save_strategy in ("steps", "epoch", "best") and t.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{t.state.best_global_step}")
            if os.path.exists(best) or best == output_dir:
                t.state.best_model_checkpoint = best
        state = {"model": t.model.state_dict()}
        if not t.args.save_only_model:
            state |= {"optimizer": t.optimizer.state_dict(), "scheduler": t.lr_scheduler.state_dict(), "rng": _rng_state()}
            scaler = getattr(t.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler.state_dict()
        for cb in [cb for cb in t.callback_handler.callbacks + [t.control] if _exportable(cb)]:
            name = cb.__class__.__name__
            if isinstance(t.state.stateful_callbacks.get(name), list):
                t.state.stateful_callbacks[name].append(cb.state())
            else:
                t.state.stateful_callbacks[name] = cb.state()
        previous = [p for p in reversed(sort_checkpoints(run_dir)) if p != output_dir] if os.path.isdir(run_dir) else []
        link_from = next((os.path.join(p, STATE_DIR) for p in previous if is_checkpoint(p)), None)
        with staged_directory(output_dir, existsok=True, fsync=options.fsync, replaceable=is_checkpoint) as staging:
            save_tree(
                os.path.join(staging, STATE_DIR), state, link_from=link_from if options.incremental else None,
                fsync=options.fsync, allow_pickle=options.allow_pickle, pickle_hint=_PICKLE_HINT,
            )
            _save_json_files(t, staging, options.fsync)
        self._memtree_rotate(run_dir)

    def _memtree_rotate(self, run_dir: str) -> None:
        """The Trainer's ``save_total_limit`` rule (the newest and the best are kept), each
        deletion atomic."""
        t: Any = self
        limit = t.args.save_total_limit
        if limit is None or limit <= 0:
            return
        checkpoints = [os.path.normpath(p) for p in sort_checkpoints(run_dir)]
        protected = {checkpoints[-1]} if checkpoints else set()
        if t.state.best_model_checkpoint is not None:
            protected.add(os.path.normpath(t.state.best_model_checkpoint))
        remaining = len(checkpoints)
        for path in checkpoints:
            if remaining <= max(limit, len(protected)):
                break
            if path not in protected:
                remove_tree(path, replaceable=is_checkpoint)
                remaining -= 1

    # -- resuming ------------------------------------------------------------------------------

    def _memtree_load(self, checkpoint: str, keys: list[str]) -> dict[str, Any]:
        options = self._memtree()
        return load_tree(
            os.path.join(_check_checkpoint(checkpoint), STATE_DIR), keys=keys, allow_pickle=options.allow_pickle,
            verify=options.verify, pickle_hint=_UNPICKLE_HINT,
        )

    def _memtree_load_model(self, checkpoint: str, model: Any) -> None:
        weights = self._memtree_load(checkpoint, ["model"]).get("model")
        if weights is None:
            raise CheckpointNotFoundError(f"{checkpoint} holds no model weights")
        try:
            model.load_state_dict(weights, strict=True)
        except RuntimeError as err:
            raise ShapeMismatchError(f"the checkpoint {checkpoint} does not fit this model: {err}") from err

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self._memtree_load_model(resume_from_checkpoint, model if model is not None else self.model)  # type: ignore[attr-defined]

    def _load_best_model(self) -> None:
        t: Any = self
        self._memtree_load_model(t.state.best_model_checkpoint, t.model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        t: Any = self
        if checkpoint is None:
            return
        state = self._memtree_load(checkpoint, ["optimizer", "scheduler"])
        if "optimizer" in state:  # absent: saved with save_only_model (as the Trainer, skip)
            t.optimizer.load_state_dict(state["optimizer"])
            t.lr_scheduler.load_state_dict(state["scheduler"])

    def _load_scaler(self, checkpoint: str | None) -> None:
        t: Any = self
        if checkpoint is None:
            return
        state = self._memtree_load(checkpoint, ["scaler"])
        if "scaler" in state:
            t.accelerator.scaler.load_state_dict(state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        state = self._memtree_load(checkpoint, ["rng"])
        if "rng" in state:
            _set_rng_state(state["rng"])


class MemtreeTrainer(MemtreeTrainerMixin, Trainer):
    """``transformers.Trainer`` whose checkpoints are memtree trees (see the module docstring)."""


def _exportable(callback: Any) -> bool:
    from transformers.trainer_callback import ExportableState

    return isinstance(callback, ExportableState)


def _rng_state() -> dict[str, Any]:
    """The generators the Trainer saves (Python, numpy, torch CPU, CUDA when there is one)."""
    state: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.random.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state(state["cuda"])


def _save_json_files(trainer: Any, directory: str, fsync: bool) -> None:
    """The Trainer's JSON files of a checkpoint: its state, the model's configuration, the
    processing class's files (each fsynced with ``fsync``)."""
    trainer.state.save_to_json(os.path.join(directory, TRAINER_STATE_NAME))
    model = trainer.model
    if hasattr(model, "config") and hasattr(model.config, "save_pretrained"):
        model.config.save_pretrained(directory)
    generation = getattr(model, "generation_config", None)
    if generation is not None and hasattr(model, "can_generate") and model.can_generate():
        generation.save_pretrained(directory)
    if trainer.processing_class is not None and hasattr(trainer.processing_class, "save_pretrained"):
        trainer.processing_class.save_pretrained(directory)
    if fsync:
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)


def export_pretrained(
    checkpoint: str | os.PathLike[str], directory: str | os.PathLike[str], *, max_shard_size: int | str = "5GB"
) -> str:
    """Write a checkpoint's model as a Hugging Face model directory (``from_pretrained`` reads it).

    The weights become ``model.safetensors`` (shards and their index above ``max_shard_size``),
    read from ``state/`` one tensor at a time; ``config.json`` (and ``generation_config.json``)
    are copied. The directory is published atomically.

    Args:
        checkpoint: a checkpoint directory written by :class:`MemtreeTrainerMixin`.
        directory: the model directory to create (it must not exist).
        max_shard_size: the largest shard, as ``save_pretrained`` takes it.

    Returns:
        ``directory``.

    Raises:
        CheckpointNotFoundError: ``checkpoint`` is not a memtree checkpoint.
        DestinationExistsError: ``directory`` exists.
    """
    src = _check_checkpoint(os.fspath(checkpoint))
    model = load_memmap(os.path.join(src, STATE_DIR), keys=["model"], mode="r", verify=True)["model"]
    names = list(model.keys())
    specs = [(k, tuple(model[k].shape), model[k].dtype) for k in names]
    dest = os.path.abspath(os.fspath(directory))
    with staged_directory(dest, existsok=False) as staging:
        weights = os.path.join(staging, "weights")
        write_model_directory(weights, specs, lambda k: model[k], max_shard_size=max_shard_size)
        for name in os.listdir(weights):
            os.rename(os.path.join(weights, name), os.path.join(staging, name))
        os.rmdir(weights)
        for name in ("config.json", "generation_config.json"):
            if os.path.isfile(os.path.join(src, name)):
                with open(os.path.join(src, name), "rb") as f, open(os.path.join(staging, name), "wb") as g:
                    g.write(f.read())
    return dest
