"""Back-to-back checks behind the explanations in RESULTS.md ("The targets not met").

Each check alternates memtree with a bare floor in one process, round after round (the order
flips every round), and prints medians and the median of the per-round ratios, which is steadier
on a noisy disk than two rows measured minutes apart.

Usage (from the repository root; ``WD=/dev/shm`` runs on tmpfs instead of ``$TMPDIR``):

    .venv/bin/python benchmarks/floors.py w3 [ROUNDS]          # memmap_like vs its floors
    .venv/bin/python benchmarks/floors.py save w2 [ROUNDS] [THREADS]   # memmap vs raw-files (and tensordict)
    .venv/bin/python benchmarks/floors.py save w1 [ROUNDS] [THREADS] [SIZE_GIB]  # vs raw (and tensordict)
    .venv/bin/python benchmarks/floors.py touch [ROUNDS]       # W1 open + sum: raw, format floor, memtree
    .venv/bin/python benchmarks/floors.py touch-cold [ROUNDS]  # the same, every file evicted first
    .venv/bin/python benchmarks/floors.py w4 [ROUNDS]          # W4 load + bind: safetensors, format floor, memtree
    .venv/bin/python benchmarks/floors.py w4-ready [ROUNDS]    # the same with the model's build

``save`` also runs tensordict's ``memmap`` at the same thread count when it is installed: how
far the incumbent is from the same floor, in the same rounds. ``touch-cold`` evicts every file
of the three systems from the page cache (``fdatasync`` + ``POSIX_FADV_DONTNEED``) before each
system runs. ``w3`` also times the atomic commit's own system calls without memtree (lock file + flock,
staging directory, files, ``meta.json``, ``renameat2``, map, unlock): the least any save that
cannot leave a half-written tree costs. ``touch`` and ``w4`` also time the *format floor*: the
same directory read with the fewest calls and no checks at all (read and decode each level's
``meta.json``, ``torch.from_file`` each leaf by path), the least any reader of this on-disk
format pays, next to the one-file raw limit (``touch``) or safetensors (``w4``).
A model made ready in a fresh process is measured by ``run.py w4`` (``fresh process
load+bind+forward``: the same construction for every system, the first output checked).
"""

from __future__ import annotations

import fcntl
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import orjson  # noqa: E402
import torch  # noqa: E402

import memtree  # noqa: E402
from memtree.format.dtypes import dtype_from_name  # noqa: E402
from memtree.store.primitives.commit import rename_noreplace  # noqa: E402
from pagecache import make_cold  # noqa: E402
from stores import Store, make_tensors, nest, prepare_index, save, w1_layout, w2_layout  # noqa: E402

W3_FILES = (("img.memmap", 1_000_000 * 3 * 64 * 64), ("label.memmap", 1_000_000 * 8))


def _map(path: str, nbytes: int) -> None:
    fd = os.open(path, os.O_RDWR)
    torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    os.close(fd)


def _w3_bare(p: str) -> None:
    os.mkdir(p)
    for name, nbytes in W3_FILES:
        fd = os.open(os.path.join(p, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, nbytes)
        os.close(fd)
        _map(os.path.join(p, name), nbytes)


def _w3_commit_syscalls(p: str) -> None:
    parent, name = os.path.split(p)
    lock = os.path.join(parent, f".{name}.memtree.lock")
    lfd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.pwrite(lfd, b" " * 64, 0)  # the journal
    staging = os.path.join(parent, f".{name}.memtree-tmp-{uuid.uuid4().hex}")
    os.mkdir(staging, 0o755)
    for file, nbytes in W3_FILES:
        fd = os.open(os.path.join(staging, file), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.ftruncate(fd, nbytes)
        os.close(fd)
    fd = os.open(os.path.join(staging, "meta.json"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, b'{"format":"memtree"}')
    os.close(fd)
    rename_noreplace(staging, p)
    for file, nbytes in W3_FILES:
        _map(os.path.join(p, file), nbytes)
    os.unlink(lock)
    os.close(lfd)


def _bare_walk(root: str) -> dict[str, torch.Tensor]:
    """Map every leaf of a memtree directory with the fewest calls and no checks at all: per
    level, read and decode ``meta.json``; per leaf, ``torch.from_file`` by path (its own open,
    ``fstat``, ``mmap``, close). The least any reader of this format (a file per leaf, a
    ``meta.json`` per level) does. Returns the tensors by dotted key."""
    out: dict[str, torch.Tensor] = {}
    todo = [("", root)]
    while todo:
        prefix, where = todo.pop()
        with open(os.path.join(where, "meta.json"), "rb") as f:
            doc = orjson.loads(f.read())
        for e in doc["entries"]:
            if e["kind"] == "tensor":
                t = torch.from_file(
                    os.path.join(where, e["file"]), shared=True, size=math.prod(e["shape"]),
                    dtype=dtype_from_name(e["dtype"]),
                )
                out[prefix + e["key"]] = t.view(e["shape"])
            elif e["kind"] == "tree":
                todo.append((prefix + e["key"] + ".", os.path.join(where, e["dir"])))
    return out


def _evict_or_say(paths: list[str]) -> None:
    """Evict the files from the page cache, and say so when any page stays (tmpfs keeps them)."""
    left = make_cold(paths)
    if left:
        print(f"warning: {left} of the files' pages are still cached after eviction "
              "(tmpfs?): this is not a cold measurement", file=sys.stderr)


def _alternate(
    systems: dict[str, Callable[[str], Any]],
    rounds: int,
    fresh: bool,
    before: Callable[[], None] | None = None,
    own_time: bool = False,
) -> None:
    """Run the systems round after round (the first is the reference of the ratios); ``fresh``:
    sync before each system and delete its output after; ``before``: called before each system
    (untimed); ``own_time``: the systems return the seconds to count (else the call is timed)."""
    wd = tempfile.mkdtemp(prefix="floors-", dir=os.environ.get("WD"))
    names = list(systems)
    times: dict[str, list[float]] = {k: [] for k in names}
    ratios: dict[str, list[float]] = {k: [] for k in names[1:]}
    try:
        for i in range(rounds + 1):  # round 0 is a warm-up
            took = {}
            for k in names if i % 2 else names[::-1]:
                p = os.path.join(wd, f"{k.replace(' ', '_')}-{i}")
                if fresh:
                    memtree.store.writing.write.wait_for_removals()
                    os.sync()
                if before is not None:
                    before()
                t0 = time.perf_counter()
                out = systems[k](p)
                took[k] = out if own_time else time.perf_counter() - t0
                del out
                if fresh:
                    shutil.rmtree(p, ignore_errors=True)
            if i:
                for k in names:
                    times[k].append(took[k])
                for k in names[1:]:
                    ratios[k].append(took[k] / took[names[0]])
    finally:
        shutil.rmtree(wd, ignore_errors=True)
    print(f"{names[0]}: median {statistics.median(times[names[0]]) * 1e3:.3f} ms ({rounds} rounds)")
    for k in names[1:]:
        print(f"{k}: median {statistics.median(times[k]) * 1e3:.3f} ms, "
              f"median ratio to {names[0]} {statistics.median(ratios[k]):.2f}")


def main(argv: list[str]) -> None:
    what = argv[0] if argv else "w3"
    if what == "w3":
        datum = memtree.TensorTree(
            {"img": torch.zeros(3, 64, 64, dtype=torch.uint8), "label": torch.zeros((), dtype=torch.int64)}
        ).expand(1_000_000)
        _alternate(
            {
                "bare mkdir+ftruncate+map": _w3_bare,
                "commit syscalls only": _w3_commit_syscalls,
                "memtree memmap_like": lambda p: datum.memmap_like(p),
            },
            int(argv[1]) if len(argv) > 1 else 50,
            fresh=False,
        )
    elif what == "save":
        which = argv[1]
        rounds = int(argv[2]) if len(argv) > 2 else 5
        threads = int(argv[3]) if len(argv) > 3 else 2
        size = float(argv[4]) if len(argv) > 4 else 0.25
        layout = (w1_layout if which == "w1" else w2_layout)({"quick": False, "size_gib": size})
        prepare_index(layout)
        tensors = make_tensors(layout)
        data = nest(layout, tensors)
        kind = "raw-files" if which == "w2" else "raw"
        systems: dict[str, Callable[[str], Any]] = {
            kind: lambda p: save(Store(kind, kind), layout, tensors, p),
            f"memtree t{threads}": lambda p: memtree.TensorTree(data).memmap(p, num_threads=threads),
        }
        if Store("tensordict", "tensordict").missing() is None:
            from tensordict import TensorDict

            systems[f"tensordict t{threads}"] = lambda p: TensorDict(data, batch_size=[]).memmap(
                p, num_threads=threads
            )
        _alternate(systems, rounds, fresh=True)
    elif what in ("touch", "touch-cold"):
        layout = w1_layout({"quick": False, "size_gib": 1})
        wd = tempfile.mkdtemp(prefix="floors-", dir=os.environ.get("WD"))
        path, raw = os.path.join(wd, "t"), os.path.join(wd, "raw.bin")
        try:
            tensors = make_tensors(layout)
            memtree.TensorTree(nest(layout, tensors)).memmap(path, num_threads=2)
            with open(raw, "wb") as f:
                for t in tensors:
                    f.write(t.contiguous().view(-1).view(torch.uint8).numpy())
            del tensors

            def touch(**kw: Any) -> Callable[[str], float]:
                def run(_: str) -> float:
                    tree = memtree.load_memmap(path, **kw)
                    return sum(float(tree[key].sum()) for key, _, _ in layout)
                return run

            def one_file(_: str) -> float:  # the raw limit: every tensor in one mapped file
                fd = os.open(raw, os.O_RDONLY)
                flat = torch.from_file(f"/proc/self/fd/{fd}", shared=False, size=os.fstat(fd).st_size, dtype=torch.uint8)
                os.close(fd)
                total, at = 0.0, 0
                for _, shape, dtype in layout:
                    n = math.prod(shape) * dtype.itemsize
                    total += float(flat[at : at + n].view(dtype).view(shape).sum())
                    at += n
                return total

            _alternate(
                {
                    "raw: one file, one mapping": one_file,
                    "format floor: same files, fewest calls, no checks": lambda _: sum(
                        float(t.sum()) for t in _bare_walk(path).values()
                    ),
                    "eager (lazy=False)": touch(lazy=False),
                    "lazy": touch(),
                    "lazy, mode='r'": touch(mode="r"),
                },
                int(argv[1]) if len(argv) > 1 else 5,
                fresh=False,
                before=(lambda: _evict_or_say([path, raw])) if what == "touch-cold" else None,
            )
        finally:
            shutil.rmtree(wd, ignore_errors=True)
    elif what in ("w4", "w4-ready"):  # W4's load + bind (w4: the model is built beforehand)
        import w4_model

        from safetensors.torch import load_file

        wd = tempfile.mkdtemp(prefix="floors-", dir=os.environ.get("WD"))
        cfg = {"quick": False, "workdir": wd}
        try:
            w4_model.prepare(cfg)
            base = w4_model._wd(cfg)
            rounds = int(argv[1]) if len(argv) > 1 else 21
            models: dict[str, list[Any]] = {}
            if what == "w4":  # built beforehand: only load + bind is timed
                for name in ("st", "floor", "mt"):
                    with memtree.empty_init():
                        models[name] = [w4_model._build(cfg) for _ in range(rounds + 1)]

            def bind(name: str, load: Callable[[Any], Any]) -> Callable[[str], Any]:
                if what == "w4":
                    return lambda _: load(models[name].pop())

                def ready(_: str) -> Any:  # w4-ready: build + load + bind, as run.py's W4 rows
                    with memtree.empty_init() if name == "mt" else torch.device("meta"):
                        model = w4_model._build(cfg)
                    return load(model)

                return ready

            wrapped = {
                "safetensors load_file + assign": bind(
                    "st", lambda m: m.load_state_dict(load_file(os.path.join(base, "model.safetensors")), assign=True)
                ),
                "format floor (bare walk, no checks) + assign": bind(
                    "floor", lambda m: m.load_state_dict(_bare_walk(os.path.join(base, "memtree")), assign=True)
                ),
                "memtree load_memmap + to_module": bind(
                    "mt", lambda m: memtree.load_memmap(os.path.join(base, "memtree")).to_module(m)
                ),
            }
            _alternate(wrapped, rounds, fresh=False)
        finally:
            shutil.rmtree(wd, ignore_errors=True)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
