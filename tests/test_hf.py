"""Sharded checkpoints as Hugging Face ships them: shard indexes, model directories, the cache.

The first part builds indexes by hand (no extra package) to check the validation of hostile
ones; the second saves small ``transformers`` models (GPT-2 with tied embeddings, Llama, BERT;
built from configs, nothing downloaded) and loads them back with ``load_into_module``.
"""

from __future__ import annotations

import json
import os
import string
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import memtree
from memtree import (
    CheckpointFormatError,
    LoadResult,
    MemtreeError,
    MemtreeKeyError,
    TensorTree,
    UnsafePathError,
    empty_init,
    load_into_module,
)
from memtree.interop import open_checkpoint, save_safetensors
from memtree.format.names import TIED_KEY
from memtree.interop.sharded import MAX_INDEX_BYTES

# offline, quiet: set before transformers / huggingface_hub are imported (they read them once)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"


# ------------------------------------------------------------------ hand-made shard indexes
def _write_index(directory: Any, weight_map: dict[str, Any], name: str = SAFE_INDEX) -> str:
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return path


def _two_shards(directory: Any, fmt: str = "safetensors") -> dict[str, torch.Tensor]:
    """Two shards (``a``,``b`` | ``c``) and their index in ``directory``; returns the tensors."""
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 3), "c": torch.arange(6, dtype=torch.int64)}
    parts = {"1": {"a": tensors["a"], "b": tensors["b"]}, "2": {"c": tensors["c"]}}
    weight_map = {}
    for n, part in parts.items():
        if fmt == "safetensors":
            shard = f"model-0000{n}-of-00002.safetensors"
            save_safetensors(part, os.path.join(directory, shard))
        else:
            shard = f"pytorch_model-0000{n}-of-00002.bin"
            torch.save(part, os.path.join(directory, shard))
        weight_map.update({k: shard for k in part})
    _write_index(directory, weight_map, SAFE_INDEX if fmt == "safetensors" else BIN_INDEX)
    return tensors


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_an_index_or_its_directory_opens_every_shard_as_one_lazy_mapping(tmp_path, fmt) -> None:
    tensors = _two_shards(tmp_path, fmt)
    index = os.path.join(tmp_path, SAFE_INDEX if fmt == "safetensors" else BIN_INDEX)
    for path in (tmp_path, index):
        ckpt = open_checkpoint(path)
        assert ckpt.format == fmt and ckpt.path == index and len(ckpt.files) == 2
        assert sorted(ckpt) == ["a", "b", "c"] and len(ckpt) == 3
        assert ckpt.tensor_spec("b") == (torch.Size([2, 3]), torch.float32)
        assert all(torch.equal(ckpt[k], v) for k, v in tensors.items())
        with pytest.raises(MemtreeKeyError, match="'z' is not a tensor"):
            ckpt.tensor_spec("z")
        ckpt.close()


def test_a_directory_prefers_safetensors_and_a_single_file_works(tmp_path) -> None:
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    assert open_checkpoint(tmp_path).format == "torch"
    save_safetensors({"w": torch.ones(2)}, tmp_path / "model.safetensors")
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.format == "safetensors" and ckpt["w"].tolist() == [1.0, 1.0]


def test_load_into_module_takes_a_model_directory(tmp_path) -> None:
    _two_shards(tmp_path)
    module = torch.nn.Module()
    for k in ("a", "b", "c"):
        module.register_buffer(k, torch.zeros_like(open_checkpoint(tmp_path)[k]))
    assert load_into_module(module, tmp_path) == LoadResult([], [])
    assert torch.equal(module.b, torch.ones(2, 3))


def test_a_directory_without_a_checkpoint_is_refused_naming_what_it_looked_for(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointFormatError, match=r"holds none of model\.safetensors\.index\.json"):
        open_checkpoint(tmp_path)
    with pytest.raises(memtree.NotAMemtreeError):  # load_into_module: neither memtree nor a model dir
        load_into_module(torch.nn.Linear(1, 1), tmp_path)


@pytest.mark.parametrize(
    "shard",
    ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors", "a\\b", "./x", "", "a//b"],
)
def test_shard_names_that_could_leave_the_directory_are_refused(tmp_path, shard) -> None:
    d = tmp_path / "model"
    d.mkdir()
    save_safetensors({"w": torch.zeros(1)}, tmp_path / "outside.safetensors")
    _write_index(d, {"w": shard})
    with pytest.raises(UnsafePathError, match="relative path of plain names"):
        open_checkpoint(d)


def test_a_symbolic_link_out_of_the_directory_is_refused(tmp_path) -> None:
    d = tmp_path / "model"
    (d / "sub").mkdir(parents=True)
    save_safetensors({"w": torch.zeros(1)}, tmp_path / "secret.safetensors")
    os.symlink(tmp_path / "secret.safetensors", d / "shard.safetensors")
    os.symlink(tmp_path, d / "sub" / "up")
    for shard in ("shard.safetensors", "sub/up/secret.safetensors"):
        _write_index(d, {"w": shard})
        with pytest.raises(UnsafePathError, match="outside .*symbolic link"):
            open_checkpoint(d)
    os.symlink("../model-real.safetensors", d / "sub" / "inside.safetensors")  # a link inside is fine
    save_safetensors({"w": torch.ones(1)}, d / "model-real.safetensors")
    _write_index(d, {"w": "sub/inside.safetensors"})
    assert open_checkpoint(d)["w"].tolist() == [1.0]


def test_the_hugging_face_cache_layout_links_into_blobs(tmp_path) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abc"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    save_safetensors({"w": torch.arange(3.0)}, blobs / "e3b0c442")
    (blobs / "9f86d081").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    os.symlink("../../blobs/e3b0c442", snap / "model-00001-of-00001.safetensors")
    os.symlink("../../blobs/9f86d081", snap / SAFE_INDEX)
    assert open_checkpoint(snap)["w"].tolist() == [0.0, 1.0, 2.0]
    module = torch.nn.Module()
    module.register_buffer("w", torch.zeros(3))
    assert load_into_module(module, snap) == LoadResult([], []) and module.w.tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "not valid UTF-8 JSON"),
        (b"\xff\xfe{}", "not valid UTF-8 JSON"),
        (b"[1, 2]", "weight_map"),
        (b'{"weight_map": {}}', "weight_map"),
        (b'{"weight_map": ["a"]}', "weight_map"),
        (b'{"weight_map": {"a": 3}}', "maps to 3"),
        (b'{"weight_map": {"": "x.safetensors"}}', "weight_map entries"),
        (b'{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', "the index repeats the key 'a'"),
        (b'{"metadata": 3, "weight_map": {"a": "model-00001-of-00002.safetensors"}}', "metadata"),
    ],
)
def test_a_malformed_index_is_refused(tmp_path, content, message) -> None:
    _two_shards(tmp_path)
    (tmp_path / SAFE_INDEX).write_bytes(content)
    with pytest.raises(CheckpointFormatError, match=message):
        open_checkpoint(tmp_path)


def test_an_index_too_large_is_refused_before_it_is_read(tmp_path) -> None:
    with open(tmp_path / SAFE_INDEX, "wb") as f:
        f.truncate(MAX_INDEX_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(CheckpointFormatError, match="more than"):
        open_checkpoint(tmp_path)


def test_a_listed_tensor_missing_from_its_shard_is_refused_and_nothing_stays_open(tmp_path) -> None:
    _two_shards(tmp_path)
    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    index["weight_map"]["ghost"] = "model-00002-of-00002.safetensors"
    (tmp_path / SAFE_INDEX).write_text(json.dumps(index))
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with pytest.raises(CheckpointFormatError, match=r"1 tensors in 'model-00002-of-00002.safetensors'.*'ghost'"):
        open_checkpoint(tmp_path)
    if fds is not None:
        assert len(os.listdir("/proc/self/fd")) == fds


def test_a_missing_shard_and_mixed_formats_are_refused(tmp_path) -> None:
    _two_shards(tmp_path)
    torch.save({"d": torch.zeros(1)}, tmp_path / "extra.bin")
    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": dict(index["weight_map"], d="extra.bin")}))
    with pytest.raises(CheckpointFormatError, match="mixes safetensors and torch.save"):
        open_checkpoint(tmp_path)
    (tmp_path / SAFE_INDEX).write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(MemtreeError, match="gone.safetensors does not exist"):
        open_checkpoint(tmp_path)


_PIECES = ["..", ".", "", "sub", "shard.safetensors", "outside.safetensors", "/", "\\", "\0", "\ud800", "link"]


@st.composite
def _shard_names(draw: Any) -> str:
    if draw(st.booleans()):
        return draw(st.text(alphabet=st.sampled_from(string.printable + "\ud800é"), max_size=40))
    return "/".join(draw(st.lists(st.sampled_from(_PIECES), min_size=1, max_size=5)))


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Any:
    root = tmp_path_factory.mktemp("fuzz")
    d = root / "model"
    (d / "sub").mkdir(parents=True)
    for where in (root / "outside.safetensors", d / "shard.safetensors", d / "sub" / "shard.safetensors"):
        save_safetensors({"w": torch.zeros(1)}, where)
    os.symlink(root, d / "link")  # a way out, if links were followed blindly
    return d


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=_shard_names())
def test_fuzzed_shard_names_never_reach_outside_the_directory(fuzz_dir, name) -> None:
    index = os.path.join(fuzz_dir, SAFE_INDEX)
    with open(index, "w") as f:
        json.dump({"weight_map": {"w": name}}, f)
    try:
        ckpt = open_checkpoint(index)
    except MemtreeError:
        return
    real = os.path.realpath(fuzz_dir)
    assert all(os.path.commonpath([f, real]) == real for f in ckpt.files), (name, ckpt.files)
    ckpt.close()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzzed_index_bytes_raise_only_memtree_errors(fuzz_dir, data) -> None:
    good = json.dumps({"metadata": {"total_size": 4}, "weight_map": {"w": "shard.safetensors"}}).encode()
    mutated = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(mutated) - 1))
        mutated[i] = data.draw(st.integers(0, 255))
    index = os.path.join(fuzz_dir, SAFE_INDEX)
    with open(index, "wb") as f:
        f.write(bytes(mutated))
    try:
        open_checkpoint(index).close()
    except MemtreeError:
        pass


# ------------------------------------------------------------------- real transformers models
@pytest.fixture(scope="module")
def tf() -> Any:
    return pytest.importorskip("transformers")


def _gpt2(tf: Any, head: bool = True) -> Any:
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32, bos_token_id=0, eos_token_id=0)
    return (tf.GPT2LMHeadModel if head else tf.GPT2Model)(cfg).eval()


def _llama(tf: Any, head: bool = True) -> Any:
    cfg = tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )
    return (tf.LlamaForCausalLM if head else tf.LlamaModel)(cfg).eval()


def _bert(tf: Any, head: bool = True, labels: int = 2) -> Any:
    cfg = tf.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64, num_labels=labels, pad_token_id=0,
    )
    return (tf.BertForSequenceClassification if head else tf.BertModel)(cfg).eval()


MODELS = {"gpt2": _gpt2, "llama": _llama, "bert": _bert}
_IDS = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))


def _out(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=_IDS)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _build(tf: Any, arch: str, seed: int, meta: bool = False, **kw: Any) -> Any:
    torch.manual_seed(seed)
    if meta:
        with empty_init():
            return MODELS[arch](tf, **kw)
    return MODELS[arch](tf, **kw)


@pytest.mark.parametrize("meta", [False, True], ids=["live", "empty_init"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_sharded_safetensors_from_save_pretrained_load_into_a_fresh_model(tf, tmp_path, arch, meta) -> None:
    saved = _build(tf, arch, seed=0)
    saved.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / SAFE_INDEX).exists()
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    fresh = _build(tf, arch, seed=1, meta=meta)
    if not meta:
        assert not torch.equal(_out(fresh), _out(saved))
    params = {n: p for n, p in fresh.named_parameters()}
    assert load_into_module(fresh, tmp_path) == LoadResult([], [])
    assert torch.equal(_out(fresh), _out(saved))
    if not meta:  # filled in place: the model's own parameter objects
        assert all(p is params[n] for n, p in fresh.named_parameters())
    if arch == "gpt2":  # tied embeddings: stored once, still tied
        assert fresh.lm_head.weight is fresh.transformer.wte.weight


@pytest.mark.parametrize("max_shard_size", ["50KB", "1GB"], ids=["sharded", "single"])
def test_torch_bin_checkpoints_load(tf, tmp_path, max_shard_size) -> None:
    from huggingface_hub import save_torch_state_dict  # transformers 5 writes safetensors only

    for arch in ("gpt2", "llama"):
        d = tmp_path / arch
        d.mkdir()
        saved = _build(tf, arch, seed=0)
        save_torch_state_dict(saved.state_dict(), d, safe_serialization=False, max_shard_size=max_shard_size)
        expected = BIN_INDEX if max_shard_size == "50KB" else "pytorch_model.bin"
        assert (d / expected).exists()
        fresh = _build(tf, arch, seed=1)
        assert load_into_module(fresh, d) == LoadResult([], [])
        assert torch.equal(_out(fresh), _out(saved))


def test_a_single_model_safetensors_loads(tf, tmp_path) -> None:
    saved = _build(tf, "llama", seed=0)
    saved.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not (tmp_path / SAFE_INDEX).exists()
    fresh = _build(tf, "llama", seed=1, meta=True)
    assert load_into_module(fresh, tmp_path / "model.safetensors") == LoadResult([], [])
    assert torch.equal(_out(fresh), _out(saved))


def test_prefix_between_gpt2_task_and_base_models(tf, tmp_path) -> None:
    lm = _build(tf, "gpt2", seed=0)
    lm.save_pretrained(tmp_path / "lm", max_shard_size="50KB")
    base = _build(tf, "gpt2", seed=1, head=False)
    with pytest.raises(MemtreeKeyError, match=r"pass prefix='transformer\.'"):
        load_into_module(base, tmp_path / "lm")
    assert load_into_module(base, tmp_path / "lm", prefix="transformer.") == LoadResult([], [])
    assert torch.equal(_out(base), _out(lm.transformer))
    base.save_pretrained(tmp_path / "base", max_shard_size="50KB")
    lm2 = _build(tf, "gpt2", seed=2)
    assert load_into_module(lm2, tmp_path / "base", prefix="transformer") == LoadResult([], [])
    assert lm2.lm_head.weight is lm2.transformer.wte.weight  # the head is the tied embedding
    assert torch.equal(_out(lm2), _out(lm))


def test_prefix_from_a_llama_causal_lm_into_its_base_model(tf, tmp_path) -> None:
    lm = _build(tf, "llama", seed=0)
    lm.save_pretrained(tmp_path, max_shard_size="50KB")
    base = _build(tf, "llama", seed=1, head=False, meta=True)
    result = load_into_module(base, tmp_path, prefix="model.", strict=False)
    assert result == LoadResult([], ["lm_head.weight"])
    assert torch.equal(_out(base), _out(lm.model))


def test_bert_base_into_a_classifier_then_a_new_number_of_labels(tf, tmp_path) -> None:
    base = _build(tf, "bert", seed=0, head=False)
    base.save_pretrained(tmp_path / "base", max_shard_size="50KB")
    clf = _build(tf, "bert", seed=1)
    result = load_into_module(clf, tmp_path / "base", prefix="bert.", strict=False)
    assert result == LoadResult(["classifier.weight", "classifier.bias"], [])
    with torch.no_grad():
        assert torch.equal(clf.bert(input_ids=_IDS).last_hidden_state, base(input_ids=_IDS).last_hidden_state)
    clf.save_pretrained(tmp_path / "clf", max_shard_size="50KB")
    five = _build(tf, "bert", seed=2, labels=5)
    head = five.classifier.weight.detach().clone()
    result = load_into_module(five, tmp_path / "clf", ignore_mismatched=True)
    assert result.mismatched == ["classifier.weight", "classifier.bias"] and list(result) == [[], []]
    assert torch.equal(five.classifier.weight, head)
    assert torch.equal(five.bert.pooler.dense.weight, clf.bert.pooler.dense.weight)


def test_a_bf16_checkpoint_into_an_fp32_model_with_dtype(tf, tmp_path) -> None:
    saved = _build(tf, "llama", seed=0).to(torch.bfloat16)
    saved.save_pretrained(tmp_path, max_shard_size="50KB")
    reference = _build(tf, "llama", seed=1)
    reference.load_state_dict({k: v.float() for k, v in saved.state_dict().items()})
    fresh = _build(tf, "llama", seed=2)
    assert load_into_module(fresh, tmp_path, dtype=torch.float32) == LoadResult([], [])
    assert fresh.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(_out(fresh), _out(reference))


# ------------------------------------------------------------- export for Hugging Face
_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForSequenceClassification"}


@pytest.mark.parametrize("arch", list(MODELS))
def test_a_tree_from_module_exported_to_safetensors_loads_with_from_pretrained(tf, tmp_path, arch) -> None:
    saved = _build(tf, arch, seed=0)
    tree = TensorTree.from_module(saved)
    if arch == "gpt2":  # the tie is recorded, the head stored once under the embedding's name
        assert tree[TIED_KEY] == {"lm_head.weight": "transformer.wte.weight"}
    saved.config.save_pretrained(tmp_path)
    save_safetensors(tree, tmp_path / "model.safetensors", metadata={"format": "pt"})
    keys = open_checkpoint(tmp_path).keys()
    assert TIED_KEY not in keys and ("lm_head.weight" in keys) == (arch == "llama")  # bert: no head
    loaded, info = getattr(tf, _CLASSES[arch]).from_pretrained(tmp_path, output_loading_info=True)
    assert all(not info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(_out(loaded.eval()), _out(saved))
    if arch == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight
    # and back into memtree: live (filled in place) and under empty_init (bound), tied again
    for meta in (False, True):
        fresh = _build(tf, arch, seed=1, meta=meta)
        assert load_into_module(fresh, tmp_path) == LoadResult([], [])
        assert torch.equal(_out(fresh), _out(saved))
        if arch == "gpt2":
            assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_a_tied_export_round_trips_through_to_module_and_a_memtree_directory(tf, tmp_path) -> None:
    saved = _build(tf, "gpt2", seed=0)
    save_safetensors(TensorTree.from_module(saved), tmp_path / "model.safetensors")
    ckpt = open_checkpoint(tmp_path / "model.safetensors")
    with empty_init():
        fresh = _build(tf, "gpt2", seed=1)
    TensorTree({k: ckpt[k] for k in ckpt}).to_module(fresh)
    assert fresh.lm_head.weight is fresh.transformer.wte.weight
    assert torch.equal(_out(fresh), _out(saved))
    tree = TensorTree.from_module(fresh)  # the same tie record again
    tree.memmap(tmp_path / "mt")
    save_safetensors(memtree.load_memmap(tmp_path / "mt"), tmp_path / "again.safetensors")
    assert (tmp_path / "again.safetensors").read_bytes() == (tmp_path / "model.safetensors").read_bytes()


@pytest.mark.parametrize("arch", list(MODELS))
def test_save_pretrained_shards_open_as_a_tree_and_bind_under_empty_init(tf, tmp_path, arch) -> None:
    saved = _build(tf, arch, seed=0)
    saved.save_pretrained(tmp_path, max_shard_size="50KB")
    ckpt = open_checkpoint(tmp_path)
    assert len(ckpt.files) > 1
    with empty_init():
        fresh = MODELS[arch](tf)
    assert all(p.is_meta for p in fresh.parameters())
    TensorTree({k: ckpt[k] for k in ckpt}).to_module(fresh)
    assert not any(p.is_meta for p in fresh.parameters())
    assert torch.equal(_out(fresh), _out(saved))
    if arch == "gpt2":
        assert fresh.lm_head.weight is fresh.transformer.wte.weight


def test_a_malformed_tie_record_is_not_dropped_silently(tmp_path) -> None:
    with pytest.raises(memtree.NonTensorValueError, match="__tied__"):
        save_safetensors({"w": torch.zeros(1), TIED_KEY: {"a": 3}}, tmp_path / "x.safetensors")
    save_safetensors({"w": torch.zeros(1), TIED_KEY: {"v": "w"}}, tmp_path / "y.safetensors")
    assert list(open_checkpoint(tmp_path / "y.safetensors")) == ["w"]
