"""benchmarks/gpu.py stays runnable: its CPU smoke mode (tiny Llama, aot_eager) trains the plain loop
and partrain's compiled FSDP variant and prints the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_benchmark_runs_tiny_on_cpu():
    only = "hf eager,partrain compiled z3"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--tiny", "--steps", "2"]
    proc = subprocess.run([*cmd, "--only", only], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = proc.stdout
    assert "hf eager" in table and "partrain compiled z3" in table and "failed" not in table
    assert "1.000x" in table  # the baseline's own ratio
