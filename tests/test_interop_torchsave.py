"""The lazy torch.save reader: specs without data, bit-exact reads, safe unpickling, damage."""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from collections import OrderedDict
from pathlib import Path

import pytest
import torch

import memtree
from memtree.format.dtypes import DTYPE_NAMES, dtype_from_name
from memtree.interop import TorchSaveReader, open_checkpoint
from treeutil import random_tensor, saveable_by_torch
from treeutil import raw_bytes as as_bytes

DTYPES = [d for d in map(dtype_from_name, DTYPE_NAMES) if d is not None and saveable_by_torch(d)]


def assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert as_bytes(got) == as_bytes(expected)


@pytest.fixture
def every_dtype_ckpt(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    sd = {f"t_{str(dt)[6:]}": random_tensor((3, 4), dt, i) for i, dt in enumerate(DTYPES)}
    sd["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    sd["empty"] = torch.empty(0, 5, dtype=torch.bfloat16)
    path = tmp_path / "all.pt"
    torch.save(sd, path)
    return path, sd


@pytest.mark.parametrize("mmap", [True, False])
def test_every_dtype_reads_back_bit_exact(every_dtype_ckpt, mmap: bool) -> None:
    path, sd = every_dtype_ckpt
    with TorchSaveReader(path) as reader:
        assert reader.keys() == list(sd)
        for key, expected in sd.items():
            assert reader.spec(key) == (expected.shape, expected.dtype)
            assert_same(reader.read(key, mmap=mmap), expected)


def test_same_values_and_strides_as_torch_load(tmp_path: Path) -> None:
    base = random_tensor((6, 8), torch.float32, 1)
    tied = torch.nn.Linear(8, 6)
    sd = {
        "base": base,
        "row": base[2],  # a view sharing base's storage, at an offset
        "cols": base[:, 1::3],  # strided view
        "t": base.t(),  # transposed view
        "expanded": torch.arange(4.0).expand(3, 4),  # stride 0
        "w": tied.weight,  # a Parameter
        "w_again": tied.weight,  # tied: same storage twice
    }
    path = tmp_path / "views.pt"
    torch.save(sd, path)
    ref = torch.load(path, weights_only=True)
    ckpt = open_checkpoint(path)
    for key in sd:
        for mmap in (True, False):
            got = ckpt.read(key, mmap=mmap)
            assert got.stride() == ref[key].stride(), key
            assert_same(got, ref[key].detach())
            assert type(got) is torch.Tensor  # parameters come back as plain tensors


def test_file_range_names_the_bytes_of_contiguous_tensors_only(tmp_path: Path) -> None:
    base = random_tensor((6, 8), torch.float32, 1)
    sd = {
        "base": base,
        "row": base[2],  # contiguous, at an offset of the storage
        "rows": base[1:4],  # contiguous, a part of the storage
        "tied": base,  # the same storage again
        "column": base[:, 3:4],  # one column: strided
        "cols": base[:, 1::3],
        "t": base.t(),
        "expanded": torch.arange(4.0).expand(3, 4),
        "empty": torch.empty(0, 5, dtype=torch.bfloat16),
        "scalar": torch.tensor(3, dtype=torch.int16),
    }
    path = tmp_path / "views.pt"
    torch.save(sd, path)
    with TorchSaveReader(path) as reader:
        for key, expected in sd.items():
            span = reader.file_range(key)
            if not expected.is_contiguous():
                assert span is None, key
                continue
            assert span is not None and span.nbytes == expected.nbytes, key
            assert os.pread(span.fd, span.nbytes, span.offset) == as_bytes(expected), key
            assert repr(key) in span.what and str(path) in span.what
        base_span, row_span = reader.file_range("base"), reader.file_range("row")
        assert row_span.offset == base_span.offset + 2 * 8 * 4


def test_mapped_views_of_one_storage_share_memory(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.int64)
    path = tmp_path / "shared.pt"
    torch.save({"a": base, "b": base[4:]}, path)
    ckpt = open_checkpoint(path)
    a, b = ckpt["a"], ckpt["b"]
    assert b.data_ptr() == a.data_ptr() + 4 * 8
    assert b.tolist() == list(range(4, 12))


def test_nested_checkpoint_flattens_to_dotted_keys(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    optimizer = {  # the shape of torch.optim.Adam's state_dict (int keys, tuples)
        "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.randn(3, 2)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2, 3]}],
    }
    obj = {
        "model": model.state_dict(),
        "optimizer": optimizer,
        "epoch": 7,
        "history": [torch.ones(2), 0.5],
        "name": "run",
    }
    path = tmp_path / "full.pt"
    torch.save(obj, path)
    ckpt = open_checkpoint(path)
    assert "model.0.weight" in ckpt and "optimizer.state.0.exp_avg" in ckpt
    assert "history.0" in ckpt
    assert ckpt.key_path("model.0.weight") == ("model", "0.weight")
    assert ckpt.non_tensors["epoch"] == 7 and ckpt.non_tensors["history.1"] == 0.5
    assert ckpt.non_tensors["optimizer.param_groups"][0]["betas"] == (0.9, 0.999)
    assert_same(ckpt["optimizer.state.0.exp_avg"], optimizer["state"][0]["exp_avg"])


def test_checkpoint_is_a_lazy_mapping(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save(OrderedDict(w=torch.ones(2, 3), b=torch.zeros(3)), path)
    ckpt = open_checkpoint(path)
    assert len(ckpt) == 2 and list(ckpt) == ["w", "b"] and set(ckpt.keys()) == {"w", "b"}
    assert "w" in ckpt and "x" not in ckpt and ckpt.get("x") is None
    assert ckpt.tensor_spec("w") == (torch.Size([2, 3]), torch.float32)
    with pytest.raises(KeyError):
        ckpt["x"]
    with pytest.raises(memtree.MemtreeKeyError):
        ckpt.tensor_spec("x")
    ckpt.close()


def _storage_member(path: Path, key: str = "0") -> zipfile.ZipInfo:
    with zipfile.ZipFile(path) as zf:
        return next(i for i in zf.infolist() if i.filename.endswith(f"/data/{key}"))


def _data_offset(path: Path, info: zipfile.ZipInfo) -> int:
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    return (
        info.header_offset
        + 30
        + int.from_bytes(header[26:28], "little")
        + int.from_bytes(header[28:30], "little")
    )


def test_specs_are_listed_without_reading_tensor_data(tmp_path: Path) -> None:
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(1000, dtype=torch.int32)}, path)
    info = _storage_member(path)
    with open(path, "r+b") as f:  # damage the data only: listing must not notice
        f.seek(_data_offset(path, info) + 100)
        f.write(b"\xff" * 16)
    ckpt = open_checkpoint(path)
    assert ckpt.tensor_spec("w") == (torch.Size([1000]), torch.int32)
    with pytest.raises(memtree.CheckpointFormatError, match="CRC-32"):
        ckpt.read("w", mmap=False)


class _Hostile:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # what an attacker's pickle does: call os.system on load
        return (os.system, (f"touch {self.marker}",))


class _HostileEval:
    def __reduce__(self):
        return (eval, ("__import__('os').system('touch evil_eval_marker')",))


@pytest.mark.parametrize("hostile", ["system", "eval"])
def test_hostile_pickle_is_refused_and_runs_nothing(
    tmp_path: Path, hostile: str, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    payload = _Hostile(marker) if hostile == "system" else _HostileEval()
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": payload}, path)
    for _ in range(2):
        with pytest.raises(memtree.UnsafePickleError, match="nothing was executed") as info:
            open_checkpoint(path)
        assert isinstance(info.value, memtree.PickleNotAllowedError)
    with pytest.raises(memtree.UnsafePickleError):
        memtree.convert(path, tmp_path / "out")
    assert not marker.exists() and not (tmp_path / "evil_eval_marker").exists()
    assert not (tmp_path / "out").exists()


def test_allow_pickle_opts_in_to_other_objects(tmp_path: Path) -> None:
    path = tmp_path / "ns.pt"
    from argparse import Namespace

    torch.save({"w": torch.ones(2), "args": Namespace(lr=0.1)}, path)
    with pytest.raises(memtree.UnsafePickleError, match="argparse.Namespace"):
        open_checkpoint(path)
    ckpt = open_checkpoint(path, allow_pickle=True)
    assert ckpt.non_tensors["args"].lr == 0.1 and ckpt["w"].tolist() == [1.0, 1.0]


def test_plain_data_in_checkpoints_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    obj = {
        "b": b"\x00\xff",
        "c": 1 + 2j,
        "size": torch.Size([2, 3]),
        "dt": torch.bfloat16,
        "n": None,
    }
    torch.save({"w": torch.zeros(1), **obj}, path)
    assert open_checkpoint(path).non_tensors == obj


def test_legacy_checkpoint_is_refused_with_how_to_convert(tmp_path: Path) -> None:
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(memtree.LegacyCheckpointError, match="torch.load.*re-save"):
        open_checkpoint(path)
    raw = tmp_path / "raw.pkl"
    raw.write_bytes(pickle.dumps({"w": [1, 2]}))
    with pytest.raises(memtree.LegacyCheckpointError):
        TorchSaveReader(raw)


@pytest.mark.parametrize("keep", [0.0, 0.3, 0.6, 0.95, -22])
def test_truncated_checkpoint_gives_a_memtree_error(tmp_path: Path, keep: float) -> None:
    path = tmp_path / "t.pt"
    torch.save({"w": torch.randn(256), "b": torch.randn(8)}, path)
    data = path.read_bytes()
    cut = int(len(data) * keep) if keep >= 0 else len(data) + int(keep)
    path.write_bytes(data[:cut])
    with pytest.raises(memtree.CheckpointFormatError):
        ckpt = open_checkpoint(path)
        for key in ckpt:
            ckpt.read(key, mmap=False)


def test_damaged_records_give_memtree_errors(tmp_path: Path) -> None:
    # a storage record whose size disagrees with the pickle
    path = tmp_path / "bad.pt"
    buf = io.BytesIO()
    torch.save({"w": torch.ones(4)}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as out:
        for info in src.infolist():
            data = src.read(info)
            out.writestr(info.filename, data[:-4] if info.filename.endswith("/data/0") else data)
    with pytest.raises(memtree.CheckpointFormatError, match="expected 16 stored bytes"):
        open_checkpoint(path)
    # a zip that is not a torch.save file
    other = tmp_path / "other.zip"
    with zipfile.ZipFile(other, "w") as out:
        out.writestr("hello.txt", "hi")
    with pytest.raises(memtree.CheckpointFormatError, match="not a torch.save checkpoint"):
        open_checkpoint(other)
    # not a checkpoint at all
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"hello world, not a checkpoint")
    with pytest.raises(memtree.CheckpointFormatError):
        open_checkpoint(junk)
    with pytest.raises(memtree.CheckpointFormatError, match="directory"):
        open_checkpoint(tmp_path)


def test_a_record_placed_past_the_end_of_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "hostile.pt"
    torch.save({"w": torch.ones(4)}, path)
    info = _storage_member(path)
    with open(path, "r+b") as f:  # a local header whose extra field pushes the data past the end
        f.seek(info.header_offset + 28)
        f.write(b"\xff\xff")
    with pytest.raises(memtree.CheckpointFormatError, match="data/0") as err:
        TorchSaveReader(path)
    assert str(path) in str(err.value) and "truncated" in str(err.value)


def test_non_dict_checkpoints_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.pt"
    torch.save(torch.ones(3), path)
    with pytest.raises(memtree.CheckpointFormatError, match="single tensor"):
        open_checkpoint(path)
    torch.save([torch.ones(3)], path)
    with pytest.raises(memtree.CheckpointFormatError, match="list"):
        open_checkpoint(path)


def test_tensor_subclasses_need_allow_pickle(tmp_path: Path) -> None:
    path = tmp_path / "sub.pt"
    torch.save({"w": _MyTensor(torch.ones(2))}, path)
    with pytest.raises(memtree.UnsafePickleError):
        open_checkpoint(path)
    assert open_checkpoint(path, allow_pickle=True)["w"].tolist() == [1.0, 1.0]


class _MyTensor(torch.Tensor):
    pass


def test_checkpoint_path_may_be_a_symlink(tmp_path: Path) -> None:
    target = tmp_path / "blob"
    torch.save({"w": torch.arange(3)}, target)
    link = tmp_path / "model.pt"
    link.symlink_to(target)
    assert open_checkpoint(link)["w"].tolist() == [0, 1, 2]


def test_zero_element_views_at_any_offset_are_read(tmp_path: Path) -> None:
    """A view with no element may start past the end of its (empty) storage: it needs no byte.
    torch.load reads it; memtree took it for damage."""
    empty = torch.empty(2, 0, dtype=torch.float16)
    sd = {"rest": empty[1:], "none": torch.ones(4)[4:], "row": empty[1]}
    path = tmp_path / "empty.pt"
    torch.save(sd, path)
    ref = torch.load(path, weights_only=True)
    assert ref["rest"].storage_offset() > 0 and ref["rest"].untyped_storage().nbytes() == 0
    with open_checkpoint(path) as ckpt:
        for key in sd:
            for mmap in (True, False):
                got = ckpt.read(key, mmap=mmap)
                assert got.shape == ref[key].shape and got.dtype == ref[key].dtype and got.numel() == 0
    memtree.convert(path, tmp_path / "tree")
    assert memtree.load_memmap(tmp_path / "tree")["rest"].shape == (1, 0)


def test_allow_pickle_reads_what_protocol_2_names_by_python_2_names(tmp_path: Path) -> None:
    """``range`` is pickled as ``__builtin__.xrange``: pickle's own lookup maps it."""
    path = tmp_path / "r.pt"
    torch.save({"w": torch.ones(1), "r": range(3)}, path)
    with pytest.raises(memtree.UnsafePickleError, match="xrange"):
        open_checkpoint(path)
    assert open_checkpoint(path, allow_pickle=True).non_tensors["r"] == range(3)
