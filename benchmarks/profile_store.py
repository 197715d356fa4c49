"""Profile one memtree store operation with cProfile (where does the time go?).

Usage (from the repository root):

    .venv/bin/python benchmarks/profile_store.py w2-save      # 20,000 leaves: TensorTree.memmap
    .venv/bin/python benchmarks/profile_store.py w2-open      # load_memmap of them
    .venv/bin/python benchmarks/profile_store.py w3-write     # 1,000 random data[i] = item
    .venv/bin/python benchmarks/profile_store.py w1-save --size-gib 1
    .venv/bin/python benchmarks/profile_store.py w1-touch      # load_memmap + sum of every leaf
    .venv/bin/python benchmarks/profile_store.py w4-bind       # load_memmap + to_module, W4's model
    .venv/bin/python benchmarks/profile_store.py w2-save --quick --top 15

Prints the top functions by cumulative and by own time. For system calls, run the same
command under ``strace -f -c -o calls.txt``; for native frames, ``py-spy record --native``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import sys
import tempfile
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from stores import make_tensors, nest, w1_layout, w2_layout  # noqa: E402


def _case(name: str, cfg: dict[str, Any], wd: str) -> Callable[[], Any]:
    from memtree import TensorTree, load_memmap

    path = os.path.join(wd, "tree")
    if name in ("w1-save", "w1-touch", "w2-save", "w2-open", "w2-touch"):
        layout = (w1_layout if name.startswith("w1") else w2_layout)(cfg)
        data = nest(layout, make_tensors(layout))
        if name.endswith("save"):
            return lambda: TensorTree(data).memmap(path, num_threads=cfg["threads"])
        TensorTree(data).memmap(path)
        if name == "w2-open":
            return lambda: load_memmap(path)
        return lambda: [float(t.sum()) for t in load_memmap(path).values(True, True)]
    if name == "w4-bind":  # the model is built beforehand, under empty_init: only load + bind
        import w4_model

        from memtree import empty_init

        w4_model.prepare(dict(cfg, workdir=wd))
        with empty_init():  # one for the warm-up, one for the profiled run
            models = [w4_model._build(dict(cfg, workdir=wd)) for _ in range(2)]
        src = os.path.join(w4_model._wd(dict(cfg, workdir=wd)), "memtree")
        return lambda: load_memmap(src).to_module(models.pop())
    if name == "w3-write":
        n = 2_000 if cfg["quick"] else 1_000_000
        datum = TensorTree(
            {
                "img": torch.zeros(3, 64, 64, dtype=torch.uint8),
                "label": torch.zeros((), dtype=torch.int64),
            }
        )
        data = datum.expand(n).memmap_like(path)
        idx = torch.randperm(n)[:1000].tolist()
        items = [
            TensorTree(
                {
                    "img": torch.full((3, 64, 64), i % 256, dtype=torch.uint8),
                    "label": torch.tensor(i),
                }
            )
            for i in idx
        ]

        def write() -> None:
            for i, item in zip(idx, items):
                data[i] = item

        return write
    raise SystemExit(f"unknown case {name}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("case", choices=["w1-save", "w1-touch", "w2-save", "w2-open", "w2-touch", "w3-write", "w4-bind"])
    p.add_argument("--size-gib", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    cfg = {"quick": args.quick, "size_gib": args.size_gib, "threads": args.threads}
    wd = tempfile.mkdtemp(prefix="memtree-profile-", dir=os.environ.get("BENCH_TMP"))
    try:
        fn = _case(args.case, cfg, wd)
        if args.case.endswith(("save", "bind")):
            fn()  # warm-up, then profile a second run (a save replaces the first)
        os.sync()  # earlier writes' dirty pages must not throttle the profiled run
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        for order in ("cumulative", "tottime"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(order).print_stats(args.top)
            print(out.getvalue())
    finally:
        shutil.rmtree(wd, ignore_errors=True)


if __name__ == "__main__":
    main()
