"""The issue's performance targets, checked against the rows of one run (met / not met).

Usage:

    .venv/bin/python benchmarks/targets.py rows.json      # rows written by run.py --json

``run.py`` prints the same table at the end of every run. Times are warm-cache medians unless a
line says otherwise; a target whose rows were not measured (a system not installed, a workload
not run) is reported as ``n/a``.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Iterable

Row = dict[str, Any]
MiB = 1024 * 1024
ANCHORS = ("safetensors", "torch", "tensordict", "tensorizer")


def _pick(rows: list[Row], workload: str, op: str, cache: str = "warm") -> list[Row]:
    want = "" if op in ("save", "memmap_like") or op.startswith(("write", "read batch")) else cache
    return [
        r
        for r in rows
        if (r["workload"], r["op"], r["cache"]) == (workload, op, want) and r["seconds"] is not None
    ]


def _best(rows: Iterable[Row], pred: Callable[[str], bool], key: str = "seconds") -> Row | None:
    cands = [r for r in rows if pred(r["system"]) and r.get(key) is not None]
    return min(cands, key=lambda r: r[key]) if cands else None


def _worst(rows: Iterable[Row], pred: Callable[[str], bool]) -> Row | None:
    cands = [r for r in rows if pred(r["system"])]
    return max(cands, key=lambda r: r["seconds"]) if cands else None


def _is_memtree(s: str) -> bool:
    return s.startswith("memtree")


def _is_anchor(s: str) -> bool:
    return "memtree" not in s and "raw" not in s and any(a in s for a in ANCHORS)


def _s(r: Row | None) -> str:
    return "-" if r is None else f"{r['seconds'] * 1000:.1f} ms ({r['system']})"


def _line(target: str, measured: str, ok: bool | None) -> tuple[str, str, str]:
    return target, measured, {True: "met", False: "**not met**", None: "n/a"}[ok]


def evaluate(rows: list[Row]) -> list[tuple[str, str, str]]:
    """(target, what was measured, met / not met / n/a) for every target of the issue."""
    out: list[tuple[str, str, str]] = []

    def ratio_line(target: str, mine: Row | None, ref: Row | None, limit: float) -> None:
        if mine is None or ref is None:
            out.append(_line(target, "not measured", None))
            return
        q = mine["seconds"] / ref["seconds"]
        out.append(_line(target, f"{q:.2f}× ({_s(mine)} vs {_s(ref)})", q <= limit))

    def abs_line(target: str, mine: Row | None, limit_s: float) -> None:
        if mine is None:
            out.append(_line(target, "not measured", None))
            return
        out.append(_line(target, _s(mine), mine["seconds"] <= limit_s))

    # W1
    save = _pick(rows, "w1", "save")
    m = _best(save, _is_memtree)
    ratio_line("W1 save ≤ fastest anchor", m, _best(save, _is_anchor), 1.0)
    ratio_line("W1 save ≤ 1.15× raw write", m, _best(save, lambda s: s.startswith("raw")), 1.15)
    abs_line("W1 open ≤ 2 ms", _best(_pick(rows, "w1", "open"), _is_memtree), 0.002)
    touch = _pick(rows, "w1", "open+touch")
    ratio_line(
        "W1 open+touch ≤ 1.2× raw mmap",
        _best(touch, _is_memtree),
        _best(touch, lambda s: s == "raw"),
        1.2,
    )
    touch_c = _pick(rows, "w1", "open+touch", "cold")
    ratio_line(
        "W1 open+touch ≤ 1.2× raw mmap (cold)",
        _best(touch_c, _is_memtree),
        _best(touch_c, lambda s: s == "raw"),
        1.2,
    )
    # W2
    save = _pick(rows, "w2", "save")
    m = _best(save, _is_memtree)
    floor = _best(save, lambda s: s == "raw-files")
    ratio_line("W2 save ≤ 1.3× bare file creation", m, floor, 1.3)
    td = _best(save, lambda s: s.startswith("tensordict"))
    if m is None or td is None:
        out.append(
            _line("W2 save ≥ 3× faster than tensordict (best threads)", "not measured", None)
        )
    else:
        q = td["seconds"] / m["seconds"]
        out.append(
            _line(
                "W2 save ≥ 3× faster than tensordict (best threads)",
                f"{q:.2f}× faster ({_s(m)} vs {_s(td)})",
                q >= 3,
            )
        )
    abs_line("W2 open ≤ 50 ms", _best(_pick(rows, "w2", "open"), _is_memtree), 0.050)
    abs_line(
        "W2 open+read one leaf ≤ 40 ms",
        _best(_pick(rows, "w2", "open+read one"), _is_memtree),
        0.040,
    )
    # W3
    like = _pick(rows, "w3", "memmap_like")
    m = _best(like, _is_memtree)
    raw = _best(like, lambda s: s == "raw")
    ratio_line("W3 memmap_like ≤ 1.5× bare ftruncate+map", m, raw, 1.5)
    if m is not None:
        out.append(
            _line(
                "W3 memmap_like allocates (nearly) no blocks (≤ 1 MiB)",
                f"{m['allocated'] / MiB:.2f} MiB",
                m["allocated"] <= MiB,
            )
        )
        flat = raw is not None and m["rss_peak"] <= max(1.1 * raw["rss_peak"], 8 * MiB)
        out.append(
            _line(
                "W3 memmap_like flat RSS (≤ raw's + 10%, or < 8 MiB)",
                f"{m['rss_peak'] / MiB:.1f} MiB",
                flat,
            )
        )
    for op in sorted(
        {r["op"] for r in rows if r["workload"] == "w3" and r["op"].startswith("write")}, key=len
    ):
        w = _pick(rows, "w3", op)
        ratio_line(
            f"W3 {op} by index ≤ 2× bare pwrite",
            _best(w, _is_memtree),
            _best(w, lambda s: s == "raw"),
            2.0,
        )
    reads = [
        r
        for r in rows
        if r["workload"] == "w3" and r["op"].startswith("read batch") and r["seconds"] is not None
    ]
    ratio_line(
        "W3 batch reads ≤ tensordict's",
        _best(reads, _is_memtree),
        _best(reads, lambda s: s.startswith("tensordict")),
        1.0,
    )
    # W4
    ready = _pick(rows, "w4", "ready")
    m = _best(ready, _is_memtree)
    ratio_line("W4 ready ≤ best library", m, _best(ready, _is_anchor), 1.0)
    fresh = _pick(rows, "w4", "ready, fresh process")
    ratio_line("W4 ready in a fresh process ≤ best library", _best(fresh, _is_memtree), _best(fresh, _is_anchor), 1.0)
    model = next(
        (r for r in rows if r["workload"] == "w4" and r["system"] == "raw mmap + assign"), None
    )
    if m is not None and model is not None and model.get("apparent"):
        frac = m["rss_peak"] / model["apparent"]
        out.append(
            _line(
                "W4 ready peak RSS growth < 10% of the model",
                f"{frac:.1%} of {model['apparent'] / MiB:.0f} MiB",
                frac < 0.1,
            )
        )
    else:
        out.append(_line("W4 ready peak RSS growth < 10% of the model", "not measured", None))
    fwd = _pick(rows, "w4", "first forward")
    ratio_line(
        "W4 first forward no slower than the anchors (≤ slowest)",
        _best(fwd, _is_memtree),
        _worst(fwd, _is_anchor),
        1.0,
    )
    # memory, every workload and op: memtree's peak RSS growth ≤ best anchor's + 10% (+1 MiB);
    # W4's two steps count together (a copy made while getting ready is not re-counted after)
    rows = _w4_ready_and_forward(rows)
    for key, what in (("rss_peak", "peak RSS growth"), ("anon_peak", "peak anon growth")):
        out.append(_memory_line(rows, key, what))
    return out


def _memory_line(rows: list[Row], key: str, what: str) -> tuple[str, str, str]:
    """memtree's worst excess over the best anchor's ``key`` across every workload and op."""
    worst: tuple[float, str] | None = None
    for wl, op, cache in sorted({(r["workload"], r["op"], r["cache"]) for r in rows}):
        if wl == "w4" and op != "ready+forward":
            continue
        group = [
            r
            for r in rows
            if (r["workload"], r["op"], r["cache"]) == (wl, op, cache) and r[key] is not None
        ]
        mine = _best(group, _is_memtree, key)
        anchor = _best(group, _is_anchor, key)
        if mine is None or anchor is None:
            continue
        excess = mine[key] - (1.1 * anchor[key] + MiB)
        if worst is None or excess > worst[0]:
            worst = (
                excess,
                f"{wl} {op} {cache}: {mine[key] / MiB:.1f} MiB vs {anchor['system']} "
                f"{anchor[key] / MiB:.1f} MiB",
            )
    target = f"memory: {what} ≤ best anchor's + 10% (worst case over workloads)"
    if worst is None:
        return _line(target, "not measured", None)
    return _line(target, worst[1], worst[0] <= 0)


def _w4_ready_and_forward(rows: list[Row]) -> list[Row]:
    """``rows`` plus one W4 row per system and cache: ready + first forward peak RSS growth."""
    extra = []
    for r in rows:
        if r["workload"] == "w4" and r["op"] == "ready" and r["rss_peak"] is not None:
            fwd = next(
                (
                    f
                    for f in rows
                    if (f["workload"], f["system"], f["op"], f["cache"])
                    == ("w4", r["system"], "first forward", r["cache"])
                    and f["rss_peak"] is not None
                ),
                None,
            )
            if fwd is not None:
                extra.append(
                    {
                        **r,
                        "op": "ready+forward",
                        "rss_peak": r["rss_peak"] + fwd["rss_peak"],
                        "anon_peak": (r["anon_peak"] or 0) + (fwd["anon_peak"] or 0),
                    }
                )
    return rows + extra


def markdown(rows: list[Row]) -> str:
    """The targets as a Markdown table."""
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    lines += [f"| {t} | {m} | {v} |" for t, m, v in evaluate(rows)]
    return "\n".join(lines)


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        print(markdown(json.load(f)))
