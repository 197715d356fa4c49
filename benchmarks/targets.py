"""The performance targets the issues set: one table (:data:`TARGETS`), judged from stored runs.

A target names the workload, operation and cache state it is measured in, memtree's system,
its reference (a system, or the best of several: the one with the lowest median), a bound and
how the bound is read; its wording is the issue's, and neither the wording nor the reference
changes once an issue set it (a later issue adds a row).

How a target is judged (:func:`judge`), from the raw times of one stored run:

* the value is computed from the paired rounds of one comparison: each round's time of memtree
  over the reference's (``ratio``), or the reference's over memtree's (``speed``), then the
  median over the rounds (``stat="median"``) or the worst round (``stat="max"``: "never slower");
  ``seconds`` compares memtree's median time itself, ``metric`` a measured value;
* **met** only when that value meets the bound, every timed run of the rows involved was
  checked, a cold comparison was verified cold before every run (``mincore``), the run had at
  least ``min_rounds`` rounds, was not a ``--quick`` run, and its load stayed at or under
  ``results.QUIET_LOAD``; **missed** when the value does not meet the bound (from a loaded run
  it says so); otherwise **not judged**, with the reason. A miss is a miss: the note of the
  target says which floor explains it, when one was measured.

Adding a workload's targets is adding rows to :data:`TARGETS`.

Example:
    >>> from results import Row, Run
    >>> rows = [Row("w1", "save", "", "memtree t2", runs=[1.0] * 5, checked=5),
    ...         Row("w1", "save", "", "raw", runs=[1.0] * 5, checked=5, limit=True)]
    >>> t = Target("example", "w1", "save", "", ("memtree t2",), ("raw",), bound=1.15)
    >>> judge(t, Run({"date": "2026-01-01", "load_start": 0.2}, rows)).verdict
    'met'
    >>> judge(t, Run({"date": "2026-01-01", "load_start": 3.0}, rows)).verdict
    'not judged'
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

from results import QUIET_LOAD, Row, Run, paired_ratios

MiB = 1 << 20
LIBS_W4 = ("torch.load + load_state_dict", "torch.load(mmap) + assign", "safetensors + assign",
           "tensordict to_module", "tensorizer")
ANCHORS_W1 = ("tensordict t0", "tensordict t2", "tensordict t8", "safetensors", "torch.save/load",
              "tensorizer")
MEMTREE_THREADS = ("memtree t0", "memtree t2", "memtree t8")
#: The workloads of issue 9's memory lines ("every workload" when they were set).
MEMORY_WORKLOADS = ("w1", "w2", "w3", "w4", "w5")


@dataclass(frozen=True)
class Target:
    """One target; see the module docstring."""

    text: str  # the target, as the issue worded it
    workload: str
    op: str
    cache: str  # "warm", "cold" or "" (an operation that reads nothing back)
    mine: tuple[str, ...]  # memtree's system (several: the best of them, by median)
    ref: tuple[str, ...] = ()  # the reference (several: see ``vs``)
    bound: float = 1.0
    kind: str = "ratio"  # "ratio" (mine / ref <= bound), "speed" (ref / mine >= bound),
    #                      "seconds" (median <= bound), "metric" (Row.metrics[metric] <= bound),
    #                      "report" (mine / ref, reported: the issue asks for the ratio, sets no bound)
    stat: str = "median"  # over the rounds: "median", or "max" (every round must meet it)
    vs: str = "best"  # several refs: "best" (lowest median), "each" (every one), "slowest"
    #                   (the slowest of them in each round: min(disk, PCIe) as a bandwidth)
    metric: str = ""
    min_rounds: int = 5
    issue: str = ""
    floor: str = ""  # what explains a miss, where a floor was measured (shown with a miss)


W7_SIZES = ("50 MB", "500 MB", "2 GB")
W9_ROWS = ("4 KiB", "64 KiB", "1 MiB")  # the row sizes of W9's writer comparisons (w9_datasets.ROW_SIZES)
W6_SOURCES = (("memtree", "a memtree directory"), ("memtree (safetensors file)", "a .safetensors file"),
              ("memtree (torch file)", "a torch.save file"))

TARGETS: list[Target] = [
    # issue 9: W1..W5 against the incumbents and the raw limit
    Target("W1 save ≤ fastest anchor", "w1", "save", "", MEMTREE_THREADS, ANCHORS_W1, issue="9"),
    Target("W1 save 1 GiB / 195 tensors, 2 threads: ≤ 1.15× a raw write", "w1", "save", "",
           ("memtree t2",), ("raw", "raw-noprealloc"), 1.15, issue="9"),
    Target("W1 open ≤ 2 ms", "w1", "open", "warm", ("memtree t0",), bound=0.002, kind="seconds",
           issue="9"),
    Target("W1 open + touch all: ≤ 1.2× raw mmap", "w1", "open+touch", "warm", ("memtree t0",),
           ("raw",), 1.2, issue="9",
           floor="format floor (the same files, no checks) 1.31× raw, back to back (HISTORY.md, third pass)"),
    Target("W1 open + touch all: ≤ 1.2× raw mmap (cold)", "w1", "open+touch", "cold", ("memtree t0",),
           ("raw",), 1.2, issue="9",
           floor="format floor 1.32× raw cold, back to back (HISTORY.md, third pass)"),
    Target("W2 save ≤ 1.3× bare file creation", "w2", "save", "", MEMTREE_THREADS, ("raw-files",), 1.3,
           issue="9"),
    Target("W2 save 20k leaves: ≥ 3× faster than tensordict (best threads)", "w2", "save", "",
           MEMTREE_THREADS, ("tensordict t0", "tensordict t2", "tensordict t8"), 3.0, kind="speed",
           issue="9", floor="3× needs 0.60× the bare creation of the same files (HISTORY.md, third pass)"),
    Target("W2 save 20k leaves: ≤ 1.5× safetensors", "w2", "save", "", MEMTREE_THREADS, ("safetensors",),
           1.5, issue="28"),
    Target("W2 open ≤ 50 ms", "w2", "open", "warm", ("memtree t0",), bound=0.050, kind="seconds", issue="9"),
    # issue 28: many small leaves (benchmarks/w11_small_leaves.py)
    Target("5,000 × 4 KiB leaves in 50 groups: save ≤ 2× safetensors.save_file", "w11", "save", "",
           MEMTREE_THREADS, ("safetensors",), 2.0, issue="28"),
    Target("5,000 × 4 KiB leaves in 50 groups: cold open + read of every leaf ≤ 1.5× safetensors.load_file",
           "w11", "open+touch", "cold", ("memtree t0", "memtree eager"), ("safetensors load_file",), 1.5,
           issue="28"),
    Target("5,000 × 4 KiB leaves in 50 groups: copy with cp -r ≤ 5× copying the single safetensors file",
           "w11", "copy (cp -r)", "warm", ("memtree t0",), ("safetensors",), 5.0, issue="28"),
    Target("5,000 × 4 KiB leaves in 50 groups: files ≤ one per level + one per 64 MiB of packed data", "w11",
           "save", "", MEMTREE_THREADS, bound=0, kind="metric",
           metric="files beyond one per level and per 64 MiB packed", min_rounds=1, issue="28"),
    Target("W2 open+read one leaf ≤ 40 ms", "w2", "open+read one", "warm", ("memtree t0",), bound=0.040,
           kind="seconds", issue="9"),
    Target("W3 memmap_like of 1,000,000 items: ≤ 1.5× raw", "w3", "memmap_like", "",
           ("memtree t0", "memtree t2", "memtree t8"), ("raw",), 1.5, issue="9",
           floor="the atomic commit's own system calls: 1.93× the bare calls (HISTORY.md)"),
    Target("W3 memmap_like allocates (nearly) no blocks (≤ 1 MiB)", "w3", "memmap_like", "",
           ("memtree t0",), bound=MiB, kind="metric", metric="allocated", issue="9"),
    Target("W3 memmap_like flat RSS (≤ raw's + 10%, or < 8 MiB)", "w3", "memmap_like", "",
           ("memtree t0",), ("raw",), kind="rss_flat", issue="9"),
    Target("W3 write 1,000 by index ≤ 2× bare pwrite", "w3", "write 1,000", "", ("memtree t0",),
           ("raw",), 2.0, issue="9"),
    Target("W3 write 10,000 by index ≤ 2× bare pwrite", "w3", "write 10,000", "", ("memtree t0",),
           ("raw",), 2.0, issue="9"),
    Target("W3 batch reads ≤ tensordict's", "w3", "read batch 256", "", ("memtree t0",),
           ("tensordict t0",), 1.0, issue="9"),
    Target("W4 model ready in-process (124M, empty_init + load + bind): ≤ the best library", "w4",
           "load+bind+forward", "warm", ("memtree to_module",), LIBS_W4, issue="9",
           floor="format floor (no checks) 1.05× safetensors, back to back (HISTORY.md, third pass)"),
    Target("W4 ready peak RSS growth < 10% of the model", "w4", "load+bind", "warm",
           ("memtree to_module",), bound=0.1, kind="rss_of_model", issue="9"),
    Target("W4 first forward no slower than the anchors", "w4", "first forward", "warm",
           ("memtree to_module",), LIBS_W4, 1.0, issue="9"),
    Target("memory: peak RSS growth ≤ best anchor's + 10% (worst case over workloads)", "*", "*", "*",
           (), kind="memory", metric="rss_peak", issue="9"),
    Target("memory: peak anon growth ≤ best anchor's + 10% (worst case over workloads)", "*", "*", "*",
           (), kind="memory", metric="anon_peak", issue="9"),
    # issue 17: resume into live modules (W6), a model ready in a fresh process
    Target("W6 warm: ≥ 90% of the bare threaded preadv floor in the median of at least 9 alternated "
           "pairs", "w6", "load, one process", "warm", ("memtree",), ("floor",), 0.9, kind="speed",
           min_rounds=9, issue="17"),
    *[
        Target(f"W6: never slower than safetensors.load_file + load_state_dict or torch.load(mmap=True) "
               f"+ load_state_dict, {cache}, from {what}", "w6", "load, fresh process", cache, (mine,),
               ("safetensors", "torch mmap"), 1.0, stat="max", vs="each", issue="17")
        for cache in ("cold", "warm") for mine, what in W6_SOURCES
    ],
    *[
        Target(f"W6 anonymous memory beyond the model ≤ 64 MiB ({cache})", "w6", "load, fresh process",
               cache, tuple(m for m, _ in W6_SOURCES), bound=64 * MiB, kind="metric",
               metric="anon beyond model", issue="17")
        for cache in ("cold", "warm")
    ],
    *[
        Target(f"Model ready to run ({label}, fresh process, same construction for all): memtree ≤ the "
               f"best library to the first forward's output, {cache}", "w4",
               f"fresh process load+bind+forward ({model})", cache, ("memtree to_module",), LIBS_W4,
               issue="17/25")
        for model, label in (("w4", "W4"), ("gpt2", "GPT-2 124M")) for cache in ("cold", "warm")
    ],
    Target("import memtree ≤ 0.1 s (after import torch, fresh process)", "w4", "fresh process import",
           "", ("memtree",), bound=0.1, kind="seconds", issue="17"),
    # issue 18: checksums by default, training checkpoints (W7)
    Target("Checksums by default: ≤ 1.10× W1's save wall time with the fast-hash extra", "w1", "save", "",
           ("memtree t2 xxh3",), ("memtree t2 no checksum",), 1.10, issue="18"),
    Target("Checksums by default: ≤ 1.30× W1's save wall time with the standard library alone", "w1",
           "save", "", ("memtree t2 crc32",), ("memtree t2 no checksum",), 1.30, issue="18",
           floor="zlib.crc32 alone costs 0.92× the write's CPU (HISTORY.md, issue 18)"),
    *[
        t
        for size in W7_SIZES
        for t in (
            Target(f"W7 async checkpoint pause ≤ 1.1× a copy_ of the state into preallocated memory "
                   f"({size})", "w7", f"save, {size} state", "", ("memtree async",),
                   ("copy_ into preallocated",), 1.1, issue="18"),
            Target(f"W7 async checkpoint pause ≤ 0.5× a blocking save of the same state ({size})", "w7",
                   f"save, {size} state", "", ("memtree async",), ("memtree blocking",), 0.5, issue="25"),
        )
    ],
    Target("W7 incremental save takes ≤ 25% of a full save's time", "w7", "next checkpoint, 5% changed",
           "", ("memtree blocking, incremental",), ("memtree blocking, full",), 0.25, issue="18"),
    Target("W7 incremental save writes ≤ 6% of a full save's bytes (5% changed)", "w7",
           "next checkpoint, 5% changed", "", ("memtree blocking, incremental",),
           ("memtree blocking, full",), 0.06, kind="metric_ratio", metric="bytes written", issue="18"),
    Target("W7 10 fine-tuning checkpoints where only adapters change occupy ≤ 1.2× one", "w7",
           "10 adapter checkpoints", "", ("memtree incremental",), bound=1.2, kind="metric",
           metric="disk all / disk first", min_rounds=1, issue="18"),
    # issue 27: many ranks, one tree (benchmarks/w8_distributed.py); the times to a consolidated
    # artifact (memtree vs DCP + its consolidation, DCP's HF writer) are reported, not bounded
    Target("W8 collective save on 2 ranks: the slowest rank takes ≤ 1.2× the fastest", "w8",
           "save to a consolidated artifact", "", ("memtree collective",), bound=1.2, kind="metric",
           metric="max/min rank time", issue="27"),
    Target("W8 rank-aware load on 2 ranks: the slowest rank takes ≤ 1.2× the fastest", "w8", "load into FSDP2",
           "warm", ("memtree load_into_module",), bound=1.2, kind="metric", metric="max/min rank time",
           issue="27"),
    # issue 26: tensor subclasses (benchmarks/w10_quantized.py: a GPT-2-sized int8 weight-only model)
    *[
        Target(f"load_into_module into a quantized model: GiB/s within 10% of a plain-tensor load of the "
               f"same bytes ({cache})", "w10", "load_into_module", cache, ("memtree quantized",),
               ("memtree plain, same bytes",), 1.1, issue="26")
        for cache in ("cold", "warm")
    ],
    *[
        Target(f"GPT-2-sized int8 weight-only {what}: memtree vs {ref} (ratio reported; the issue sets no "
               f"bound){f', {cache}' if cache else ''}", "w10", op, cache, (mine,), (ref,), kind="report",
               issue="26")
        for what, op, caches, mine, refs in (
            ("save", "save", ("",), "memtree memmap", ("torch.save", "torchao safetensors")),
            ("load, ready to run", "load, ready to run", ("cold", "warm"), "memtree load_into_module",
             ("torch.load(weights_only=True) + assign", "torchao safetensors + assign")),
        )
        for cache in caches for ref in refs
    ],
    # issue 28: W9 datasets (benchmarks/w9_datasets.py)
    Target("W9 random 256-row batches, warm: ≥ 0.8× numpy fancy indexing on the same bytes", "w9",
           "random batch 256", "warm", ("memtree",), ("numpy memmap",), 0.8, kind="speed", issue="28"),
    Target("W9 random 256-row batches, cold: ≥ 1.5× numpy", "w9", "random batch 256", "cold", ("memtree",),
           ("numpy memmap",), 1.5, kind="speed", issue="28"),
    Target("W9 through DataLoader(num_workers=2) with memtree's batch sampler: ≥ 0.8× a numpy-memmap dataset "
           "written the same way", "w9", "DataLoader 2 workers", "warm", ("memtree",), ("numpy memmap",), 0.8,
           kind="speed", issue="28"),
    *[
        Target(f"W9 filling by index, {label} rows: 2 writer processes ≥ 1.5× one writer's throughput", "w9",
               f"fill {label} rows", "", ("memtree 2 writers",), ("memtree 1 writer",), 1.5, kind="speed",
               issue="28")
        for label in W9_ROWS
    ],
    # issue 25: GPU loads (benchmarks/gpu_load.py)
    *[
        t
        for cache in ("cold", "warm")
        for t in (
            Target(f"GPU: ≥ 70% of min(disk read, PCIe) ({cache})", "gpu", "load into existing tensors",
                   cache, ("memtree load_into_module",), ("disk read", "PCIe"), 0.7, kind="speed",
                   vs="slowest", issue="25"),
            Target(f"GPU: ≥ 2× safetensors.load_file(device=\"cuda\") + load_state_dict ({cache})", "gpu",
                   "load into existing tensors", cache, ("memtree load_into_module",),
                   ("safetensors load_file + load_state_dict",), 2.0, kind="speed", issue="25"),
        )
    ],
]


@dataclass
class Judgement:
    """A target judged against one run (or, for the memory lines, the latest run of each workload)."""

    target: Target
    verdict: str  # "met", "missed", "not judged", "not measured"
    measured: str  # the value, the medians and the spread, or why there is none
    why: str = ""  # the reason of a "not judged", or the floor of a "missed"
    runs: tuple[Run, ...] = ()


def _rows(run: Run, t: Target, names: tuple[str, ...]) -> list[Row]:
    return [r for r in run.rows if (r.workload, r.op, r.cache, r.system) in
            {(t.workload, t.op, t.cache, n) for n in names}]


def _best(rows: list[Row], key: Callable[[Row], float] = lambda r: r.median) -> Row | None:
    usable = [r for r in rows if r.runs]
    return min(usable, key=key) if usable else None


def _s(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds < 1 else f"{seconds:.3f} s"


def _spread(r: Row) -> str:
    return f"{r.system} {_s(r.median)} [{_s(min(r.runs))}–{_s(max(r.runs))}]"


def _problems(run: Run, rows: list[Row], cold: bool, min_rounds: int) -> list[str]:
    """Why these rows cannot make a target met (other than its value)."""
    why = []
    if any(r.checked is None for r in rows):
        why.append("legacy harness: runs not checked, systems not measured in paired rounds")
    partly = [r.system for r in rows if r.checked is not None and r.checked != len(r.runs)]
    if partly:
        why.append(f"not every run checked: {', '.join(partly)}")
    if cold:
        warm = [r.system for r in rows if not r.cold_verified]
        if warm:
            why.append(f"not verified cold before every run (mincore): {', '.join(warm)}")
    rounds = min((len(r.runs) for r in rows), default=0)
    if rounds < min_rounds:
        why.append(f"{rounds} rounds (at least {min_rounds} needed)")
    load = run.load
    if load is None:
        why.append("load average not recorded")
    elif load > QUIET_LOAD:
        why.append(f"load {load:.2f} > {QUIET_LOAD}")
    return why


def judge(t: Target, run: Run) -> Judgement:
    """Judge ``t`` against the rows of ``run``; see the module docstring."""
    if t.kind == "memory":
        return _judge_memory(t, [run])
    mine_rows = [r for r in _rows(run, t, t.mine) if r.error is None]
    ref_rows = [r for r in _rows(run, t, t.ref) if r.error is None]
    errors = [f"{r.system}: {r.error}" for r in _rows(run, t, t.mine + t.ref) if r.error is not None]
    mine = _best(mine_rows)
    if t.kind == "metric" and len(mine_rows) > 1:  # a bound on every listed system: the worst one
        mine = max(mine_rows, key=lambda r: _metric(r, t.metric) if _has(r, t.metric) else -1.0)
    if mine is None or (t.ref and not ref_rows):
        return Judgement(t, "not measured", "; ".join(errors) or "not in this run", runs=(run,))
    used = [mine]
    try:
        value, measured, ok = _value(t, mine, ref_rows, used)
    except ValueError as err:  # rows not measured in the same rounds
        return Judgement(t, "not judged", str(err), runs=(run,))
    if run.info.get("quick"):
        return Judgement(t, "not judged", measured, "a --quick run (tiny sizes)", (run,))
    why = _problems(run, used, t.cache == "cold", t.min_rounds)
    if t.kind == "report":  # no bound to meet: the ratio, and what keeps it from being a result
        return Judgement(t, "reported" if not why else "not judged", measured, "; ".join(why), (run,))
    if ok and why:
        return Judgement(t, "not judged", measured, "; ".join(why), (run,))
    if ok:
        return Judgement(t, "met", measured, runs=(run,))
    return Judgement(t, "missed", measured, "; ".join(filter(None, [t.floor] + why)), (run,))


def _value(t: Target, mine: Row, refs: list[Row], used: list[Row]) -> tuple[float, str, bool]:
    """(value, how it reads, whether it meets the bound)."""
    if t.kind == "seconds":
        return mine.median, _spread(mine), mine.median <= t.bound
    if t.kind == "metric":
        value = _metric(mine, t.metric)
        in_mib = t.metric in ("allocated", "anon beyond model")
        shown = f"{value / MiB:.2f} MiB (bound {t.bound / MiB:g} MiB)" if in_mib else f"{value:.4g} (bound {t.bound:g})"
        return value, f"{mine.system}: {t.metric} {shown}", value <= t.bound
    if t.kind == "metric_ratio":
        ref = refs[0]
        used.append(ref)
        value = _metric(mine, t.metric) / _metric(ref, t.metric)
        return value, f"{value:.4f} ({mine.system} {_metric(mine, t.metric):,.0f} / {ref.system} " \
                      f"{_metric(ref, t.metric):,.0f} {t.metric})", value <= t.bound
    if t.kind == "rss_flat":
        ref = refs[0]
        used.append(ref)
        assert mine.rss_peak is not None and ref.rss_peak is not None
        ok = mine.rss_peak <= max(1.1 * ref.rss_peak, 8 * MiB)
        return float(mine.rss_peak), f"{mine.rss_peak / MiB:.1f} MiB (raw {ref.rss_peak / MiB:.1f} MiB)", ok
    if t.kind == "rss_of_model":
        model = mine.metrics.get("model bytes")
        if not model or mine.rss_peak is None:
            raise ValueError("model size or peak RSS not recorded")
        value = mine.rss_peak / model
        return value, f"{value:.1%} of {model / MiB:.0f} MiB", value < t.bound
    # time ratios from the paired rounds (a legacy run has none: the ratio of its medians)
    per_round: list[float]
    if any(r.checked is None for r in [mine, *refs]):
        # the reference that decides: the slowest for "slowest", else the fastest
        legacy_ref = (max if t.vs == "slowest" else min)(refs, key=lambda r: r.median)
        used.append(legacy_ref)
        value = mine.median / legacy_ref.median if t.kind == "ratio" else legacy_ref.median / mine.median
        ok = value <= t.bound if t.kind == "ratio" else value >= t.bound
        return value, f"{value:.4f} (ratio of the medians); {_spread(mine)} vs {_spread(legacy_ref)}", ok
    if t.vs == "each":
        used += refs
        per_round = [max(x) for x in zip(*(paired_ratios(mine, r) for r in refs))]
        refs_text = ", ".join(_spread(r) for r in refs)
    elif t.vs == "slowest":
        used += refs
        if len({len(r.runs) for r in refs + [mine]}) != 1:
            raise ValueError("the rows were not measured in the same rounds")
        slowest = [max(x) for x in zip(*(r.runs for r in refs))]
        per_round = [m / s for m, s in zip(mine.runs, slowest)]
        refs_text = ", ".join(_spread(r) for r in refs)
    else:
        best = _best(refs)
        assert best is not None
        used.append(best)
        per_round = paired_ratios(mine, best)
        refs_text = _spread(best)
    if t.kind == "speed":
        per_round = [1 / x for x in per_round]
        value = statistics.median(per_round) if t.stat == "median" else min(per_round)
        ok = value >= t.bound
    else:
        value = statistics.median(per_round) if t.stat == "median" else max(per_round)
        ok = value <= t.bound
    below = sum(1 for x in per_round if (x < t.bound if t.kind == "speed" else x > t.bound))
    word = "median" if t.stat == "median" else "worst"
    measured = (f"{value:.4f} ({word} of {len(per_round)} rounds, {min(per_round):.4f}–{max(per_round):.4f}, "
                f"{below} beyond the bound); {_spread(mine)} vs {refs_text}")
    return value, measured, ok


def _metric(r: Row, name: str) -> float:
    if name in ("allocated", "rss_peak", "anon_peak", "apparent"):
        value = getattr(r, name)
    else:
        value = r.metrics.get(name)
    if value is None:
        raise ValueError(f"{r.system}: {name} not recorded")
    return float(value)


def _has(r: Row, name: str) -> bool:
    return (getattr(r, name, None) if name in ("allocated", "rss_peak", "anon_peak", "apparent")
            else r.metrics.get(name)) is not None


def _is_memtree(name: str) -> bool:
    return name.startswith("memtree")


def _is_anchor(r: Row) -> bool:
    return not r.limit and "memtree" not in r.system and any(
        a in r.system for a in ("safetensors", "torch", "tensordict", "tensorizer"))


def _judge_memory(t: Target, runs: list[Run]) -> Judgement:
    """memtree's worst excess over the best anchor's peak (+10% +1 MiB), over every comparison of
    W1..W5 with both (W4: the whole ``load+bind+forward``; rows measured in a child process have
    none)."""
    worst: tuple[float, str] | None = None
    used: list[Row] = []
    for run in runs:
        groups = sorted({(r.workload, r.op, r.cache) for r in run.rows if r.workload in MEMORY_WORKLOADS})
        for wl, op, cache in groups:
            if wl == "w4" and op != "load+bind+forward":
                continue
            group = [r for r in run.rows if (r.workload, r.op, r.cache) == (wl, op, cache)
                     and r.error is None and getattr(r, t.metric) is not None]
            mine = _best([r for r in group if _is_memtree(r.system)], key=lambda r: getattr(r, t.metric))
            anchor = _best([r for r in group if _is_anchor(r)], key=lambda r: getattr(r, t.metric))
            if mine is None or anchor is None:
                continue
            used += [mine, anchor]
            excess = getattr(mine, t.metric) - (1.1 * getattr(anchor, t.metric) + MiB)
            if worst is None or excess > worst[0]:
                worst = (excess, f"{wl} {op} {cache or '-'}: {mine.system} {getattr(mine, t.metric) / MiB:.1f} "
                                 f"MiB vs {anchor.system} {getattr(anchor, t.metric) / MiB:.1f} MiB")
    if worst is None:
        return Judgement(t, "not measured", "no comparison with memtree and an anchor", runs=tuple(runs))
    why = sorted({w for run in runs for w in _problems(run, [r for r in used if r in run.rows], False, 0)})
    if any(run.info.get("quick") for run in runs):
        return Judgement(t, "not judged", worst[1], "a --quick run (tiny sizes)", tuple(runs))
    if worst[0] <= 0:
        return Judgement(t, "not judged" if why else "met", worst[1], "; ".join(why), tuple(runs))
    return Judgement(t, "missed", worst[1], "; ".join(why), tuple(runs))


def latest(t: Target, runs: list[Run]) -> Judgement:
    """``t`` judged against the newest run that measured it (``runs`` oldest first)."""
    if t.kind == "memory":
        newest: dict[str, Run] = {}
        for run in runs:
            for wl in {r.workload for r in run.rows} & set(MEMORY_WORKLOADS):
                newest[wl] = run
        chosen = list({id(r): r for r in newest.values()}.values())
        return _judge_memory(t, chosen) if chosen else Judgement(t, "not measured", "no stored run")
    for run in reversed(runs):
        j = judge(t, run)
        if j.verdict != "not measured":
            return j
    return Judgement(t, "not measured", "no stored run measured it")


def evaluate(runs: list[Run]) -> list[Judgement]:
    """Every target, judged against the newest stored run that measured it."""
    return [latest(t, runs) for t in TARGETS]

