"""Elastic re-layout, the whole scenario timed: lose a node, train on, grow back.

    python benchmarks/elastic.py [--steps 200] [--kill-after 3] [--grow-after 5]

Two launchers (`partrain train --node-rank K`, 4 processes each, over loopback) train gpt-3d's model
with parallel=auto (tp fixed at 2) and cluster.min_nodes=1. After --kill-after steps node 1's launcher
gets SIGKILL: the job shrinks to 4 processes with a new layout. Once node 0 has trained --grow-after
steps on its own, a new node 1 starts and the job grows back to 8. Then the same layouts run plainly
as the baseline: 8 processes to the first change step (saved there), 4 processes from that checkpoint
to the second (saved there), 8 from that to the end. Printed: each change (step, layouts, reason), the
seconds from the kill / the new launcher's start to the change being recorded and to training again,
and the largest loss difference from the baseline over each segment (expected <= 1e-5).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partrain.blueprint.planner.relayout import layout_change_text  # noqa: E402
from partrain.testing.elastic import (  # noqa: E402
    GPT_3D_SHORT,
    ElasticRun,
    fresh_reference,
    max_difference,
    resumed_reference,
    wait_for,
)

BASE = GPT_3D_SHORT


def scenario(tmp: Path, steps: int, kill_after: int, grow_after: int) -> dict:
    over = [*BASE, f"data.cache_dir={tmp / 'cache'}", "parallel=auto", "parallel.tp=2", "cluster.nodes=2"]
    over += ["cluster.devices_per_node=4", "cluster.min_nodes=1", "cluster.elastic_wait_s=5"]
    over += [f"checkpoint.dir={tmp / 'ckpt'}", "checkpoint.every_steps=50", "checkpoint.keep_last=100"]
    run = ElasticRun(tmp, [*over, f"train.steps={steps}"])
    times = {}
    try:
        t0 = time.monotonic()
        run.start_two()
        wait_for("a step", lambda: run.steps_done() >= 1, 600, run.live())
        times["start to first step"] = time.monotonic() - t0
        wait_for(f"{kill_after} steps", lambda: run.steps_done() >= kill_after, 600, run.live())
        killed = time.monotonic()
        run.kill_launcher("node1")
        wait_for("the shrink", lambda: len(run.changes()) >= 1, 300, run.live())
        times["kill to change recorded"] = time.monotonic() - killed
        shrunk = run.changes()[0]["step"]
        wait_for("a step on 4", lambda: run.steps_done() > shrunk, 300, run.live())
        times["kill to training on 4"] = time.monotonic() - killed
        wait_for(f"{grow_after} steps on 4", lambda: run.steps_done() >= shrunk + grow_after, 300, run.live())
        joined = time.monotonic()
        run.start("node1b", 1)
        wait_for("the grow-back", lambda: len(run.changes()) >= 2, 300, run.live())
        times["new launcher to change recorded"] = time.monotonic() - joined
        grown = run.changes()[1]["step"]
        wait_for("a step on 8", lambda: run.steps_done() > grown, 300, run.live())
        times["new launcher to training on 8"] = time.monotonic() - joined
        codes = {name: run.procs[name].wait(timeout=900) for name in ("node0", "node1b")}
        times["whole elastic run"] = time.monotonic() - t0
    finally:
        run.stop_all()
    summary = json.loads((tmp / "node0" / "summary.json").read_text())
    return {"run": run, "times": times, "codes": codes, "summary": summary}


def baseline(tmp: Path, changes: list, steps: int) -> dict:
    common = [*BASE, f"data.cache_dir={tmp / 'cache'}"]
    (a, b) = changes
    k, j = a["step"], b["step"]
    first = fresh_reference(common, a["old"], tmp / "ref-a", steps, save_every=k)
    second = resumed_reference(
        common, a["new"], tmp / "ref-a" / "checkpoints" / f"step-{k:08d}", tmp / "ref-b", steps, j
    )
    third = resumed_reference(common, b["new"], tmp / "ref-b" / "checkpoints" / f"step-{j:08d}", tmp / "ref-c", steps)
    return {
        "first": (first, range(1, k + 1)),
        "second": (second, range(k + 1, j + 1)),
        "third": (third, range(j + 1, steps + 1)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--kill-after", type=int, default=3)
    parser.add_argument("--grow-after", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="partrain-elastic-") as folder:
        tmp = Path(folder)
        got = scenario(tmp, args.steps, args.kill_after, args.grow_after)
        changes = got["run"].changes()
        print(f"elastic run: exit codes {got['codes']}, {got['summary']['steps']} steps")
        for change in got["summary"]["layout_changes"]:
            print(f"  layout change at step {change['step']}: {layout_change_text(change)}")
        print("| phase | seconds |\n|---|---|")
        for name, seconds in got["times"].items():
            print(f"| {name} | {seconds:.1f} |")
        losses = got["run"].losses()
        print("| segment (baseline layout) | steps | max abs loss difference |\n|---|---|---|")
        worst = 0.0
        for name, (want, span) in baseline(tmp, changes, args.steps).items():
            diff = max_difference(losses, want, span)
            worst = max(worst, diff)
            print(f"| {name} | {span.start}-{span.stop - 1} | {diff:.2e} |")
        return 0 if worst <= 1e-5 and set(got["codes"].values()) == {0} else 1


if __name__ == "__main__":
    sys.exit(main())
