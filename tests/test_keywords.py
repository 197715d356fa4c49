"""Every public entry has its real signature, and a misspelt keyword is answered with the keyword
meant: :class:`memtree.UnknownKeywordError` ("did you mean 'mode'?"), a ``TypeError`` and a
``MemtreeError``, raised before anything is read or written."""

from __future__ import annotations

import inspect
import pydoc

import pytest
import torch
from torch import nn

import memtree
import memtree.dcp
import memtree.interop
import memtree.remote
from memtree import InvalidArgumentError, MemtreeError, UnknownKeywordError


@pytest.fixture()
def saved(tmp_path):
    memtree.TensorTree({"weight": torch.ones(3, 2), "bias": torch.zeros(3)}).memmap(tmp_path / "t")
    return tmp_path


def _calls(d):
    tree = memtree.TensorTree({"w": torch.ones(2)})
    data = memtree.TensorTree({"x": torch.arange(4)}, batch_size=[4])
    ckpt = memtree.Checkpointer(d / "ck")
    return {
        "load_memmap": (lambda: memtree.load_memmap(d / "t", mdoe="r"), "mode"),
        "TensorTree.load_memmap": (lambda: memtree.TensorTree.load_memmap(d / "t", verfy=True), "verify"),
        "memmap": (lambda: tree.memmap(d / "n", num_thread=2), "num_threads"),
        "memmap_": (lambda: tree.memmap_(d / "n", exists_ok=True), "existsok"),
        "memmap_like": (lambda: tree.memmap_like(d / "n", reserved=True), "reserve"),
        "from_module": (lambda: memtree.TensorTree.from_module(nn.Linear(2, 3), use_statedict=True), "use_state_dict"),
        "to_module": (lambda: memtree.load_memmap(d / "t").to_module(nn.Linear(2, 3), in_place=True), "inplace"),
        "load_into_module": (lambda: memtree.load_into_module(nn.Linear(2, 3), d / "t", stirct=False), "strict"),
        "Checkpointer": (lambda: memtree.Checkpointer(d / "ck2", keep_lats=3), "keep_last"),
        "Checkpointer.save": (lambda: ckpt.save(1, {"a": 1}, blockign=False), "blocking"),
        "Checkpointer.restore": (lambda: ckpt.restore(1, verfy=False), "verify"),
        "convert": (lambda: memtree.convert(d / "t", d / "o.safetensors", fromat="safetensors"), "format"),
        "open_checkpoint": (lambda: memtree.open_checkpoint(d / "t", allow_pickel=True), "allow_pickle"),
        "save_safetensors": (lambda: memtree.save_safetensors(tree, d / "s.safetensors", metdata={}), "metadata"),
        "save_tensordict": (lambda: memtree.save_tensordict(tree, d / "td", existok=True), "existsok"),
        "verify_tree": (lambda: memtree.verify_tree(d / "t", checksum=False), "checksums"),
        "stack": (lambda: memtree.stack([data, data], dims=1), "dim"),
        "batch_loader": (lambda: memtree.batch_loader(data, 2, shufle=True), "shuffle"),
        "batch_loader(DataLoader's)": (lambda: memtree.batch_loader(data, 2, num_worker=0), "num_workers"),
        "init_missing": (lambda: memtree.init_missing(nn.Linear(2, 3), devcie="cpu"), "device"),
        "offload": (lambda: memtree.offload(nn.Linear(2, 3), d / "t", device_mpa={}), "device_map"),
        "saving": (lambda: memtree.saving(d / "r", fsnyc=True), "fsync"),
        "pickle_limits": (lambda: memtree.interop.pickle_limits(max_object=5).__enter__(), "max_objects"),
        "read_tensordict_dir": (lambda: memtree.interop.read_tensordict_dir(d / "t", mod="r"), "mode"),
        "remote.load": (lambda: memtree.remote.load("memory://kw/t", cache_dri=d), "cache_dir"),
        "remote.upload": (lambda: memtree.remote.upload(tree, "memory://kw/u", exists_ok=True), "existsok"),
        "dcp.save": (lambda: memtree.dcp.save({"w": torch.ones(2)}, d / "dcp", fsnc=False), "fsync"),
        "register_subclass": (lambda: memtree.register_subclass(torch.Tensor, nmae="x"), "name"),
        "named_apply": (lambda: tree.named_apply(lambda k, v: v, nested_key=True), "nested_keys"),
    }




def test_a_misspelt_keyword_names_the_keyword_meant_on_every_public_entry(saved):
    failures = []
    for name, (call, meant) in _calls(saved).items():
        try:
            call()
        except UnknownKeywordError as err:
            assert isinstance(err, TypeError) and isinstance(err, MemtreeError) and isinstance(err, InvalidArgumentError)
            if f"did you mean {meant!r}?" not in str(err) or meant not in str(err).split("It takes:")[1]:
                failures.append(f"{name}: {err}")
        except Exception as err:  # noqa: BLE001 - the test reports which entry answered what
            failures.append(f"{name}: {type(err).__name__}: {err}")
        else:
            failures.append(f"{name}: no error")
    assert not failures, "\n".join(failures)
    assert not (saved / "n").exists() and not (saved / "ck2").exists()  # nothing written


def test_the_message_names_the_function_the_keyword_and_every_keyword_it_takes(saved):
    with pytest.raises(UnknownKeywordError) as info:
        memtree.load_memmap(saved / "t", mdoe="r")
    message = str(info.value)
    assert message.startswith("load_memmap() got an unexpected keyword argument 'mdoe': did you mean 'mode'?")
    for name in ("device", "keys", "mode", "mmap", "verify", "lazy", "encryption", "storage_options", "cache_dir"):
        assert name in message.split("It takes:")[1]
    with pytest.raises(UnknownKeywordError, match=r"^Checkpointer\(\) got an unexpected keyword argument 'keep'"):
        memtree.Checkpointer(saved / "c", keep=3)
    with pytest.raises(UnknownKeywordError, match=r"keyword arguments \['a1', 'b2'\]"):
        memtree.load_memmap(saved / "t", a1=1, b2=2)
    with pytest.raises(UnknownKeywordError) as far:
        memtree.load_memmap(saved / "t", zzzzzz=1)  # nothing close: no suggestion, still the list
    assert "did you mean" not in str(far.value) and "It takes: prefix, device" in str(far.value)


def test_a_remote_keyword_for_a_local_path_is_still_refused_as_remote_only(saved):
    with pytest.raises(InvalidArgumentError, match="remote URLs only") as info:
        memtree.load_memmap(saved / "t", timeout=5)
    assert not isinstance(info.value, UnknownKeywordError)


def test_a_type_error_raised_inside_the_function_is_not_taken_for_a_keyword(saved):
    with pytest.raises(TypeError) as info:
        memtree.load_memmap(saved / "t", keys=5)  # a bad value, not a bad keyword
    assert not isinstance(info.value, UnknownKeywordError)
    with pytest.raises(TypeError) as missing:
        memtree.load_memmap()  # type: ignore[call-arg]  # Python's own error for a missing argument
    assert not isinstance(missing.value, UnknownKeywordError) and "prefix" in str(missing.value)


def test_correct_calls_are_unchanged(saved):
    tree = memtree.load_memmap(saved / "t", mode="r", keys=["weight"])
    assert list(tree.keys()) == ["weight"] and memtree.stack([tree, tree], dim=0).batch_size == (2,)


@pytest.mark.parametrize(
    "entry",
    [memtree.load_memmap, memtree.TensorTree.load_memmap, memtree.TensorTree.memmap, memtree.TensorTree.memmap_,
     memtree.load_into_module, memtree.Checkpointer, memtree.convert, memtree.open_checkpoint,
     memtree.save_safetensors, memtree.remote.load],
    ids=lambda f: f.__qualname__,
)
def test_help_and_inspect_show_the_real_signature(entry):
    params = inspect.signature(entry).parameters
    assert not any(p.kind is p.VAR_KEYWORD and p.name in ("kwargs", "kw") for p in params.values())
    keywords = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    assert len(keywords) >= 2, params
    text = pydoc.render_doc(entry, renderer=pydoc.plaintext)
    assert all(f"{name}:" in text or f"{name}=" in text for name in keywords), text[:2000]


def test_the_function_load_memmap_takes_what_the_method_takes():
    function = inspect.signature(memtree.load_memmap).parameters
    method = inspect.signature(memtree.TensorTree.load_memmap).parameters
    assert [(p.name, p.kind, p.default) for p in function.values()] == [
        (p.name, p.kind, p.default) for p in method.values()
    ]
