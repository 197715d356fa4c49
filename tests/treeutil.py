"""Helpers shared by the test files: random tensors of any dtype, bit-exact comparison of tensors
and trees, and snapshots of a directory (to assert that a call changed nothing on disk)."""

from __future__ import annotations

import hashlib
import math
import os
import stat

import torch

from memtree import TensorTree


def plain(t):
    """``t`` as an ordinary torch.Tensor sharing its memory (no subclass dispatch); other values
    unchanged."""
    return t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) and type(t) is not torch.Tensor else t


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's elements as C-contiguous bytes (bit-exact, NaN-safe; any view, subclass, or
    requires_grad tensor)."""
    p = plain(t).detach().contiguous().reshape(-1)
    return p.view(torch.uint8).numpy().tobytes() if p.numel() else b""


def random_tensor(shape, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A fresh contiguous tensor of random bytes, deterministic in ``seed``: every bit pattern of
    ``dtype`` (NaN payloads, subnormals: compare with ``raw_bytes``), 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype is torch.bool:
        b = torch.randint(0, 2, (n,), dtype=torch.uint8, generator=g)
    else:
        b = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return b.clone().view(dtype).reshape(shape)  # int4, bits8...: torch copies them only as bytes


def flat(tree, prefix=()) -> dict:
    """{key tuple: leaf value} by walking top-level keys (independent of keys() flags)."""
    out = {}
    for k in tree.keys():
        v = tree[k]
        if isinstance(v, TensorTree):
            out.update(flat(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def fingerprint(tree) -> dict:
    """{key: (dtype, shape, bytes)} for tensors, {key: value} for the rest (NonTensor unwrapped)."""
    out = {}
    for k, v in flat(tree).items():
        if isinstance(v, torch.Tensor):
            out[k] = (v.dtype, tuple(v.shape), raw_bytes(v))
        else:
            out[k] = v.data if hasattr(v, "data") else v
    return out


_WHOLE_FILE = 1 << 26  # files up to this size are hashed whole; larger (sparse) ones at both ends
_END = 1 << 20


def _digest(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if size <= _WHOLE_FILE:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        else:
            h.update(f.read(_END))
            f.seek(size - _END)
            h.update(f.read(_END))
    return h.hexdigest()


def flip_bit(path, offset: int = 0) -> None:
    """Damage like bit rot: one bit of the file flipped, its modification time kept (a later
    one would mean a write in place, which memtree reports as a stale checksum instead)."""
    times = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))


def snapshot(root) -> dict:
    """Everything under ``root`` without following links, by relative path: kind, size, mtime
    and content hash of files, mtime of directories (an entry added and removed again shows),
    link targets. Equal snapshots before and after a call: it changed nothing on disk."""
    out = {".": ("dir", os.lstat(root).st_mtime_ns)}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("file", st.st_size, st.st_mtime_ns, _digest(p, st.st_size))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", st.st_mtime_ns)
            else:
                out[rel] = ("other", stat.S_IFMT(st.st_mode), st.st_mtime_ns)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # a fresh dense copy: views may keep odd strides (size-1 or empty dims) that .view refuses
    flat = torch.empty(t.numel(), dtype=t.dtype)
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def bits_equal(a, b) -> bool:
    """Bit-exact equality of two tensors (dtype, shape, device and bytes)."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        return False
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape) or a.device != b.device:
        return False
    return torch.equal(_bytes(a), _bytes(b))


def assert_leaf_equal(actual, expected, where=""):
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {actual!r}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert tuple(actual.shape) == tuple(expected.shape), (
            f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        assert bits_equal(actual, expected), f"{where}: values differ"
    else:
        assert not isinstance(actual, TensorTree), f"{where}: got a sub-tree"
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def norm_key(k):
    return k if isinstance(k, tuple) else (k,)


def leaf_dict(tree: TensorTree) -> dict:
    """{key tuple: leaf} for every leaf (tensor or non-tensor) of ``tree``."""
    return {norm_key(k): v for k, v in tree.items(include_nested=True, leaves_only=True)}


def assert_tree_equal_to(tree: TensorTree, expected: dict, batch_size=None):
    """``expected`` maps key tuples to leaves."""
    assert isinstance(tree, TensorTree)
    if batch_size is not None:
        assert tuple(tree.batch_size) == tuple(batch_size)
    got = leaf_dict(tree)
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert_leaf_equal(got[k], v, where=repr(k))


def nested_from_flat(flat: dict) -> dict:
    out: dict = {}
    for path, v in flat.items():
        d = out
        for p in path[:-1]:
            d = d.setdefault(p, {})
        d[path[-1]] = v
    return out


def set_ref(ref: dict, leaf_idx, value) -> dict:
    """``ref`` ({key tuple: leaf}) as ``tree[idx] = value`` must leave it, ``leaf_idx`` being the
    index each tensor leaf sees: ``value`` is a number or {key tuple: value leaf}; the tensors of
    ``ref`` are not changed and non-tensor leaves stay as they are."""
    out = {}
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            v = v.clone()
            v[leaf_idx] = value[k] if isinstance(value, dict) else value
        out[k] = v
    return out


def assert_identical(a, b, where: str = "state") -> None:
    """``a`` and ``b`` are equal values of the same types all the way down (what ``torch.load``
    of a checkpoint must give back): tensors bit for bit, an ``OrderedDict`` with its
    ``_metadata``, NaN equal to NaN."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, where
        assert raw_bytes(a) == raw_bytes(b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{where}[{k!r}]")
        assert getattr(a, "_metadata", None) == getattr(b, "_metadata", None), f"{where}._metadata"
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _report_child(target, report, *args) -> None:
    import traceback

    try:
        target(*args)
    except BaseException:  # noqa: BLE001 - everything reaches the parent
        report.send(traceback.format_exc())
        os._exit(1)
    os._exit(0)


def run_children(context, target, *args_per_child, timeout: float = 300.0) -> None:
    """Run ``target(*args)`` in one child process per ``args`` (``context``: a multiprocessing
    context, fork or spawn) at once; fail with a child's traceback if one raises or hangs."""
    procs = []
    for args in args_per_child:
        recv, send = context.Pipe(duplex=False)
        p = context.Process(target=_report_child, args=(target, send, *args))
        p.start()
        send.close()
        procs.append((p, recv))
    for p, recv in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
        assert p.exitcode == 0, recv.recv() if recv.poll(1) else f"exit code {p.exitcode}"


def saveable_by_torch(dtype: torch.dtype) -> bool:
    """True if ``torch.save`` can write a tensor of ``dtype`` (torch 2.13 has no storage type for
    the shell dtypes ``int1``..``int7``, ``uint1``..``uint7``, which memtree stores)."""
    import io

    try:
        torch.save(torch.empty(0, dtype=dtype), io.BytesIO())
    except (KeyError, RuntimeError):
        return False
    return True
