"""Tutorial 6 — Hugging Face transformers: memtree checkpoints of transformers models, both ways.

Run it:  python tutorials/06_transformers.py   (MEMTREE_TUTORIAL_FAST=1 for a small run)

What you will see (a GPT-2 built from a config: nothing is downloaded):
1. ``TensorTree.from_module(model).memmap(d)``: one file per tensor, the tied embedding and
   output projection stored once;
2. reload under ``empty_init``: the model is built without allocating (or initialising) its
   weights, then bound to the files (zero-copy); same logits, still tied;
3. a sharded Hugging Face checkpoint (``save_pretrained(max_shard_size=...)``) loads with
   ``load_into_module`` from its directory, in place into a live model (its optimizer keeps
   working) or bound into an ``empty_init`` one;
4. key prefixes: the language model's checkpoint into the base ``GPT2Model``, and back;
5. export: ``save_safetensors`` writes a ``model.safetensors`` that ``from_pretrained`` reads.
The last line starts with "OK" (the test suite checks it).
"""

from __future__ import annotations

# --8<-- [start:setup]
import atexit
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the network (set before the import)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

try:
    import transformers  # noqa: F401,E402
except ImportError:
    print("OK transformers: skipped, the transformers package is not installed")
    sys.exit(0)

FAST = os.environ.get("MEMTREE_TUTORIAL_FAST") == "1"
work = tempfile.mkdtemp(prefix="memtree-tutorial-06-")
atexit.register(shutil.rmtree, work, ignore_errors=True)
# --8<-- [end:setup]

# --8<-- [start:build]
from memtree import TensorTree, empty_init, load_into_module, load_memmap
from memtree.interop import open_checkpoint, save_safetensors
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000, n_positions=128)
if not FAST:
    config = GPT2Config(n_layer=6, n_embd=512, n_head=8)   # 50M parameters
torch.manual_seed(0)
model = GPT2LMHeadModel(config).eval()
tokens = torch.randint(0, config.vocab_size, (1, 16))


def logits(m: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return m(input_ids=tokens).logits


tree = TensorTree.from_module(model)
print(tree["__tied__"])        # {'lm_head.weight': 'transformer.wte.weight'}: stored once
tree.memmap(os.path.join(work, "gpt2"))
# --8<-- [end:build]
assert tree["__tied__"] == {"lm_head.weight": "transformer.wte.weight"}
print(f"1. saved {len(list(tree.keys(include_nested=True, leaves_only=True)))} leaves to gpt2/")

# --8<-- [start:reload]
t0 = time.perf_counter()
with empty_init():                         # meta device: nothing allocated, nothing initialised
    fresh = GPT2LMHeadModel(config).eval()
load_memmap(os.path.join(work, "gpt2"), mode="r").to_module(fresh)   # the weights are the files
print(f"built and bound in {time.perf_counter() - t0:.3f} s")
assert torch.equal(logits(fresh), logits(model))
assert fresh.lm_head.weight is fresh.transformer.wte.weight          # still tied
# --8<-- [end:reload]
print("2. reloaded under empty_init: same logits, still tied")

# --8<-- [start:sharded]
hf_dir = os.path.join(work, "gpt2-hf")
model.save_pretrained(hf_dir, max_shard_size="200KB" if FAST else "50MB")
ckpt = open_checkpoint(hf_dir)             # the index and every shard, as one lazy mapping
print(ckpt.format, len(ckpt.files), "shards,", len(ckpt), "tensors")

live = GPT2LMHeadModel(config).eval()      # built the usual way...
opt = torch.optim.AdamW(live.parameters(), lr=1e-4)   # ...with its optimizer, then loaded:
params = list(live.parameters())
assert load_into_module(live, hf_dir) == ([], [])     # filled in place: same objects
assert all(p is q for p, q in zip(params, live.parameters()))
assert torch.equal(logits(live), logits(model))

with empty_init():
    bound = GPT2LMHeadModel(config).eval()
load_into_module(bound, hf_dir)            # meta: bound to the shards' tensors
assert torch.equal(logits(bound), logits(model))
# --8<-- [end:sharded]
assert len(ckpt.files) > 1
live.train()
loss = live(input_ids=tokens, labels=tokens).loss
loss.backward()
before = live.transformer.h[0].mlp.c_fc.weight.detach().clone()
opt.step()  # the optimizer built before the load trains the loaded parameters
assert not torch.equal(live.transformer.h[0].mlp.c_fc.weight, before)
print(f"3. sharded checkpoint ({len(ckpt.files)} shards) loaded in place and bound; the optimizer still trains")

# --8<-- [start:prefix]
base = GPT2Model(config).eval()            # names without "transformer."
load_into_module(base, hf_dir, prefix="transformer.")   # the head's lm_head.weight is a tie
with torch.no_grad():
    assert torch.equal(base(input_ids=tokens).last_hidden_state,
                       model.transformer(input_ids=tokens).last_hidden_state)
base.save_pretrained(os.path.join(work, "base"))
with empty_init():
    lm = GPT2LMHeadModel(config).eval()
load_into_module(lm, os.path.join(work, "base"), prefix="transformer.")  # added this way
assert torch.equal(logits(lm), logits(model))
# --8<-- [end:prefix]
print("4. prefix='transformer.' between GPT2LMHeadModel and GPT2Model, both ways")

# --8<-- [start:export]
export = os.path.join(work, "export")
os.makedirs(export)
model.config.save_pretrained(export)       # config.json
save_safetensors(load_memmap(os.path.join(work, "gpt2")), os.path.join(export, "model.safetensors"),
                 metadata={"format": "pt"})
hf = GPT2LMHeadModel.from_pretrained(export).eval()
assert torch.equal(logits(hf), logits(model))
assert hf.lm_head.weight is hf.transformer.wte.weight
# --8<-- [end:export]
print("5. exported to model.safetensors: from_pretrained reads it, same logits")
print("OK transformers: save, reload under empty_init, sharded checkpoints, prefixes, export")
