"""The stored form of a benchmark run: one JSON document per run, in ``benchmarks/results/``.

A document is ``{"format": FORMAT, "run": {...}, "rows": [...]}``. ``run`` says when, where and
how it was measured (date, command, commit, machine, load average, rounds); each row is one
system doing one operation (:class:`Row`), with every timed run in round order, so that ratios
are computed from the raw times of the same rounds (``targets.py``), never from rounded or
already-divided numbers.

This module is pure (no torch): ``targets.py`` and ``report.py`` read results without importing
the workloads.

Example:
    >>> row = Row("w1", "save", "", "raw", runs=[0.2, 0.3, 0.25], checked=3)
    >>> round(row.median, 3), row.valid
    (0.25, True)
"""

from __future__ import annotations

import glob
import json
import os
import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Any

FORMAT = "memtree-bench/1"
HERE = os.path.dirname(os.path.abspath(__file__))
#: Where the runs that ``run.py report`` reads are stored (``run.py ... --store``).
STORE = os.path.join(HERE, "results")
#: The most load (runnable tasks of *other* processes, and the 1-minute load average when the
#: run started) under which a run may call a target met: this is a 2-core machine.
QUIET_LOAD = 1.5


@dataclass
class Row:
    """One system doing one operation in one cache state, over interleaved rounds.

    ``runs[i]`` is the time of round ``i`` (after the untimed warm-up rounds); every system of
    one comparison has the same rounds, so ``runs`` of two rows pair up by index. ``checked``
    counts the timed runs whose output was checked and found right (a row whose check failed
    has an ``error`` instead). ``resident[i]`` is the fraction of the files' pages in the page
    cache just before run ``i`` (``mincore``): 0.0 for every run of a cold row, or it is not
    cold. ``metrics`` holds what else was measured (bytes written, anonymous memory...).
    """

    workload: str
    op: str
    cache: str  # "warm", "cold", or "" (an operation that reads nothing back: a save)
    system: str
    runs: list[float] = field(default_factory=list)
    limit: bool = False  # a raw limit or floor, not a library
    checked: int | None = 0  # None: a legacy row whose runs were never checked
    resident: list[float] = field(default_factory=list)
    rss_peak: int | None = None  # bytes: median VmHWM growth
    anon_peak: int | None = None  # bytes: median sampled RssAnon growth
    apparent: int | None = None
    allocated: int | None = None
    files: int | None = None
    others_load: float | None = None  # mean runnable tasks of other processes during the runs
    metrics: dict[str, float] = field(default_factory=dict)
    note: str = ""
    error: str | None = None  # "N/A: ..." (cannot run here) or "FAILED ..." / "check failed ..."

    @property
    def valid(self) -> bool:
        """True when the row holds measurements that were all checked."""
        return self.error is None and bool(self.runs) and self.checked == len(self.runs)

    @property
    def median(self) -> float:
        """Median of the timed runs (seconds)."""
        return statistics.median(self.runs)

    @property
    def cold_verified(self) -> bool:
        """A cold row whose every timed run started with none of its files' pages cached."""
        return self.cache == "cold" and len(self.resident) == len(self.runs) > 0 and not any(
            self.resident
        )

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Row:
        """A row from its stored form; legacy rows (``seconds``, no ``checked``) are kept as
        unchecked (``checked=None``)."""
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in doc.items() if k in names}
        if "checked" not in doc:  # written before every timed run was checked
            kw["checked"] = None
        if kw.get("error") is None and str(doc.get("note", "")).startswith(("N/A", "FAILED")):
            kw["error"] = doc["note"]
        return cls(**kw)


def paired_ratios(mine: Row, ref: Row) -> list[float]:
    """``mine``'s time over ``ref``'s, round by round (rows of one comparison pair up by index).

    Example:
        >>> paired_ratios(Row("w", "op", "", "a", runs=[2.0, 3.0]), Row("w", "op", "", "b", runs=[1.0, 2.0]))
        [2.0, 1.5]
    """
    if len(mine.runs) != len(ref.runs):
        raise ValueError(
            f"{mine.system} and {ref.system} ({mine.workload} {mine.op} {mine.cache}) were not "
            f"measured in the same rounds ({len(mine.runs)} and {len(ref.runs)} runs)"
        )
    return [a / b for a, b in zip(mine.runs, ref.runs)]


@dataclass
class Run:
    """A stored run: what was measured (``rows``) and how (``info``)."""

    info: dict[str, Any]
    rows: list[Row]
    path: str = ""

    @property
    def date(self) -> str:
        return str(self.info.get("date", ""))

    @property
    def load(self) -> float | None:
        """The highest load seen: the 1-minute load average when the run started and the
        runnable tasks of other processes during each comparison (None if not recorded)."""
        seen = [x for x in [self.info.get("load_start")] if isinstance(x, (int, float))]
        seen += [r.others_load for r in self.rows if r.others_load is not None]
        return max(seen) if seen else None

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "run": self.info, "rows": [asdict(r) for r in self.rows]}


def load_run(path: str) -> Run:
    """Read one stored run."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} document (run.py --json writes them)")
    return Run(doc["run"], [Row.from_json(r) for r in doc["rows"]], path)


def save_run(run: Run, path: str) -> None:
    """Write one run (``indent=1``: diffs of stored results stay readable)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(run.to_json(), f, indent=1)
        f.write("\n")


def stored_runs(folder: str = STORE) -> list[Run]:
    """Every stored run, oldest first."""
    runs = [load_run(p) for p in sorted(glob.glob(os.path.join(folder, "*.json")))]
    return sorted(runs, key=lambda r: r.date)
