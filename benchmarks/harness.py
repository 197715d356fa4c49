"""How every comparison of the suite is measured: interleaved rounds, every timed run checked.

:func:`compare` measures the :class:`System` s of one comparison (the same work, one operation,
one cache state) in rounds: round ``i`` runs every system once, the order rotated by one each
round and reversed every other round (so each system runs before and after each other one), and
the first ``warmup`` rounds are untimed. For every run of every system:

1. ``setup()`` (untimed) builds the run's starting state and **resets the target** (a fresh
   output directory, zeroed live tensors, a new model skeleton);
2. the files the run reads are made *cold* (evicted, then ``mincore`` must find none of their
   pages: ``pagecache.make_cold``) or *warm* (read first); what was left is recorded per run,
   and a row none of whose runs started with zero pages is not cold (``Row.cold_verified``);
3. ``gc.collect()``, ``malloc_trim(0)``, the peak-RSS counter reset (``/proc/self/clear_refs``);
4. ``run(state)`` is timed (``time.perf_counter``; a system in a child process times itself);
5. ``check(state, output)`` (untimed) compares the output with the expected bytes and raises
   ``checks.CheckFailed`` when it differs: the system's row then carries the error and no
   time counts (a broken loader cannot produce a number);
6. ``teardown`` and a collection drop what the run made before the next system starts.

Load: a sampler thread counts, ten times a second, the runnable tasks of *other* processes (the
kernel's runnable count in ``/proc/loadavg`` minus this process tree's running threads); the
mean is each row's ``others_load``. ``targets.py`` refuses to call a target met from a run where
it, or the 1-minute load average when the run started, exceeded ``results.QUIET_LOAD``.

Memory per run: peak RSS growth (``VmHWM`` after minus ``VmRSS`` before: includes mapped file
pages the run touched) and peak anonymous growth (a 5 ms ``RssAnon`` sampler: what cannot be
reclaimed); the rows hold the medians.

Example:
    >>> s = System("sum", run=lambda x: sum(x), check=lambda x, out: None, setup=lambda: [1, 2])
    >>> [row] = compare("demo", "sum", "", [s], Settings(rounds=3, warmup=1))
    >>> len(row.runs), row.checked, row.error
    (3, 3, None)
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import shutil
import statistics
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from checks import CheckFailed
from pagecache import drop_all, iter_files, make_cold, make_warm, resident_pages
from results import Row, paired_ratios

MiB = 1024 * 1024
_STATUS_RE = {k: re.compile(rf"^{k}:\s+(\d+) kB", re.M) for k in ("VmRSS", "VmHWM", "RssAnon")}
_libc = ctypes.CDLL(None, use_errno=True)


# -- memory ---------------------------------------------------------------------------------
def mem_kib(field_name: str) -> int:
    """One field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``, ``RssAnon``)."""
    with open("/proc/self/status") as f:
        m = _STATUS_RE[field_name].search(f.read())
    return int(m.group(1)) if m else 0


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (``VmHWM``) to the current RSS; False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def malloc_trim() -> None:
    """Give freed heap back to the kernel so that the next run's growth is not hidden."""
    try:
        _libc.malloc_trim(0)
    except AttributeError:  # pragma: no cover - not glibc
        pass


class AnonSampler(threading.Thread):
    """The highest ``RssAnon`` seen every 5 ms until :meth:`stop`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = mem_kib("RssAnon")
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.wait(0.005):
            self.peak = max(self.peak, mem_kib("RssAnon"))

    def stop(self) -> int:
        self._halt.set()
        self.join()
        return max(self.peak, mem_kib("RssAnon"))


# -- load -----------------------------------------------------------------------------------
def load_average() -> float:
    """The 1-minute load average."""
    return os.getloadavg()[0]


def _own_running() -> int:
    """Running or runnable threads of this process and its descendants."""
    count, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                if state == "R":
                    count += 1
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo += [int(c) for c in f.read().split()]
            except (OSError, IndexError, ValueError):
                continue
    return count


def _runnable() -> int:
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


class OthersLoad(threading.Thread):
    """Mean runnable tasks of other processes (sampled at 10 Hz) until :meth:`stop`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[int] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while True:
            try:
                self.samples.append(max(0, _runnable() - _own_running()))
            except OSError:  # pragma: no cover - no /proc
                return
            if self._halt.wait(0.1):
                return

    def stop(self) -> float | None:
        self._halt.set()
        self.join()
        return statistics.fmean(self.samples) if self.samples else None


# -- files ----------------------------------------------------------------------------------
def disk_usage(paths: Iterable[str]) -> tuple[int, int, int]:
    """(apparent bytes, allocated bytes, number of files) of files and directories."""
    apparent = allocated = count = 0
    for path in iter_files(paths):
        st = os.lstat(path)
        apparent += st.st_size
        allocated += st.st_blocks * 512
        count += 1
    return apparent, allocated, count


def remove(path: str) -> None:
    """Delete a file or directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def wanted(name: str, cfg: dict[str, Any]) -> bool:
    """Whether ``run.py --systems`` (comma-separated substrings; empty: all) selects ``name``."""
    chosen = [w for w in cfg.get("systems", "").split(",") if w]
    return not chosen or any(w in name for w in chosen)


def slug(name: str) -> str:
    """A file name for a system's output."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


# -- systems and comparisons ----------------------------------------------------------------
class Unsupported(Exception):
    """A library cannot do this work here (an incumbent's limit): its row says ``N/A``."""


@dataclass
class Settings:
    """What every comparison of a run shares."""

    rounds: int = 5  # timed rounds
    warmup: int = 1  # untimed rounds first
    quick: bool = False  # tiny sizes: a smoke test, never a result
    drop_all: bool = False  # cold runs also drop every cache of the machine first (root)


def _nothing() -> None:
    return None


def _drop(state: Any, out: Any) -> None:
    return None


@dataclass
class System:
    """One system of a comparison; see the module docstring for the order of the calls.

    ``check(state, out)`` is required: it raises ``checks.CheckFailed`` when ``out`` (or the
    target in ``state``) is not the expected result, and may return measured values to keep
    (``{"bytes written": ...}``: their medians go to ``Row.metrics``). ``own_time``: ``run``
    returns ``(seconds, output)``, timed where the work ran (a child process).
    """

    name: str
    run: Callable[[Any], Any]
    check: Callable[[Any, Any], dict[str, float] | None]
    setup: Callable[[], Any] = _nothing
    teardown: Callable[[Any, Any], None] = _drop
    files: Sequence[str] = ()
    limit: bool = False
    missing: str | None = None
    own_time: bool = False
    output: Sequence[str] = ()  # what it writes: disk usage reported after the last run


def _prepare_cache(files: Sequence[str], cache: str, everything: bool) -> float | None:
    """Make the files cold or warm; the fraction of their pages cached before the run (a cold run
    that reads no file starts with nothing cached). ``everything``: a cold run first drops every
    clean page, dentry and inode of the machine (``pagecache.drop_all``)."""
    if cache == "cold" and not files:
        return 0.0
    if not files or cache not in ("cold", "warm"):
        return None
    if cache == "warm":
        return make_warm(list(files))
    if everything:
        drop_all()
    left = make_cold(list(files))
    return 0.0 if left == 0 else max(1e-9, left / max(1, resident_pages(files)[1]))


def compare(
    workload: str, op: str, cache: str, systems: Sequence[System], settings: Settings
) -> list[Row]:
    """Measure ``systems`` in interleaved rounds; one :class:`Row` per system."""
    rows = {s.name: Row(workload, op, cache, s.name, limit=s.limit) for s in systems}
    for s in systems:
        rows[s.name].error = s.missing
    active = [s for s in systems if s.missing is None]
    rss: dict[str, list[int]] = {s.name: [] for s in active}
    anon: dict[str, list[int]] = {s.name: [] for s in active}
    metrics: dict[str, dict[str, list[float]]] = {s.name: {} for s in active}
    others = OthersLoad()
    others.start()
    gc.collect()
    gc.freeze()  # later collections scan only what the runs create
    try:
        for i in range(settings.warmup + settings.rounds):
            k = i % len(active) if active else 0
            order = active[k:] + active[:k]
            if i % 2:
                order.reverse()
            for s in order:
                row = rows[s.name]
                if row.error is not None:
                    continue
                timed = i >= settings.warmup
                try:
                    got = _one_run(s, cache, settings.drop_all)
                except CheckFailed as err:
                    row.error = f"check failed in round {i}: {err}"
                    continue
                except Unsupported as err:
                    row.error = f"N/A: {err}"
                    continue
                except Exception as err:  # noqa: BLE001 - one failing system must not hide the others
                    traceback.print_exc()
                    row.error = f"FAILED in round {i}: {type(err).__name__}: {err}"
                    continue
                if timed:
                    seconds, resident, peak_rss, peak_anon, measured = got
                    row.runs.append(seconds)
                    row.checked = (row.checked or 0) + 1
                    if resident is not None:
                        row.resident.append(resident)
                    if not s.own_time:  # a child's memory is not this process's
                        rss[s.name].append(peak_rss)
                        anon[s.name].append(peak_anon)
                    for key, value in (measured or {}).items():
                        metrics[s.name].setdefault(key, []).append(float(value))
    finally:
        gc.unfreeze()
        load = others.stop()
    for s in systems:
        row = rows[s.name]
        row.others_load = load
        if rss.get(s.name):
            row.rss_peak = int(statistics.median(rss[s.name]))
            row.anon_peak = int(statistics.median(anon[s.name]))
        if metrics.get(s.name):
            row.metrics = {k: statistics.median(v) for k, v in metrics[s.name].items()}
        if s.output and row.error is None:
            row.apparent, row.allocated, row.files = disk_usage(s.output)
        if cache == "cold" and row.resident and not row.cold_verified:
            left = sum(1 for r in row.resident if r)
            row.note = _join(row.note, f"NOT COLD: pages cached before {left} of {len(row.runs)} runs")
    return [rows[s.name] for s in systems]


def _one_run(
    s: System, cache: str, drop_everything: bool
) -> tuple[float, float | None, int, int, dict[str, float] | None]:
    state = out = None
    try:
        state = s.setup()
        resident = _prepare_cache(s.files, cache, drop_everything)
        gc.collect()
        malloc_trim()
        reset_peak_rss()
        base_rss = mem_kib("VmRSS")
        sampler = AnonSampler()
        base_anon = sampler.peak
        sampler.start()
        try:
            t0 = time.perf_counter()
            out = s.run(state)
            seconds = time.perf_counter() - t0
        finally:
            peak_anon = sampler.stop()
        peak_rss = mem_kib("VmHWM")
        if s.own_time:
            seconds, out = out
        measured = s.check(state, out)
        return (
            seconds,
            resident,
            max(0, peak_rss - base_rss) * 1024,
            max(0, peak_anon - base_anon) * 1024,
            measured,
        )
    finally:
        try:
            s.teardown(state, out)
        finally:
            del state, out
            gc.collect()


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a else b


# -- the printed table ----------------------------------------------------------------------
def _fmt_s(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.3f} s"


def _fmt_mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:.1f}"


def table(rows: list[Row]) -> str:
    """A Markdown table: median, min and max of every row, and the median of its per-round
    ratios to the fastest limit row of the same comparison."""
    head = (
        "| system | op | cache | median | min | max | runs (checked) | × limit (median of rounds) "
        "| peak RSS MiB | peak anon MiB | disk MiB | note |"
    )
    out = [head, "|" + "---|" * 12]
    for r in rows:
        if not r.runs or r.error is not None:
            out.append(
                f"| {r.system} | {r.op} | {r.cache or '-'} | - | - | - | {len(r.runs)} | - | - | - "
                f"| - | {_join(r.note, r.error or 'no runs')} |"
            )
            continue
        group = [
            x
            for x in rows
            if (x.op, x.cache) == (r.op, r.cache) and x.limit and x.valid and x.runs
        ]
        lim = min(group, key=lambda x: x.median) if group else None
        ratio = "-"
        if lim is not None and lim is not r and len(lim.runs) == len(r.runs):
            ratio = f"{statistics.median(paired_ratios(r, lim)):.3f} (vs {lim.system})"
        note = r.note
        if r.metrics:
            note = _join(note, ", ".join(f"{k} {v:,.4g}" for k, v in r.metrics.items()))
        out.append(
            f"| {r.system} | {r.op} | {r.cache or '-'} | {_fmt_s(r.median)} | {_fmt_s(min(r.runs))} "
            f"| {_fmt_s(max(r.runs))} | {len(r.runs)} ({r.checked}) | {ratio} "
            f"| {_fmt_mib(r.rss_peak)} | {_fmt_mib(r.anon_peak)} | {_fmt_mib(r.allocated)} | {note} |"
        )
    return "\n".join(out)


@dataclass
class Comparison:
    """One comparison of a workload: the systems doing one operation in one cache state."""

    op: str
    cache: str
    systems: list[System] = field(default_factory=list)
    rounds: int | None = None  # this comparison's timed rounds (default: the run's)
