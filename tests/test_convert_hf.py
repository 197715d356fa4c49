"""``memtree convert`` to and from Hugging Face model directories: ``model.safetensors`` or shards
plus ``model.safetensors.index.json`` as ``save_pretrained`` writes them (checked against
``huggingface_hub``'s splitter and read by the real ``transformers.from_pretrained``); model
directories and shard indexes as sources; hostile indexes and destinations."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# offline, quiet: set before transformers / huggingface_hub are imported (they read them once)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import memtree  # noqa: E402
from memtree.cli import main  # noqa: E402
from memtree.interop import open_checkpoint, save_safetensors  # noqa: E402
from memtree.interop.sharded import parse_shard_size, plan_shards, write_model_directory  # noqa: E402

INDEX = "model.safetensors.index.json"


def _state(n: int = 6, numel: int = 1000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(numel + 100 * i, generator=g) for i in range(n)}


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


# -- the split, as huggingface_hub splits ---------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 50), max_size=25),
    limit=st.integers(1, 60),
)
def test_plan_matches_huggingface_hub(sizes: list[int], limit: int) -> None:
    hub = pytest.importorskip("huggingface_hub")
    names = [f"t{i}" for i in range(len(sizes))]
    state = dict(zip(names, sizes))
    split = hub.split_state_dict_into_shards_factory(
        state, get_storage_size=lambda n: n, filename_pattern="model{suffix}.safetensors",
        max_shard_size=limit,
    )
    ours = plan_shards(list(state.items()), limit)
    theirs = list(split.filename_to_tensors.values())
    assert ours == theirs or (not sizes and ours == [[]])


@pytest.mark.parametrize("text", ["5GB", "500MB", "1.5GB", "10KB", "2TB", "7 mb"])
def test_decimal_units_are_huggingface_hubs(text: str) -> None:
    hub = pytest.importorskip("huggingface_hub")
    assert parse_shard_size(text) == hub.serialization._base.parse_size_to_int(text)


def test_binary_units_and_bytes() -> None:
    assert parse_shard_size("4GiB") == 4 * 2**30 and parse_shard_size("1MiB") == 2**20
    assert parse_shard_size(123) == 123 and parse_shard_size("123") == 123


@pytest.mark.parametrize("bad", [0, -1, "0", "-5GB", "5XB", "", "GB", True, 1.5])
def test_bad_shard_sizes_are_refused_before_anything_is_read(tmp_path: Path, bad: Any, capsys) -> None:
    torch.save(_state(2), tmp_path / "m.pt")
    with pytest.raises(memtree.InvalidArgumentError, match="max_shard_size"):
        memtree.convert(tmp_path / "m.pt", tmp_path / "out", format="safetensors", max_shard_size=bad)
    if not isinstance(bad, (bool, float)):
        argv = ["convert", str(tmp_path / "m.pt"), str(tmp_path / "out"), "--format", "safetensors",
                f"--max-shard-size={bad}"]
        assert main(argv) == 1 and "max_shard_size" in capsys.readouterr().err
    assert _files(tmp_path) == ["m.pt"]


def test_max_shard_size_needs_a_model_directory(tmp_path: Path) -> None:
    torch.save(_state(2), tmp_path / "m.pt")
    for dst, fmt in (("x.safetensors", None), ("tree", None), ("td", "tensordict")):
        with pytest.raises(memtree.InvalidArgumentError, match="model directory"):
            memtree.convert(tmp_path / "m.pt", tmp_path / dst, format=fmt, max_shard_size="1MB")
    with pytest.raises(memtree.InvalidArgumentError, match="format must be one of"):
        memtree.convert(tmp_path / "m.pt", tmp_path / "x", format="onnx")


# -- writing model directories ---------------------------------------------------------------------
def test_shards_and_index_are_what_huggingface_writes(tmp_path: Path) -> None:
    hub = pytest.importorskip("huggingface_hub")
    state = _state()
    torch.save(state, tmp_path / "m.pt")
    limit = 10_000
    result = memtree.convert(tmp_path / "m.pt", tmp_path / "hf", format="safetensors", max_shard_size=limit)
    split = hub.split_torch_state_dict_into_shards(
        state, filename_pattern="model{suffix}.safetensors", max_shard_size=limit
    )
    assert split.is_sharded and result.files == list(split.filename_to_tensors)
    assert _files(tmp_path / "hf") == sorted([*split.filename_to_tensors, INDEX])
    index_text = (tmp_path / "hf" / INDEX).read_text()
    expected = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    assert index_text == json.dumps(expected, indent=2, sort_keys=True) + "\n"  # transformers' form
    for name, keys in split.filename_to_tensors.items():
        shard = open_checkpoint(tmp_path / "hf" / name)
        assert list(shard) == keys and shard.metadata == {"format": "pt"}
        assert os.path.getsize(tmp_path / "hf" / name) - 8 < limit + 1024  # data + header
        for k in keys:
            assert torch.equal(shard[k], state[k])
    assert result.tensors == len(state) and result.nbytes == split.metadata["total_size"]


def test_a_tensor_larger_than_the_limit_gets_its_own_shard(tmp_path: Path) -> None:
    state = {"small.a": torch.ones(10), "big": torch.ones(1000), "small.b": torch.ones(10)}
    files = write_model_directory(
        tmp_path / "hf", [(k, v.shape, v.dtype) for k, v in state.items()], state.__getitem__,
        max_shard_size=100,
    )
    assert files == {"model-00001-of-00002.safetensors": ["big"],
                     "model-00002-of-00002.safetensors": ["small.a", "small.b"]}


def test_everything_that_fits_is_one_model_safetensors(tmp_path: Path) -> None:
    torch.save(_state(3), tmp_path / "m.pt")
    result = memtree.convert(tmp_path / "m.pt", tmp_path / "hf", format="safetensors")
    assert result.files == ["model.safetensors"] and _files(tmp_path / "hf") == ["model.safetensors"]


def test_a_dtype_cast_counts_in_the_shard_sizes(tmp_path: Path) -> None:
    state = {"a": torch.ones(100), "b": torch.ones(100)}
    torch.save(state, tmp_path / "m.pt")
    fp32 = memtree.convert(tmp_path / "m.pt", tmp_path / "a", format="safetensors", max_shard_size=500)
    bf16 = memtree.convert(tmp_path / "m.pt", tmp_path / "b", format="safetensors", max_shard_size=500,
                           dtype="bfloat16")
    assert len(fp32.files) == 2 and bf16.files == ["model.safetensors"]


def test_existing_destinations_are_refused_or_replaced_whole(tmp_path: Path) -> None:
    torch.save(_state(4), tmp_path / "m.pt")
    hf = tmp_path / "hf"
    memtree.convert(tmp_path / "m.pt", hf, format="safetensors", max_shard_size=5000)
    before = _files(hf)
    with pytest.raises(memtree.DestinationExistsError, match="existsok"):
        memtree.convert(tmp_path / "m.pt", hf, format="safetensors")
    assert _files(hf) == before
    # replaced atomically: no stale shard of the previous split stays
    memtree.convert(tmp_path / "m.pt", hf, format="safetensors", existsok=True)
    assert _files(hf) == ["model.safetensors"]
    # a directory holding anything else (a config, the user's files) is never replaced
    (hf / "config.json").write_text("{}")
    with pytest.raises(memtree.DestinationExistsError, match="not a memtree directory"):
        memtree.convert(tmp_path / "m.pt", hf, format="safetensors", existsok=True)
    assert _files(hf) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if "memtree-tmp" in p.name]


def test_a_failure_mid_stream_leaves_no_directory(tmp_path: Path) -> None:
    torch.save(_state(4), tmp_path / "m.pt")
    data = (tmp_path / "m.pt").read_bytes()
    (tmp_path / "m.pt").write_bytes(data[: len(data) * 2 // 3])  # records of the last tensors gone
    with pytest.raises(memtree.MemtreeError):
        memtree.convert(tmp_path / "m.pt", tmp_path / "hf", format="safetensors", max_shard_size=5000)
    assert not (tmp_path / "hf").exists()
    assert not [p for p in tmp_path.iterdir() if "memtree-tmp" in p.name]


def test_tied_weights_are_written_once_as_huggingface_does(tmp_path: Path) -> None:
    w = torch.randn(10, 4)
    torch.save({"emb.weight": w, "head.weight": w, "head.bias": torch.zeros(10)}, tmp_path / "m.pt")
    result = memtree.convert(tmp_path / "m.pt", tmp_path / "hf", format="safetensors")
    assert list(open_checkpoint(tmp_path / "hf")) == ["emb.weight", "head.bias"]
    assert "tied to emb.weight" in result.altered["head.weight"] and result.tensors == 2
    # a slice of the same storage is not a tie: it is written
    torch.save({"a": w, "b": w[:5]}, tmp_path / "s.pt")
    assert list(open_checkpoint(memtree.convert(tmp_path / "s.pt", tmp_path / "s.safetensors") and
                                tmp_path / "s.safetensors")) == ["a", "b"]


# -- model directories and indexes as sources -------------------------------------------------------
def test_model_directories_and_indexes_are_sources(tmp_path: Path) -> None:
    state = _state(4)
    torch.save(state, tmp_path / "m.pt")
    memtree.convert(tmp_path / "m.pt", tmp_path / "hf", format="safetensors", max_shard_size=5000)
    for src in (tmp_path / "hf", tmp_path / "hf" / INDEX):
        dst = tmp_path / f"tree-{src.name}"
        result = memtree.convert(src, dst, flat_keys=True)
        assert result.source == "safetensors" and result.tensors == 4
        tree = memtree.load_memmap(dst)
        assert all(torch.equal(tree[k], v) for k, v in state.items())
    # a single model.safetensors, and pytorch_model.bin (+ its index)
    single = tmp_path / "single"
    single.mkdir()
    save_safetensors(state, single / "model.safetensors")
    assert memtree.convert(single, tmp_path / "t2").tensors == 4
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    torch.save(state, bin_dir / "pytorch_model.bin")
    assert memtree.convert(bin_dir, tmp_path / "t3").source == "torch"
    torch.save({k: state[k] for k in list(state)[:2]}, bin_dir / "pytorch_model-00001-of-00002.bin")
    torch.save({k: state[k] for k in list(state)[2:]}, bin_dir / "pytorch_model-00002-of-00002.bin")
    weight_map = {k: f"pytorch_model-0000{1 + i // 2}-of-00002.bin" for i, k in enumerate(state)}
    (bin_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    os.unlink(bin_dir / "pytorch_model.bin")
    result = memtree.convert(bin_dir, tmp_path / "t4.safetensors")
    assert result.source == "torch" and dict(open_checkpoint(tmp_path / "t4.safetensors")).keys() == state.keys()


def test_a_directory_that_is_nothing_gets_a_hint(tmp_path: Path, capsys) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    with pytest.raises(memtree.NotAMemtreeError, match="model.safetensors.index.json"):
        memtree.convert(tmp_path / "d", tmp_path / "out")
    assert main(["convert", str(tmp_path / "d"), str(tmp_path / "out")]) == 1
    assert "Hugging Face model directory" in capsys.readouterr().err


def _index(d: Path, weight_map: Any, raw: str | None = None) -> None:
    (d / INDEX).write_text(raw if raw is not None else json.dumps({"weight_map": weight_map}))


def test_hostile_indexes_are_refused_and_nothing_is_written(tmp_path: Path) -> None:
    d = tmp_path / "hf"
    d.mkdir()
    save_safetensors({"a": torch.ones(2)}, d / "s1.safetensors")
    save_safetensors({"a": torch.zeros(2), "b": torch.ones(1)}, d / "s2.safetensors")
    outside = tmp_path / "outside.safetensors"
    save_safetensors({"a": torch.ones(2)}, outside)
    os.symlink(outside, d / "link.safetensors")
    cases = {
        "outside": ({"a": "../outside.safetensors"}, None, memtree.UnsafePathError),
        "absolute": ({"a": str(outside)}, None, memtree.UnsafePathError),
        "link out": ({"a": "link.safetensors"}, None, memtree.UnsafePathError),
        "absent": ({"a": "missing.safetensors"}, None, memtree.MemtreeError),
        "two shards": (None, '{"weight_map": {"a": "s1.safetensors", "a": "s2.safetensors"}}',
                       memtree.CheckpointFormatError),
        "not held": ({"b": "s1.safetensors"}, None, memtree.CheckpointFormatError),
        "not json": (None, "{", memtree.CheckpointFormatError),
    }
    for name, (weight_map, raw, error) in cases.items():
        _index(d, weight_map, raw)
        with pytest.raises(error) as err:
            memtree.convert(d, tmp_path / "out")
        if name == "absent":
            assert "missing.safetensors" in str(err.value) and "download is incomplete" in str(err.value)
        assert not (tmp_path / "out").exists(), name
    # a tensor held by two shards but listed once is read from the listed shard
    _index(d, {"a": "s2.safetensors", "b": "s2.safetensors"})
    memtree.convert(d, tmp_path / "out")
    assert memtree.load_memmap(tmp_path / "out")["a"].tolist() == [0.0, 0.0]


# -- the real transformers --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tf() -> Any:
    return pytest.importorskip("transformers")


def _gpt2(tf: Any) -> Any:
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg).eval()


def _llama(tf: Any) -> Any:
    cfg = tf.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
    )
    return tf.LlamaForCausalLM(cfg).eval()


_IDS = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(0))


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_IDS).logits


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2-tied", "llama"])
@pytest.mark.parametrize("source", ["torch.save", "memtree"])
def test_from_pretrained_reads_the_sharded_output_and_it_converts_back(
    tmp_path: Path, tf: Any, build: Any, source: str
) -> None:
    torch.manual_seed(0)
    model = build(tf)
    if source == "torch.save":
        src = tmp_path / "sd.pt"
        torch.save(model.state_dict(), src)
    else:
        src = tmp_path / "tree"
        memtree.TensorTree.from_module(model).memmap(src)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    out = tmp_path / "hf"
    argv = ["convert", str(src), str(out), "--format", "safetensors",
            "--max-shard-size", str(total // 3), "--flat-keys"]
    assert main(argv) == 0
    assert (out / INDEX).exists() and len(json.loads((out / INDEX).read_text())["weight_map"]) > 0
    model.config.save_pretrained(out)
    loaded, info = tf.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    loaded.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert torch.equal(_logits(loaded), _logits(model))
    if build is _gpt2:
        assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    # and back: the model directory (with its config.json) converts and loads into a module
    memtree.convert(out, tmp_path / "back")
    fresh = build(tf)
    result = memtree.load_into_module(fresh, tmp_path / "back", strict=False)
    assert not result.unexpected
    assert torch.equal(_logits(fresh), _logits(model))
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name


def test_transformers_save_pretrained_shards_convert_and_load(tmp_path: Path, tf: Any) -> None:
    torch.manual_seed(1)
    model = _llama(tf)
    model.save_pretrained(tmp_path / "theirs", max_shard_size="20KB")
    assert (tmp_path / "theirs" / INDEX).exists()
    result = memtree.convert(tmp_path / "theirs", tmp_path / "tree")
    assert result.source == "safetensors"
    fresh = _llama(tf)
    memtree.load_into_module(fresh, tmp_path / "tree")
    assert torch.equal(_logits(fresh), _logits(model))
    # memtree's re-export of it reads back in transformers with the same split
    memtree.convert(tmp_path / "tree", tmp_path / "ours", format="safetensors", max_shard_size="20KB",
                    flat_keys=True)
    theirs_index = json.loads((tmp_path / "theirs" / INDEX).read_text())
    ours_index = json.loads((tmp_path / "ours" / INDEX).read_text())
    assert ours_index["metadata"]["total_size"] == theirs_index["metadata"]["total_size"]
    assert set(ours_index["weight_map"]) == set(theirs_index["weight_map"])
    shutil.copy(tmp_path / "theirs" / "config.json", tmp_path / "ours" / "config.json")
    again = tf.AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
    assert torch.equal(_logits(again), _logits(model))


# -- kill -9 at each step of the commit (RELIABILITY §8a test 1, for model and tensordict dirs) ----
def _convert_child(src: str, dst: str, fmt: str, fault: str) -> None:
    from memtree.store.primitives import faults

    os.environ[faults.ENV] = fault
    faults.reload()
    memtree.convert(src, dst, format=fmt, max_shard_size=3000 if fmt == "safetensors" else None,
                    existsok=True)


def _content(path: Path, fmt: str) -> dict[str, list[float]] | None:
    if not path.exists():
        return None
    if fmt == "safetensors":
        with open_checkpoint(path) as ckpt:
            return {k: ckpt[k].tolist() for k in ckpt}
    tree = memtree.load_memmap(path)
    return {k if isinstance(k, str) else ".".join(k): tree[k].tolist()
            for k in tree.keys(include_nested=True, leaves_only=True)}


@pytest.mark.parametrize("fmt", ["safetensors", "tensordict"])
@pytest.mark.parametrize(
    "scenario, fault, expected",
    [
        ("new", "after_lock", "absent"),
        ("new", "staging_created", "absent"),
        ("new", "before_publish", "absent"),
        ("new", "after_publish", "new"),
        ("overwrite", "after_lock", "old"),
        ("overwrite", "staging_created", "old"),
        ("overwrite", "before_publish", "old"),
        ("overwrite", "before_old_removed", "new"),
    ],
)
def test_kill_during_the_commit_leaves_old_or_new_never_partial(
    tmp_path: Path, fmt: str, scenario: str, fault: str, expected: str
) -> None:
    import multiprocessing as mp

    from memtree.store.primitives import faults

    old_src, new_src = tmp_path / "old.pt", tmp_path / "new.pt"
    torch.save({f"w{i}": torch.full((300,), float(i)) for i in range(4)}, old_src)
    torch.save({f"w{i}": torch.full((300,), -float(i)) for i in range(5)}, new_src)
    parent = tmp_path / "parent"
    parent.mkdir()
    dst = parent / "out"
    if scenario == "overwrite":
        memtree.convert(old_src, dst, format=fmt, max_shard_size=3000 if fmt == "safetensors" else None)
    old = _content(dst, fmt)
    p = mp.get_context("fork").Process(target=_convert_child, args=(str(new_src), str(dst), fmt, fault))
    p.start()
    p.join(120)
    assert p.exitcode == faults.EXIT_CODE, f"the writer never reached {fault} (exit {p.exitcode})"
    got = _content(dst, fmt)
    if expected == "absent":
        assert got is None
    elif expected == "old":
        assert got == old and old is not None
    else:
        assert got is not None and got["w4"] == [-4.0] * 300
    memtree.recover(parent)
    assert os.listdir(parent) == ([] if expected == "absent" else ["out"])
    assert _content(dst, fmt) == got


# -- a hostile index: nesting, whatever the recursion limit --------------------------------------
@pytest.mark.parametrize("depth", [100_000, 1010, 17])
@pytest.mark.parametrize("recursion_limit", [None, 50_000])
def test_a_deeply_nested_index_is_refused_whatever_the_recursion_limit(
    tmp_path: Path, depth: int, recursion_limit: int | None
) -> None:
    """Before: json.loads recursed into the index, so nesting past the recursion limit was a
    RecursionError (not a MemtreeError: a traceback from ``memtree convert``), and a test or a
    library that raised the limit (torch.compile raises it to 2000) changed what the same file
    gave. Now its depth is measured first, without recursion."""
    import sys

    index = tmp_path / "model.safetensors.index.json"
    index.write_text('{"weight_map": {"w": ' + "[" * depth + "]" * depth + "}}")
    limit = sys.getrecursionlimit()
    if recursion_limit is not None:
        sys.setrecursionlimit(recursion_limit)
    try:
        for read in (lambda: open_checkpoint(index), lambda: memtree.convert(index, tmp_path / "out")):
            with pytest.raises(memtree.CheckpointFormatError, match=str(index)):
                read()
    finally:
        sys.setrecursionlimit(limit)
    assert not (tmp_path / "out").exists()
