"""Tutorial 7 — Lightning: every checkpoint a memtree tree, with MemtreeCheckpointIO.

Run it:  python tutorials/07_lightning.py   (MEMTREE_TUTORIAL_FAST=1 for a small run)

What you will see:
1. ``Trainer(plugins=[MemtreeCheckpointIO()])`` with ``ModelCheckpoint(save_top_k=2,
   save_last=True)``: each checkpoint is a directory (one file per tensor), written atomically;
   the ones that leave the top 2 are removed;
2. a frozen layer's weights are hard links shared by every checkpoint (written once);
3. ``fit(ckpt_path="last")`` resumes: the run ends with the very weights of a run that was
   never interrupted;
4. ``MemtreeCheckpointIO().load_checkpoint(path)`` reads a checkpoint without a Trainer, as
   ``torch.load`` would (``ReduceLROnPlateau``'s ``inf`` included);
5. ``MemtreeCheckpointIO(blocking=False)``: saves in a background thread, durable before they
   count, the same checkpoints.
The last line starts with "OK" (the test suite checks it).
"""

from __future__ import annotations

# --8<-- [start:setup]
import atexit
import logging
import os
import shutil
import sys
import tempfile
import warnings

import torch

try:
    import lightning as L
except ImportError:
    print("OK lightning: skipped, the lightning package is not installed")
    sys.exit(0)

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
EPOCHS = 4 if FAST else 8
work = tempfile.mkdtemp(prefix="memtree-tutorial-07-")
atexit.register(shutil.rmtree, work, ignore_errors=True)
# --8<-- [end:setup]

# --8<-- [start:fit]
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from memtree.integrations.lightning import MemtreeCheckpointIO


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = torch.nn.Linear(8, 32).requires_grad_(False)   # frozen
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x):
        return self.head(torch.relu(self.embed(x)))

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.head.parameters(), lr=self.hparams.lr)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "val_loss"}}


g = torch.Generator().manual_seed(0)
x = torch.randn(64, 8, generator=g)
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


def fit(root: str, epochs: int, ckpt_path: str | None = None, io=None) -> Regressor:
    L.seed_everything(0, verbose=False)
    model = Regressor()
    trainer = L.Trainer(
        max_epochs=epochs, plugins=[io or MemtreeCheckpointIO()],
        callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), monitor="val_loss",
                                   save_top_k=2, save_last=True)],
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
        deterministic=True, default_root_dir=root,
    )
    trainer.fit(model, data, data, ckpt_path=ckpt_path)
    return model


run = os.path.join(work, "run")
fit(run, EPOCHS // 2)
names = sorted(os.listdir(os.path.join(run, "ckpt")))
print(names)                                             # top 2 and last.ckpt: directories
# --8<-- [end:fit]
assert len(names) == 3 and "last.ckpt" in names
assert all(os.path.isfile(os.path.join(run, "ckpt", n, "meta.json")) for n in names)
print(f"1. {len(names)} checkpoints, each a memtree tree")

# --8<-- [start:links]
import memtree

trees = [memtree.load_memmap(os.path.join(run, "ckpt", n), mode="r") for n in names]
frozen = {os.stat(t["state_dict"]["embed.weight"].filename).st_ino for t in trees}
print(len(frozen), "file for the frozen weights of", len(trees), "checkpoints")
# --8<-- [end:links]
assert len(frozen) == 1
print("2. the frozen layer is stored once, hard-linked into every checkpoint")

# --8<-- [start:resume]
resumed = fit(run, EPOCHS, ckpt_path="last")                  # picks up where it stopped
once = fit(os.path.join(work, "once"), EPOCHS)                # never interrupted
assert all(torch.equal(a, b) for a, b in zip(resumed.state_dict().values(), once.state_dict().values()))
# --8<-- [end:resume]
print("3. resumed from last.ckpt: the same weights as the uninterrupted run, bit for bit")

# --8<-- [start:load]
ckpt = MemtreeCheckpointIO().load_checkpoint(os.path.join(run, "ckpt", "last.ckpt"))
print(ckpt["epoch"], ckpt["hyper_parameters"], ckpt["lr_schedulers"][0]["mode_worse"])
fresh = Regressor(**ckpt["hyper_parameters"])
fresh.load_state_dict(ckpt["state_dict"])
# --8<-- [end:load]
assert ckpt["lr_schedulers"][0]["mode_worse"] == float("inf")
print("4. load_checkpoint without a Trainer: the dict torch.load would return")

# --8<-- [start:async]
background = fit(os.path.join(work, "async"), EPOCHS, io=MemtreeCheckpointIO(blocking=False))
assert all(torch.equal(a, b) for a, b in zip(background.state_dict().values(), once.state_dict().values()))
print(sorted(os.listdir(os.path.join(work, "async", "ckpt"))))
# --8<-- [end:async]
print("5. blocking=False: saved in the background, the same training and checkpoints")
print("OK lightning: atomic, incremental checkpoints; bit-exact resume; load without a Trainer; async")
