"""Tutorial 8 — Hugging Face Trainer checkpoints as memtree trees (MemtreeTrainer).

Run it:  python tutorials/08_trainer_checkpoints.py   (MEMTREE_TUTORIAL_FAST=1 for a small run)

What you will see (a GPT-2 built from a config: nothing is downloaded):
1. ``MemtreeTrainer`` (a ``Trainer``) with ``save_total_limit=2``: each ``checkpoint-<step>``
   holds the Trainer's JSON files and ``state/``, a memtree tree of the model, optimizer,
   scheduler and RNG states (no pickle), written atomically;
2. the frozen position embeddings are hard links shared by the checkpoints (a leaf of 64 KiB
   or more: smaller ones share a pack file, linked only while none of its leaves changes);
3. a run stopped at step 6 and resumed with ``train(resume_from_checkpoint=True)`` ends with the
   very weights and losses of a run that was never interrupted;
4. ``export_pretrained``: a step as a model directory that ``from_pretrained`` reads;
5. ``MemtreeCallback().install(trainer)`` gives a Trainer built elsewhere the same checkpoints.
The last line starts with "OK" (the test suite checks it).
"""

from __future__ import annotations

# --8<-- [start:setup]
import atexit
import os
import shutil
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the network (set before the import)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

try:
    import transformers  # noqa: E402
except ImportError:
    print("OK trainer checkpoints: skipped, the transformers package is not installed")
    sys.exit(0)

FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
work = tempfile.mkdtemp(prefix="memtree-tutorial-08-")
atexit.register(shutil.rmtree, work, ignore_errors=True)
# --8<-- [end:setup]

# --8<-- [start:train]
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

from memtree.integrations.transformers import MemtreeCallback, MemtreeTrainer, export_pretrained

# n_positions=1024 (GPT-2's): the frozen position embeddings (128 KiB or more) have a file of their
# own; leaves under 64 KiB share a pack, written again whenever one of them changes
config = GPT2Config(n_layer=1 if FAST else 4, n_embd=32 if FAST else 128, n_head=2, vocab_size=128, n_positions=1024)
g = torch.Generator().manual_seed(0)
texts = [torch.randint(0, 128, (32,), generator=g) for _ in range(24)]
dataset = [{"input_ids": t, "labels": t} for t in texts]


class StopAt(TrainerCallback):  # an interruption, for the demonstration
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = control.should_save = True


def trainer(out: str, cls=MemtreeTrainer, stop: int | None = None) -> Trainer:
    set_seed(0)
    model = GPT2LMHeadModel(config)
    model.transformer.wpe.requires_grad_(False)          # frozen position embeddings
    args = TrainingArguments(out, max_steps=10, save_steps=2, save_total_limit=2,
                             per_device_train_batch_size=4, logging_steps=1, seed=0,
                             report_to=[], use_cpu=True, disable_tqdm=True, log_level="error")
    t = cls(model=model, args=args, train_dataset=dataset, callbacks=[StopAt(stop)] if stop else [])
    t.remove_callback(transformers.PrinterCallback)       # keep this script's output short
    return t


out = os.path.join(work, "run")
trainer(out, stop=6).train()                              # stopped at step 6
print(sorted(os.listdir(out)))                            # save_total_limit=2
print(sorted(os.listdir(os.path.join(out, "checkpoint-6"))))
# --8<-- [end:train]
assert sorted(os.listdir(out)) == ["checkpoint-4", "checkpoint-6"]
print("1. checkpoint-4 and checkpoint-6: JSON files and a memtree tree each")

# --8<-- [start:links]
import memtree

inodes = {
    os.stat(memtree.load_memmap(os.path.join(out, name, "state"), mode="r")["model", "transformer.wpe.weight"].filename).st_ino
    for name in ("checkpoint-4", "checkpoint-6")
}
print(len(inodes), "file for the frozen embeddings of 2 checkpoints")
# --8<-- [end:links]
assert len(inodes) == 1
print("2. frozen weights are written once, hard-linked by the next checkpoints")

# --8<-- [start:resume]
resumed = trainer(out)
resumed.train(resume_from_checkpoint=True)                # from checkpoint-6
once = trainer(os.path.join(work, "once"), cls=Trainer)   # the plain Trainer, never stopped
once.train()
same = all(torch.equal(a, b) for a, b in zip(resumed.model.state_dict().values(), once.model.state_dict().values()))
losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (resumed, once)]
print("same weights:", same, "| same losses:", losses[0] == losses[1])
# --8<-- [end:resume]
assert same and losses[0] == losses[1]
print("3. resumed from checkpoint-6: bit for bit the uninterrupted run")

# --8<-- [start:export]
export = export_pretrained(os.path.join(out, "checkpoint-10"), os.path.join(work, "gpt2-export"))
hf = GPT2LMHeadModel.from_pretrained(export)
assert all(torch.equal(hf.state_dict()[k], v) for k, v in resumed.model.state_dict().items())
print(sorted(os.listdir(export)))
# --8<-- [end:export]
print("4. export_pretrained: from_pretrained reads the step")

# --8<-- [start:install]
built_elsewhere = trainer(os.path.join(work, "other"), cls=Trainer)
MemtreeCallback(fsync=True).install(built_elsewhere)      # now a MemtreeTrainer
built_elsewhere.train()
print(type(built_elsewhere).__name__, sorted(os.listdir(os.path.join(work, "other"))))
# --8<-- [end:install]
assert os.path.isdir(os.path.join(work, "other", "checkpoint-10", "state"))
print("5. install(): a Trainer built elsewhere writes memtree checkpoints")
print("OK trainer checkpoints: atomic incremental steps, bit-exact resume, export, install")
