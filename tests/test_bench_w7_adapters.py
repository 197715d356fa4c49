"""The W7 fine-tuning series (``benchmarks/w7_checkpoints.py --adapters``) keeps running and
measures what it claims: memtree's incremental checkpoints share the frozen base by hard links."""

import os
import subprocess
import sys

import pytest


def _rows(stdout: str) -> dict[str, list[str]]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    return {cells[1].strip(): [c.strip() for c in cells[2:-1]] for cells in (line.split("|") for line in lines)}


@pytest.mark.slow
def test_w7_adapters_quick_run(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "w7_checkpoints.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, script, "--quick", "--adapters", "--checkpoints", "3", "--workdir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = _rows(out.stdout)
    assert set(rows) == {
        "memtree blocking, incremental", "memtree async, incremental", "DCP save (FileSystemWriter)",
        "DCP async_save (FileSystemWriter)", "torch.save", "safetensors save_file",
    }, out.stdout
    ratio = {name: float(cells[7].rstrip("x")) for name, cells in rows.items()}  # disk all / disk 1st
    for name in ("memtree blocking, incremental", "memtree async, incremental"):
        assert ratio[name] < 1.2, out.stdout  # the base (10 MiB) linked; only the adapters are new
        written_next = float(rows[name][3].replace(",", ""))
        assert written_next < float(rows["torch.save"][3].replace(",", "")) / 5, out.stdout
    for name in ("torch.save", "safetensors save_file", "DCP save (FileSystemWriter)"):
        assert ratio[name] > 2.9, out.stdout  # three full copies
