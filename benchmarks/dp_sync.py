"""Gradient-sync strategies side by side at dp = 2, 4, 8 (`partrain bench dp-sync` each time):
bytes per rank and the busiest rank's bytes in gradient sizes G, measured and planned, and each
strategy's step time as a ratio to the backend's all-reduce measured in the same run.

    python benchmarks/dp_sync.py [--dps 2,4,8] [--iters 10] [OVERRIDES...]

What to look for: the ring's bytes per rank stay at 2(N-1)/N G (1, 1.5, 1.75) while the parameter
server's busiest rank sends (N-1) G (1, 3, 7): its link is the bottleneck that grows with workers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def bench(dp: int, iters: int, overrides) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        args = ["recipe=gpt-dp", f"parallel.dp={dp}", f"cluster.devices_per_node={dp}", "train.global_batch_size=32"]
        cmd = [sys.executable, "-m", "partrain.cli", "bench", "dp-sync", *args, *overrides]
        ran = subprocess.run([*cmd, "--iters", str(iters), "--out", str(out), "--json"], capture_output=True, text=True)
        if ran.returncode != 0:
            raise SystemExit(ran.stdout[-2000:] + ran.stderr[-2000:])
        return json.loads(ran.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dps", default="2,4,8")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("overrides", nargs="*")
    a = parser.parse_args()
    print("| dp | strategy | ms/step | x allreduce time | sent/rank xG (plan) | busiest xG (plan) |")
    print("|---|---|---|---|---|---|")
    for dp in (int(x) for x in a.dps.split(",")):
        rep = bench(dp, a.iters, a.overrides)
        g = rep["grad_bytes"]
        base = next(r for r in rep["rows"] if r["strategy"] == "allreduce")["seconds"]
        for r in rep["rows"]:
            p = r["predicted"]
            print(
                f"| {dp} | {r['strategy']} | {r['seconds'] * 1e3:.1f} | {r['seconds'] / base:.2f} | "
                f"{r['bytes_per_rank'] / g:.3f} ({p['bytes_per_rank'] / g:.3f}) | "
                f"{r['busiest_bytes'] / g:.3f} ({p['busiest_bytes'] / g:.3f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
