"""The in-place loader's file reads: load_into_module and load_memmap(mmap=False) through fill.

Every source kind (memtree directory, safetensors file, safetensors shards, torch.save file,
torch.save shards) loads bit-exact into the module's own tensors, through
:func:`memtree.store.primitives.fill.fill` (spied on), for every dtype; damaged and changing files raise
clear errors and leave the module as it was when the damage is found before reading.
"""

from __future__ import annotations

import errno
import gc
import json
import os
import struct
import threading
from typing import Any

import pytest
import torch
from torch import nn

import memtree
import memtree.nn.loading as loading_mod
import memtree.store.primitives.fill as fill_mod
import memtree.store.reading.leaf_reader as leaf_reader_mod
from memtree import (
    CheckpointFormatError,
    IntegrityError,
    LeafSizeError,
    StorageError,
    TensorTree,
    load_into_module,
    load_memmap,
)
from memtree.interop import save_safetensors

from test_fill import fail_preadv_at

BUFFER_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]
KINDS = ["memtree", "safetensors", "safetensors-shards", "torch", "torch-shards"]


def raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return (torch.randint(0, 2, (n,), generator=g) == 1).reshape(shape)
    b = torch.randint(0, 256, (n * torch.empty((), dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return b.view(dtype).reshape(shape).clone()


class Net(nn.Module):
    """Parameters in float32 and bfloat16, and a buffer of every other dtype."""

    def __init__(self, param_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 48).to(param_dtype)
        self.emb = nn.Embedding(100, 16, dtype=torch.bfloat16)
        for i, dt in enumerate(BUFFER_DTYPES):
            self.register_buffer(f"b{i}", torch.zeros(3, 5 + i, dtype=dt))
        self.register_buffer("scalar", torch.zeros((), dtype=torch.float32))


def trained() -> Net:
    net = Net()
    with torch.no_grad():
        for i, (name, t) in enumerate(net.state_dict(keep_vars=True).items()):
            t.copy_(bits(tuple(t.shape), t.dtype, i))
    return net


def save(net: nn.Module, kind: str, where: Any, state: dict[str, torch.Tensor] | None = None) -> str:
    sd = {k: v.detach() for k, v in (state if state is not None else net.state_dict()).items()}
    d = str(where)
    if kind == "memtree":
        TensorTree.from_module(net).memmap(d + "/tree") if state is None else TensorTree(sd).memmap(d + "/tree")
        return d + "/tree"
    if kind == "safetensors":
        save_safetensors(sd, d + "/m.safetensors")
        return d + "/m.safetensors"
    if kind == "torch":
        torch.save(sd, d + "/m.pt")
        return d + "/m.pt"
    keys = list(sd)
    half = {k: sd[k] for k in keys[: len(keys) // 2]}, {k: sd[k] for k in keys[len(keys) // 2 :]}
    ext = "safetensors" if kind == "safetensors-shards" else "bin"
    weight_map = {}
    for i, part in enumerate(half):
        name = f"model-0000{i + 1}-of-00002.{ext}"
        if ext == "safetensors":
            save_safetensors(part, os.path.join(d, name))
        else:
            torch.save(part, os.path.join(d, name))
        weight_map.update({k: name for k in part})
    index = "model.safetensors.index.json" if ext == "safetensors" else "pytorch_model.bin.index.json"
    with open(os.path.join(d, index), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return d


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensors each load_into_module reads through fill() (memtree directories: by
    the tree reader, the other sources by the loader)."""
    calls: list[int] = []
    real = loading_mod.fill

    def counting(jobs: Any, **kw: Any) -> None:
        calls.append(len(jobs))
        real(jobs, **kw)

    monkeypatch.setattr(loading_mod, "fill", counting)
    monkeypatch.setattr(fill_mod, "fill", counting)  # the tree reader imports it where it reads
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)  # threads even for this small model
    monkeypatch.setattr(fill_mod, "READ_CHUNK", 1024)
    return calls


@pytest.mark.parametrize("kind", KINDS)
def test_every_source_kind_and_dtype_fills_the_modules_own_tensors(tmp_path: Any, spy: list[int], kind: str) -> None:
    src = trained()
    path = save(src, kind, tmp_path)
    net = Net()
    before = {k: (id(v), v.data_ptr()) for k, v in net.state_dict(keep_vars=True).items()}
    opt = torch.optim.AdamW(net.parameters())
    assert load_into_module(net, path) == ([], [])
    after = net.state_dict(keep_vars=True)
    assert {k: (id(v), v.data_ptr()) for k, v in after.items()} == before
    for k, v in src.state_dict().items():
        assert raw(after[k]) == raw(v), k
    assert spy == [len(before)]  # every tensor read from the file, none copied from a mapping
    assert opt.param_groups[0]["params"][0] is net.fc.weight


@pytest.mark.parametrize("kind", KINDS)
def test_keys_prefix_dtype_and_ignore_mismatched_together(tmp_path: Any, spy: list[int], kind: str) -> None:
    src = trained()
    state = {"model." + k: v for k, v in src.state_dict().items()}
    state["model.fc.weight"] = state["model.fc.weight"].to(torch.bfloat16)  # cast back with dtype=
    state["model.emb.weight"] = torch.zeros(7, 16, dtype=torch.bfloat16)  # another vocabulary
    path = save(src, kind, tmp_path, state)
    net = Net()
    emb = raw(net.emb.weight)
    with pytest.raises(memtree.ShapeMismatchError):
        load_into_module(net, path, prefix="model.", keys=["fc", "emb"], dtype=torch.float32)
    result = load_into_module(net, path, prefix="model.", keys=["fc", "emb"], dtype=torch.float32, ignore_mismatched=True)
    assert result.mismatched == ["emb.weight"] and result == ([], [])
    assert raw(net.emb.weight) == emb  # skipped: untouched
    assert raw(net.fc.weight) == raw(src.fc.weight.to(torch.bfloat16).float())  # cast on load
    assert raw(net.fc.bias) == raw(src.fc.bias)
    assert raw(net.b0) == bytes(len(raw(net.b0)))  # outside keys=: untouched
    assert spy == [2]


@pytest.mark.parametrize("kind", ["memtree", "safetensors", "torch"])
def test_partial_keys_and_strict_false(tmp_path: Any, spy: list[int], kind: str) -> None:
    src = trained()
    part = {k: v for k, v in src.state_dict().items() if k.startswith("b")}
    path = save(src, kind, tmp_path, part)
    net = Net()
    fc = raw(net.fc.weight)
    result = load_into_module(net, path, strict=False)
    assert set(result.missing) == {"fc.weight", "fc.bias", "emb.weight", "scalar"}
    assert raw(net.fc.weight) == fc and all(raw(getattr(net, k)) == raw(v) for k, v in part.items())
    assert spy == [len(part)]


def test_a_bf16_checkpoint_into_a_float32_model_never_copies_the_checkpoint(tmp_path: Any, spy: list[int]) -> None:
    src = Net(torch.bfloat16)
    path = save(src, "safetensors", tmp_path)
    net = Net()
    load_into_module(net, path, dtype=torch.float32, keys=["fc"])
    assert torch.equal(net.fc.weight, src.fc.weight.float()) and spy == [2]


def test_a_memtree_directory_into_live_modules_opens_each_leaf_once_and_maps_none(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = trained()
    path = save(src, "memtree", tmp_path)
    opened: list[str] = []
    real_open = leaf_reader_mod.open_leaf

    def counting(name: str, *args: Any, **kw: Any) -> Any:
        opened.append(name)
        return real_open(name, *args, **kw)

    def never(*_: Any, **__: Any) -> Any:
        raise AssertionError("a leaf was mapped")

    monkeypatch.setattr(leaf_reader_mod, "open_leaf", counting)
    monkeypatch.setattr(leaf_reader_mod, "map_leaf", never)
    monkeypatch.setattr(loading_mod, "mapped_range", never)
    net = Net()
    assert load_into_module(net, path) == ([], [])
    for k, v in src.state_dict().items():
        assert raw(net.state_dict()[k]) == raw(v), k
    assert sorted(opened) == sorted(k.rpartition(".")[2] + ".memmap" for k in src.state_dict())


# -- damaged and changing files ----------------------------------------------------------------------
def _truncate_during_load(monkeypatch: pytest.MonkeyPatch, path: str, size: int) -> None:
    """Truncate ``path`` after the source is opened and checked, right before the reads."""
    real = loading_mod.fill

    def late(jobs: Any, **kw: Any) -> None:
        os.truncate(path, size)
        real(jobs, **kw)

    monkeypatch.setattr(loading_mod, "fill", late)
    monkeypatch.setattr(fill_mod, "fill", late)  # memtree directories: the tree reader imports it where it reads


@pytest.mark.parametrize("kind", ["memtree", "safetensors", "torch"])
def test_a_file_truncated_after_opening_raises_and_leaves_the_module_untouched(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    src = trained()
    path = save(src, kind, tmp_path)
    victim = {
        "memtree": lambda: os.path.join(path, "fc", "weight.memmap"),
        "safetensors": lambda: path,
        "torch": lambda: path,
    }[kind]()
    assert os.path.isfile(victim)
    _truncate_during_load(monkeypatch, victim, 64)
    net = Net()
    before = {k: raw(v) for k, v in net.state_dict().items()}
    with pytest.raises(StorageError, match="Nothing was written") as info:
        load_into_module(net, path)
    assert victim in str(info.value)
    assert {k: raw(v) for k, v in net.state_dict().items()} == before


def test_a_truncated_leaf_is_refused_at_open(tmp_path: Any) -> None:
    path = save(trained(), "memtree", tmp_path)
    os.truncate(os.path.join(path, "fc", "weight.memmap"), 10)
    with pytest.raises(LeafSizeError, match="weight"):
        load_into_module(Net(), path)


def test_hostile_safetensors_offsets_are_refused_before_any_read(tmp_path: Any) -> None:
    header = json.dumps({"fc.bias": {"dtype": "F32", "shape": [48], "data_offsets": [2**62, 2**62 + 192]}}).encode()
    path = tmp_path / "evil.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(192))
    net = Net()
    bias = raw(net.fc.bias)
    with pytest.raises(CheckpointFormatError, match="fc.bias"):
        load_into_module(net, str(path), strict=False)
    assert raw(net.fc.bias) == bias


def test_a_damaged_torch_record_fails_its_crc_on_the_bytes_read(tmp_path: Any) -> None:
    import zipfile

    src = trained()
    path = save(src, "torch", tmp_path)
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointFormatError, match="CRC-32"):
        load_into_module(Net(), path)


def _open_fds(under: Any = None) -> set[str]:
    """This process's open descriptors; with ``under``, only those of files below that directory
    (what a load opens: other tests' background threads may open and close others meanwhile)."""
    gc.collect()  # descriptors that only garbage still holds are closed first
    fds = set(os.listdir("/proc/self/fd"))
    if under is None:
        return fds
    found = set()
    for fd in fds:
        try:
            where = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if where.startswith(f"{under}/") or where == str(under):
            found.add(f"{fd} -> {where}")
    return found


@pytest.mark.parametrize("fail_at", [1, 7, 40])
def test_a_read_failing_mid_load_raises_closes_every_descriptor_and_leaves_no_thread(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, fail_at: int
) -> None:
    """The reader threads take the jobs as they are made: a read that fails part way (the
    first piece, one in the middle, one late) stops them all; the error names the leaf, every
    leaf descriptor is closed, no reader thread is left and the collector is on again."""
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    monkeypatch.setattr(fill_mod, "READ_CHUNK", 64)  # many pieces: the threads overlap the setup
    path = save(trained(), "memtree", tmp_path)
    calls = fail_preadv_at(monkeypatch, fail_at)
    before = _open_fds(tmp_path)
    with pytest.raises(StorageError, match=r"leaf .*\.memmap") as info:
        load_into_module(Net(), path)
    assert info.value.errno == errno.EIO
    del info  # its traceback holds the tree (and its root directory) until it is dropped
    assert _open_fds(tmp_path) == before
    assert not any(t.name.startswith("memtree-read") for t in threading.enumerate())
    assert gc.isenabled()
    calls["n"] = -(10**9)  # no more failures: the same module loads bit-exact afterwards
    net = Net()
    assert load_into_module(net, path) == ([], [])
    assert {k: raw(v) for k, v in net.state_dict().items()} == {k: raw(v) for k, v in trained().state_dict().items()}


def test_the_collector_is_paused_during_a_load_and_restored_after(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """No cyclic collection while the walk and the plan allocate; the collector's state is as
    it was afterwards, after a success, a strict error and a read error, enabled or not."""
    path = save(trained(), "memtree", tmp_path)
    seen: list[bool] = []
    real = fill_mod.fill

    def spying(jobs: Any, **kw: Any) -> None:
        seen.append(gc.isenabled())
        real(jobs, **kw)

    monkeypatch.setattr(fill_mod, "fill", spying)  # the tree reader imports it where it reads
    assert load_into_module(Net(), path) == ([], []) and seen == [False] and gc.isenabled()

    class Other(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(2, 2)

    with pytest.raises(memtree.MemtreeKeyError):
        load_into_module(Other(), path)
    assert gc.isenabled()
    gc.disable()
    try:
        load_into_module(Net(), path)
        assert not gc.isenabled()  # a caller's choice is kept
    finally:
        gc.enable()


def _fd_table_size() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("FDSize:")).split()[1])


def test_a_walk_grows_the_descriptor_table_in_one_step_and_touches_no_other_descriptor() -> None:
    """``_make_fd_room`` grows the table to 16 times the descriptor (at least 1024) at once; a
    descriptor another thread holds at the target number is neither closed nor replaced, and
    no descriptor is left open."""
    null = os.open(os.devnull, os.O_RDONLY)
    probe = os.open(os.devnull, os.O_RDONLY)
    target = max(1024, 16 * probe)
    try:
        try:
            os.fstat(target)
            pytest.skip(f"descriptor {target} is in use in this process")
        except OSError:
            pass
        os.dup2(null, target)  # "another thread's" descriptor, exactly at the target
        before = _open_fds()
        assert leaf_reader_mod._make_fd_room(probe) == target
        assert _fd_table_size() > target
        assert _open_fds() == before
        assert os.path.samestat(os.fstat(target), os.fstat(null))
    finally:
        for fd in (null, probe, target):
            try:
                os.close(fd)
            except OSError:
                pass


# -- load_memmap(mmap=False) --------------------------------------------------------------------------
def _tree(n: int = 3) -> dict[str, Any]:
    return {
        f"l{i}": {f"t{j}": bits((4, j + 1), dt, 10 * i + j) for j, dt in enumerate(BUFFER_DTYPES)} for i in range(n)
    }


def test_mmap_false_reads_every_leaf_bit_exact_into_ordinary_memory(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(leaf_reader_mod, "MAX_PENDING_READS", 4)  # several threaded batches
    monkeypatch.setattr(fill_mod, "READ_MIN_WORK", 1)
    data = _tree(10)
    d = str(tmp_path / "t")
    TensorTree(data).memmap(d, checksum="crc32")
    for lazy in (False, True):
        loaded = load_memmap(d, mmap=False, verify=not lazy, lazy=lazy)
        for i in range(10):
            for j in range(len(BUFFER_DTYPES)):
                got = loaded[f"l{i}", f"t{j}"]
                assert type(got) is torch.Tensor and raw(got) == raw(data[f"l{i}"][f"t{j}"])


def test_mmap_false_verify_and_failures_leave_no_half_loaded_level(tmp_path: Any) -> None:
    d = str(tmp_path / "t")
    TensorTree(_tree(2)).memmap(d, checksum="crc32")
    leaf = os.path.join(d, "l1", "t0.memmap")
    with open(leaf, "r+b") as f:
        f.write(b"\x00\x01\x02")
    with pytest.raises(IntegrityError, match="t0"):
        load_memmap(d, mmap=False, verify=True)
    from memtree.store.reading.read import ReadOptions, open_tree

    root = open_tree(d, ReadOptions.of(mmap=False, verify=True))
    with pytest.raises(IntegrityError):
        root.load_all()
    assert root._loaded is None  # the failed batch left nothing loaded (a retry reads again)
    os.truncate(leaf, 0)
    with pytest.raises(LeafSizeError):
        load_memmap(d, mmap=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_loads_go_through_the_ring(tmp_path: Any) -> None:  # pragma: no cover - GPU machines
    src = trained()
    path = save(src, "safetensors", tmp_path)
    net = Net().cuda()
    load_into_module(net, path)
    for k, v in src.state_dict().items():
        assert raw(net.state_dict()[k].cpu()) == raw(v)
    d = str(tmp_path / "t")
    TensorTree(_tree(2)).memmap(d)
    loaded = load_memmap(d, device="cuda")
    assert loaded["l0", "t0"].device.type == "cuda"
