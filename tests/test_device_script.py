"""benchmarks/device.py stays runnable: its --cpu mode runs every phase (parity, throughput, profile)
on CPU with tiny models and writes device.json and traces.tar.gz, the way the device run does."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_device_script_cpu_mode_writes_every_phase(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "device.py"), "--cpu", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads((tmp_path / "device.json").read_text())
    assert set(report["phases"]) == {"parity", "throughput", "profile"}
    assert all(phase["ok"] for phase in report["phases"].values()), report["phases"]
    assert report["phases"]["parity"]["layouts"]["dp2-zero3"]["ok"]
    rows = {row["name"]: row for row in report["phases"]["throughput"]["rows"]}
    assert {"hf eager", "hf compiled", "partrain eager", "partrain compiled"} <= set(rows)
    assert rows["partrain compiled"]["tokens_per_s"] > 0 and rows["partrain compiled"]["planned"]["step_time_s"] > 0
    assert "partrain compiled float8" in report["phases"]["throughput"]["skipped"]  # float8: CUDA only
    with tarfile.open(tmp_path / "traces.tar.gz") as tar:
        assert any(name.endswith(".json") for name in tar.getnames())
    assert "throughput" in proc.stdout and "tokens/s" in proc.stdout  # the printed table
