"""Measurement machinery shared by every workload: timing, peak RSS, page-cache eviction, disk
usage, and the result table with ratios to the raw limit measured in the same run.

How one measurement is taken (:func:`measure`):

* ``warmup`` untimed runs, then ``repeat`` timed runs; the reported time is the median.
* before every run: ``setup()`` (untimed), optional page-cache eviction of the files the run
  reads (*cold*), ``gc.collect()`` (of the objects created since ``gc.freeze()``),
  ``malloc_trim(0)`` (so freed heap from the previous run is not silently reused), then the
  kernel's peak-RSS counter is reset (``/proc/self/clear_refs`` = 5) and the baseline RSS is
  read.
* after the run: peak RSS growth = ``VmHWM`` - baseline (exact, includes file pages mapped and
  touched by the run); peak anonymous growth = highest ``RssAnon`` seen by a sampler thread
  (every 5 ms) - baseline (approximate: the memory that cannot be reclaimed).

Cache eviction (``--cold``): ``fadvise`` (default, no privileges, only the benchmark's own
files: ``fdatasync`` + ``POSIX_FADV_DONTNEED``, verified with ``mincore``) or ``global``
(``sync; echo 3 > /proc/sys/vm/drop_caches``: also drops dentries and inodes, but slows every
other process on the machine).
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator

MiB = 1024 * 1024
_STATUS_RE = {k: re.compile(rf"^{k}:\s+(\d+) kB", re.M) for k in ("VmRSS", "VmHWM", "RssAnon")}
_libc = ctypes.CDLL(None, use_errno=True)
DROP_CACHES = "/proc/sys/vm/drop_caches"


# -- memory ---------------------------------------------------------------------------------
def _status() -> str:
    with open("/proc/self/status") as f:
        return f.read()


def mem_kib(field_name: str) -> int:
    """One field of ``/proc/self/status`` in KiB (``VmRSS``, ``VmHWM``, ``RssAnon``)."""
    m = _STATUS_RE[field_name].search(_status())
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


class _AnonSampler(threading.Thread):
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


# -- page cache -----------------------------------------------------------------------------
def iter_files(paths: Iterable[str]) -> Iterator[str]:
    """Every regular file under the given files or directories."""
    for p in paths:
        if os.path.isdir(p):
            for root, _, files in os.walk(p):
                for name in files:
                    yield os.path.join(root, name)
        elif os.path.isfile(p):
            yield p


def can_drop_global() -> bool:
    """True when this process may write ``/proc/sys/vm/drop_caches`` (root, writable /proc)."""
    return os.access(DROP_CACHES, os.W_OK)


def evict(paths: Iterable[str], method: str) -> None:
    """Remove the given files' pages from the page cache (see the module docstring)."""
    paths = list(paths)
    if method == "global":
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("3")
        return
    for path in iter_files(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(paths: Iterable[str], max_files: int = 200) -> float:
    """Fraction of the files' pages in the page cache (``mincore``), over at most ``max_files``."""
    page = mmap.PAGESIZE
    resident = total = 0
    for i, path in enumerate(iter_files(paths)):
        if i >= max_files:
            break
        size = os.path.getsize(path)
        if size == 0:
            continue
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            npages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * npages)()
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            if _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0:
                resident += sum(b & 1 for b in vec)
                total += npages
        finally:
            mm.close()
    return resident / total if total else 0.0


# -- disk -----------------------------------------------------------------------------------
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


# -- results --------------------------------------------------------------------------------
@dataclass
class Result:
    """One table row: a system doing one operation, warm or cold."""

    workload: str
    system: str
    op: str
    cache: str = ""
    seconds: float | None = None
    runs: list[float] = field(default_factory=list)
    rss_peak: int | None = None  # bytes, VmHWM growth
    anon_peak: int | None = None  # bytes, sampled RssAnon growth
    apparent: int | None = None
    allocated: int | None = None
    files: int | None = None
    limit: bool = False  # this row is a raw-limit row
    note: str = ""


@dataclass
class Settings:
    """What every measurement of a run shares."""

    repeat: int = 3
    warmup: int = 1
    cold: str = "fadvise"  # "fadvise", "global" or "none"
    quick: bool = False


def measure(
    settings: Settings,
    op: Callable[[Any], Any],
    *,
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[Any, Any], None] | None = None,
    cold_paths: Callable[[], list[str]] | None = None,
) -> tuple[float, list[float], int, int, str]:
    """Run ``op(setup())`` warm-up + repeat times; see the module docstring.

    Returns:
        (median seconds, timed runs, median peak RSS growth, median peak anon growth, note)
    """
    runs: list[float] = []
    rss: list[int] = []
    anon: list[int] = []
    note = ""
    gc.collect()
    gc.freeze()  # later collections scan only what the runs create (a full one takes ~0.2 s)
    for i in range(settings.warmup + settings.repeat):
        state = setup() if setup is not None else None
        if cold_paths is not None:
            paths = cold_paths()
            evict(paths, settings.cold)
            if i == 0:
                left = resident_fraction(paths)
                if left > 0.02:
                    note = f"eviction left {left:.0%} cached"
        gc.collect()
        malloc_trim()
        reset_peak_rss()
        base_rss = mem_kib("VmRSS")
        sampler = _AnonSampler()
        base_anon = sampler.peak
        sampler.start()
        t0 = time.perf_counter()
        out = op(state)
        elapsed = time.perf_counter() - t0
        peak_anon = sampler.stop()
        peak_rss = mem_kib("VmHWM")
        if teardown is not None:
            teardown(state, out)
        del out, state
        if i >= settings.warmup:
            runs.append(elapsed)
            rss.append(max(0, peak_rss - base_rss) * 1024)
            anon.append(max(0, peak_anon - base_anon) * 1024)
    return (
        statistics.median(runs),
        runs,
        int(statistics.median(rss)),
        int(statistics.median(anon)),
        note,
    )


# -- workers --------------------------------------------------------------------------------
HERE = os.path.dirname(os.path.abspath(__file__))


def run_worker(workload: str, system: str, config: dict[str, Any], inline: bool) -> list[Result]:
    """Measure one system of a workload, in this process (``inline``) or in a fresh one."""
    if inline:
        import traceback

        import workloads

        try:
            return workloads.run_system(workload, system, config)
        except Exception as err:  # noqa: BLE001 - one failing system must not hide the others
            traceback.print_exc()
            return [Result(workload, system, "*", note=f"FAILED: {type(err).__name__}: {err}")]
    cmd = [
        sys.executable,
        os.path.join(HERE, "run.py"),
        "_worker",
        workload,
        system,
        json.dumps(config),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return [Result(workload, system, "*", note="FAILED: " + " | ".join(tail))]
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            rows.append(Result(**json.loads(line[len("RESULT ") :])))
    return rows


def emit(rows: list[Result]) -> None:
    """Print rows for the parent process (worker side of :func:`run_worker`)."""
    for r in rows:
        print("RESULT " + json.dumps(asdict(r)), flush=True)


# -- table ----------------------------------------------------------------------------------
def _limit_for(
    rows: list[Result], r: Result, limit_of: Callable[[Result], str | None]
) -> Result | None:
    name = limit_of(r)
    cands = [
        x
        for x in rows
        if x.limit
        and x.op == r.op
        and x.cache == r.cache
        and x.seconds is not None
        and (name is None or x.system == name)
    ]
    return min(cands, key=lambda x: x.seconds or 0.0) if cands else None


def _ratio(a: float | int | None, b: float | int | None, floor: float = 0.0) -> str:
    if a is None or b is None or b <= floor:
        return "-"
    return f"{a / b:.2f}"


def _fmt_s(s: float | None) -> str:
    if s is None:
        return "N/A"
    return f"{s:.4f}" if s < 10 else f"{s:.2f}"


def _fmt_mib(b: int | None) -> str:
    return "-" if b is None else f"{b / MiB:.1f}"


def table(rows: list[Result], limit_of: Callable[[Result], str | None] = lambda r: None) -> str:
    """A Markdown table of the rows with ratios to the raw-limit row of the same op and cache.

    ``limit_of(row)`` names the raw row to compare with (default: the fastest raw row).
    """
    head = (
        "| system | op | cache | s (median) | × limit | peak RSS MiB | × limit | peak anon MiB "
        "| disk MiB apparent | allocated | × limit | note |"
    )
    out = [head, "|" + "---|" * 12]
    for r in rows:
        lim = _limit_for(rows, r, limit_of)
        ratio_s = _ratio(r.seconds, lim.seconds if lim else None)
        ratio_rss = _ratio(r.rss_peak, lim.rss_peak if lim else None, floor=MiB)
        ratio_disk = _ratio(r.allocated, lim.allocated if lim else None, floor=MiB)
        note = r.note
        if lim is not None and lim is not r and not r.limit:
            note = (note + "; " if note else "") + f"vs {lim.system}"
        out.append(
            f"| {r.system} | {r.op} | {r.cache or '-'} | {_fmt_s(r.seconds)} | {ratio_s} "
            f"| {_fmt_mib(r.rss_peak)} | {ratio_rss} | {_fmt_mib(r.anon_peak)} "
            f"| {_fmt_mib(r.apparent)} | {_fmt_mib(r.allocated)} | {ratio_disk} | {note} |"
        )
    return "\n".join(out)
