"""Tutorial 2 — models: save once, load many times, into models that differ a bit.

Run it:  python tutorials/02_models_and_partial_loading.py   (MEMTREE_TUTORIAL_FAST=1 for a small run)

What you will see:
1. ``TensorTree.from_module(model).memmap(d)``: one file per parameter and buffer, nested by
   module path; the tied embedding/output weight is stored once (and the tie recorded);
2. ``empty_init`` + ``load_memmap(d).to_module(model)``: a model whose weights *are* the files,
   built and bound without allocating its weights (resident memory barely moves), same output,
   still tied;
3. a partial load into a modified model (the same backbone with a new classification head):
   ``load_into_module(..., strict=False)`` reports ``missing``/``unexpected``, ``init_missing``
   initialises the new head, ``keys=`` loads a sub-tree, and mismatches are clear errors;
4. fine-tuning the loaded model never changes the checkpoint (copy-on-write mapping), and the
   fine-tuned model is saved the same way.
The last line starts with "OK" (the test suite checks it).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import torch
from torch import nn

import memtree
from memtree import TensorTree, empty_init, init_missing, load_into_module, load_memmap

FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
VOCAB, D_MODEL, LAYERS = (500, 64, 2) if FAST else (8_000, 512, 6)


class Backbone(nn.Module):
    """Token embedding + transformer encoder + final norm: shared by both models below."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerEncoderLayer(D_MODEL, 8, 4 * D_MODEL, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(D_MODEL)

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.norm(self.encoder(self.embed(tokens)))


class LanguageModel(Backbone):
    """Predicts the next token; the output projection is tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight  # tied: one tensor, two names

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.features(tokens))


class Classifier(Backbone):
    """The same backbone with a new head: 3 classes from the mean of the features."""

    def __init__(self) -> None:
        super().__init__()
        self.classifier = nn.Linear(D_MODEL, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(tokens).mean(dim=1))


def rss() -> int:
    """Resident memory of this process, in bytes (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except OSError:
        return 0


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


workdir = tempfile.mkdtemp(prefix="memtree-models-")
print(f"working in {workdir}\n")
torch.manual_seed(0)
tokens = torch.randint(0, VOCAB, (2, 16))

# 1. Save: the tree's leaves are the model's own tensors; memmap writes one file per leaf.
lm = LanguageModel().eval()
n_params = sum(p.numel() for p in lm.parameters())
ckpt = os.path.join(workdir, "lm")
tree = TensorTree.from_module(lm)
tree.memmap(ckpt, num_threads=4)
files = [os.path.relpath(os.path.join(r, f), ckpt) for r, _, fs in os.walk(ckpt) for f in fs if f.endswith(".memmap")]
print(f"1. saved a {n_params:,}-parameter language model as {len(files)} leaf files under {ckpt}")
print(f"   e.g. {sorted(files)[:3]}")
print(f"   tied tensors, stored once: {tree['__tied__']}")
assert not any(f.startswith("lm_head") for f in files), "the tied output weight must not be stored twice"
print()

# 2. Reload into a model built without allocating its weights: the weights are the files.
with empty_init():
    LanguageModel()  # warm-up: torch imports its meta-device kernels on first use (~70 MiB)
before = rss()
with empty_init():
    lm2 = LanguageModel().eval()
print(f"2. built under empty_init: embed.weight is on {lm2.embed.weight.device}")
loaded = load_memmap(ckpt)  # maps the files: no data read
loaded.to_module(lm2)
growth = rss() - before
weights_bytes = sum(p.numel() * p.element_size() for p in lm2.parameters())
print(f"   bound {mib(weights_bytes)} of weights; resident memory grew by {mib(growth)}")
assert lm2.lm_head.weight is lm2.embed.weight, "the tie must be restored"
assert lm2.embed.weight.data_ptr() == loaded["embed", "weight"].data_ptr(), "weights are the mapped files"
with torch.no_grad():
    same = torch.equal(lm2(tokens), lm(tokens))
print(f"   still tied: {lm2.lm_head.weight is lm2.embed.weight}; output equals the original: {same}")
assert same
print()

# 3. A modified model: same backbone, new head. Load what fits, initialise the rest.
with empty_init():
    clf = Classifier().eval()
try:
    load_into_module(clf, ckpt)  # strict=True: refuses, and changes nothing
except memtree.MemtreeKeyError as err:
    print(f"3. strict load refused: {str(err)[:150]}...")
result = load_into_module(clf, ckpt, strict=False)
print(f"   strict=False: missing={result.missing} unexpected={result.unexpected}")
assert result.missing == ["classifier.weight", "classifier.bias"] and result.unexpected == []
print(f"   new head still on {clf.classifier.weight.device}; init_missing -> {init_missing(clf)}")
with torch.no_grad():
    logits = clf(tokens)
    print(f"   classifier output {list(logits.shape)}; backbone features equal the LM's: "
          f"{torch.equal(clf.features(tokens), lm.features(tokens))}")

# keys=: only a sub-tree (dotted prefixes or tuples), e.g. the embedding and the first layer.
with empty_init():
    partial = Classifier()
result = load_into_module(partial, ckpt, keys=["embed", ("encoder", "layers", "0")])
on_meta = sum(p.is_meta for p in partial.parameters())
print(f"   keys=['embed', ('encoder', 'layers', '0')] -> {result}; {on_meta} tensors left on meta")

# A model whose sizes differ: a clear error naming the key and both shapes, nothing changed.
class Wider(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, D_MODEL)


try:
    load_into_module(Wider(), ckpt, strict=False)
except memtree.ShapeMismatchError as err:
    print(f"   mismatch: {str(err)[:120]}...")
print()

# 4. Fine-tune: the bound weights are copy-on-write pages of the files; the checkpoint stays.
clf.train()
opt = torch.optim.SGD(clf.parameters(), lr=0.05)
labels = torch.tensor([0, 2])
for step in range(3):
    loss = nn.functional.cross_entropy(clf(tokens), labels)
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"4. fine-tuned 3 steps (loss {loss.item():.3f})")
unchanged = torch.equal(load_memmap(ckpt)["embed", "weight"], lm.embed.weight)
print(f"   checkpoint unchanged on disk: {unchanged}")
assert unchanged
tuned = os.path.join(workdir, "classifier")
TensorTree.from_module(clf).memmap(tuned)
check = Classifier()
load_into_module(check, tuned)
print(f"   saved the fine-tuned classifier to {tuned} and loaded it back: "
      f"{torch.equal(check.classifier.weight, clf.classifier.weight)}")

shutil.rmtree(workdir)
print(f"OK models: saved, reloaded bit-exactly with ties, and partially loaded a {n_params:,}-parameter model")
