"""The planner's speed targets, and the search's agreement with `parallel=auto` (issue 36).

Targets (speed lives here, not in timed unit tests): a 1T GPT on 4096 devices searches in under 2 s
and one estimate of its layout takes under 0.5 s; `partrain plan --simulate` of llama3-70b on 1024
ranks (the fake process group) finishes in under 60 s. For each recipe: the search's best, auto's
choice and the first candidate within auto's memory allowance.

    python benchmarks/search_speed.py [--repeat 3]

Prints one row per case: median seconds, layouts evaluated and fitting, best step time, auto's;
then one line per target with its verdict.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from partrain.blueprint.config.compose import compose
from partrain.blueprint.planner.auto import choose_layout
from partrain.blueprint.planner.estimate import estimate
from partrain.blueprint.planner.search import search
from partrain.blueprint.validate import validate

ONE_T = [
    "recipe=gpt-3d",
    "model.arch=gpt2",
    "model.config.n_embd=25600",
    "model.config.n_layer=128",
    "model.config.n_head=160",
    "train.seq_len=2048",
    "cluster.nodes=512",
    "cluster.devices_per_node=8",
    "cluster.device=cuda",
    "cluster.backend=nccl",
    "cluster.peak_tflops=989",
    "cluster.device_memory_gib=79.6",
    "train.precision=bf16",
    "train.global_batch_size=3072",
]
CASES = {
    "1T GPT, 4096 GPUs": ONE_T,
    "llama3-70b-h100": ["recipe=llama3-70b-h100"],
    "gpt3-175b-h100": ["recipe=gpt3-175b-h100"],
    "mixtral-ep": ["recipe=mixtral-ep"],
    "gpt-3d": ["recipe=gpt-3d"],
}
LIMIT_S = 2.0
ESTIMATE_LIMIT_S = 0.5
SIMULATE_LIMIT_S = 60.0
SIMULATE = ["plan", "recipe=llama3-70b-h100", "cluster=h100x1024", "parallel.dp=-1", "--simulate", "--json"]


def verdict(seconds: float, limit: float) -> str:
    return "ok" if seconds < limit else "TOO SLOW"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{'case':<20} {'median s':>9} {'evaluated':>10} {'fitting':>8} {'best s/step':>12} {'auto s/step':>12}  auto=#"
    )
    for name, overrides in CASES.items():
        run = compose(overrides)
        times, found = [], []
        for _ in range(args.repeat):
            started = time.perf_counter()
            found = search(run, top_k=10, runnable_only=True)
            times.append(time.perf_counter() - started)
        _, record = choose_layout(compose([*overrides, "parallel=auto"]), ["parallel=auto"])
        marked = [c["rank"] for c in found if c["auto_ok"] and c["overrides"] == record["chosen"]["overrides"]]
        info = found[0]["search"]
        print(
            f"{name:<20} {statistics.median(times):>9.2f} {info['evaluated']:>10} {info['fitting']:>8} "
            f"{found[0]['estimate']['step_time_s']:>12.4g} {record['chosen']['step_time_s']:>12.4g}  "
            f"{marked[0] if marked else 'not listed'}"
        )
        if name.startswith("1T"):
            median = statistics.median(times)
            print(
                f"  1T / 4096 search: {median:.2f} s median of {args.repeat} "
                f"(< {LIMIT_S} s: {verdict(median, LIMIT_S)})"
            )
            best = validate(compose([*overrides, *found[0]["overrides"]]))
            estimates = []
            for _ in range(args.repeat):
                started = time.perf_counter()
                estimate(best)
                estimates.append(time.perf_counter() - started)
            median = statistics.median(estimates)
            print(
                f"  1T / 4096 estimate: {median:.3f} s median "
                f"(< {ESTIMATE_LIMIT_S} s: {verdict(median, ESTIMATE_LIMIT_S)})"
            )
    started = time.perf_counter()
    ran = subprocess.run([sys.executable, "-m", "partrain.cli", *SIMULATE], capture_output=True, text=True)
    wall = time.perf_counter() - started
    state = verdict(wall, SIMULATE_LIMIT_S) if ran.returncode == 0 else f"FAILED (exit {ran.returncode})"
    print(f"  llama3-70b on 1024 ranks, partrain plan --simulate: {wall:.1f} s (< {SIMULATE_LIMIT_S:.0f} s: {state})")


if __name__ == "__main__":
    main()
