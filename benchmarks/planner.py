"""The planner against measurement on this machine, and against the papers, in one invocation.

    /work/venv/bin/python benchmarks/planner.py            # everything (~6-8 min on 2 cores)
    /work/venv/bin/python benchmarks/planner.py --quick    # no real training runs (~1 min)

1. Model-state bytes per rank: `partrain.blueprint.planner.model_state_bytes_per_rank` (predicted) against
   what partrain's workers hold after their first optimizer step (summary.json `model_state_bytes`,
   the summed local shards of parameters, gradients and AdamW state), from real 1-step runs of
   `partrain train` (torchrun, gloo) for several CPU layouts. --quick replaces the real runs by
   TP/FSDP-sharded meta models on torch's fake process group (parameters only).
2. Saved activation bytes of one microbatch: the planner's counted model against
   `torch.autograd.graph.saved_tensors_hooks` (each storage once, weights excluded), tiny models
   plus GPT-2 small at 1024 tokens, fp32 and bf16 autocast, no / full recompute; and the Korthikanti
   et al. formula beside the GPT-2 numbers (it assumes fused GeLU, 16-bit activations, dropout and
   stored attention scores, so it differs from HF GPT-2 with SDPA by design).
3. Papers: ZeRO Figure 1, Narayanan et al. Table 1 (parameters; predicted vs achieved TFLOP/s of their
   layouts; search over their techniques), and the time of a --search for a 1T GPT on 4096 GPUs.
4. Every run's plan check (summary.json "planned_vs_measured", partrain/train/plan_check.py) for the
   recipes gpt-dp and gpt-3d as they are (short runs): predicted bytes per pipeline stage under the
   runtime accounting (tensors plus the worker's own resident memory, measured by the compute profile)
   against the measured peak RSS; the tensors alone against the peak RSS minus the RSS before the model
   was built; the peak RSS also with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_:
   freed tensors go back to the system, so the RSS follows live bytes more closely), and, for gpt-dp,
   the tensor-level peak of one rank's step counted by torch's MemTracker in one process; predicted vs
   measured tokens/s, from the nominal cluster and from `partrain bench compute` and `bench comm`
   profiles measured in the same invocation.
   `--plan-check` runs only this part (about 2 min).

Ratios are predicted / measured (1.000 = exact).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = [
    ("gpt-dp zero0 (DDP)", ["recipe=gpt-dp", "parallel.zero_stage=0"]),
    ("gpt-dp zero1", ["recipe=gpt-dp", "parallel.zero_stage=1"]),
    ("gpt-dp zero2 (FSDP2)", ["recipe=gpt-dp", "parallel.zero_stage=2"]),
    ("gpt-dp zero3 (FSDP2)", ["recipe=gpt-dp", "parallel.zero_stage=3"]),
    ("llama tp2 x dp2 zero3 +SP", ["recipe=llama-fsdp-tp"]),
    (
        "gpt2 tp2 x dp2 zero0",
        ["recipe=gpt-dp", "cluster.devices_per_node=4", "parallel.dp=2", "parallel.tp=2", "train.global_batch_size=8"],
    ),
    ("mixtral ep2 over dp2 zero0", ["recipe=mixtral-ep", "parallel.zero_stage=0"]),
    (
        "qwen2-moe ep2 over dp4 zero3 (edp 2)",
        [
            "recipe=mixtral-ep",
            "model=qwen2-moe-tiny",
            "cluster.devices_per_node=4",
            "parallel.dp=4",
            "parallel.zero_stage=3",
        ],
    ),
]
FAST = ["train.seq_len=64", "data.max_bytes=200000"]


def table(rows: List[List[str]], header: List[str]) -> None:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print()


def model_states(quick: bool) -> None:
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner import model_state_bytes_per_rank
    from partrain.blueprint.validate import validate

    rows = []
    if quick:
        from partrain.simulate.fake_world import simulate

        print("== 1. parameter elements per rank: planner vs TP/FSDP-sharded meta models (fake process group)")
        for label, overrides in LAYOUTS + [
            (
                "qwen2-moe tp2 x dp4 hybrid(2) zero3",
                [
                    "model=qwen2-moe-tiny",
                    "cluster.devices_per_node=8",
                    "parallel.tp=2",
                    "parallel.dp=4",
                    "parallel.dp_shard=2",
                    "parallel.zero_stage=3",
                    "train.global_batch_size=8",
                    "train.micro_batch_size=2",
                ],
            )
        ]:
            v = validate(compose(overrides))
            lay = v.layout
            sim = simulate(v, range(lay.world_size))
            pred = [r.analytic["param_elements"] for r in sim.ranks]
            meas = [r.simulated["param_elements"] for r in sim.ranks]
            worst = max(abs(p / m - 1) for p, m in zip(pred, meas))
            rows.append([label, lay.world_size, min(meas), max(meas), min(pred), max(pred), f"{1 + worst:.4f}"])
        table(
            rows, ["layout", "ranks", "measured min", "measured max", "predicted min", "predicted max", "worst ratio"]
        )
        return
    from partrain.testing.parity import run_training

    print("== 1. model-state bytes per rank (params + grads + AdamW state): planner vs real 1-step runs")
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, overrides) in enumerate(LAYOUTS):
            ov = overrides + FAST
            started = time.perf_counter()
            try:
                record = run_training(ov, Path(tmp) / f"run{i}", steps=1)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other layouts
                rows.append([label, "-", "-", "-", f"run failed: {str(exc).splitlines()[0][:60]}"])
                continue
            measured = [r["model_state_bytes"] for r in sorted(record.summary["ranks"], key=lambda r: r["rank"])]
            predicted = model_state_bytes_per_rank(validate(compose(ov)))
            ratios = [p / m for p, m in zip(predicted, measured)]
            rows.append(
                [
                    label,
                    len(measured),
                    f"{max(measured):,}",
                    f"{max(predicted):,}",
                    f"{min(ratios):.4f}..{max(ratios):.4f}",
                    f"{time.perf_counter() - started:.0f}s",
                ]
            )
    table(rows, ["layout", "ranks", "measured max B", "predicted max B", "ratio range", "run"])


def activations(quick: bool) -> None:
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner import estimate
    from partrain.blueprint.validate import validate
    from partrain.simulate.measure import model_config, saved_activation_bytes

    print("== 2. saved activation bytes of one microbatch: planner vs saved_tensors_hooks")
    cases = [
        (m, 2, 128) for m in ("gpt2-tiny", "llama-tiny", "mistral-tiny", "qwen2-tiny", "mixtral-tiny", "qwen2-moe-tiny")
    ]
    if not quick:
        cases.append(("gpt2-small", 1, 1024))
    rows = []
    for name, b, s in cases:
        for precision in ("fp32", "bf16"):
            for recompute in ("none", "full"):
                run = compose(
                    [
                        f"model={name}",
                        "cluster=local-cpu",
                        "cluster.devices_per_node=1",
                        "parallel.dp=1",
                        f"train.seq_len={s}",
                        f"train.micro_batch_size={b}",
                        f"train.global_batch_size={b}",
                        f"train.precision={precision}",
                        f"parallel.recompute={recompute}",
                    ]
                )
                est = estimate(validate(run), mixed="autocast")
                pred = est["memory_bytes"]["activations"]
                meas = saved_activation_bytes(model_config(name), b, s, precision, recompute)
                paper = ""
                if name.startswith("gpt2"):
                    layers = validate(run).facts.n_layers
                    paper = f"{est['korthikanti_layer_bytes'] * layers / 2**20:.1f}"
                rows.append(
                    [
                        name,
                        f"{b}x{s}",
                        precision,
                        recompute,
                        f"{meas / 2**20:.2f}",
                        f"{pred / 2**20:.2f}",
                        f"{pred / meas:.4f}",
                        paper,
                    ]
                )
    table(
        rows,
        [
            "model",
            "b x s",
            "precision",
            "recompute",
            "measured MiB",
            "predicted MiB",
            "ratio",
            "Korthikanti layers MiB",
        ],
    )
    print(
        "full recompute: the prediction also counts rotary cos/sin, which the checkpoint keeps in a closure (hooks "
        "do not see them)\n"
    )


def papers() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_planner import NARAYANAN_SPACE, NARAYANAN_TABLE1, _gpt_run

    from partrain.blueprint.planner import estimate, search
    from partrain.blueprint.planner.flops import narayanan_params
    from partrain.blueprint.planner.memory import zero_model_state_bytes
    from partrain.blueprint.planner.spec import GB
    from partrain.blueprint.validate import validate

    print("== 3a. ZeRO Figure 1 (7.5B parameters, 64 GPUs, K=12; GB = 10**9 bytes)")
    table(
        [
            [name, f"{zero_model_state_bytes(7.5e9, 64, stage) / GB:.3f}", pub]
            for name, stage, pub in (("baseline", 0, 120), ("P_os", 1, 31.4), ("P_os+g", 2, 16.6), ("P_os+g+p", 3, 1.9))
        ],
        ["stage", "formula GB", "published GB"],
    )
    print(
        "== 3b. Narayanan et al. Table 1: their layouts (micro batch 1, 1F1B, full recompute, gradient reduce "
        "after backward)"
    )
    rows = []
    for row in NARAYANAN_TABLE1:
        P, a, h, l, t, p, n, B, achieved = row
        v = validate(_gpt_run(h, a, l, n, B, tp=t, pp=p))
        est = estimate(v, dp_overlap=False)
        pred = est["hardware_flops_per_step"] / est["step_time_s"] / n / 1e12
        started = time.perf_counter()
        best = search(v, top_k=1, space=NARAYANAN_SPACE, dp_overlap=False)[0]
        took = time.perf_counter() - started
        bl = best["layout"]
        rows.append(
            [
                f"{P}B",
                f"{narayanan_params(l, h, 51200, 2048) / 1e9:.1f}",
                f"{t}/{p}/{n // (t * p)}",
                f"{est['memory_gib']['total']:.1f}",
                f"{est['step_time_s']:.2f}",
                f"{pred:.0f}",
                achieved,
                f"{pred / achieved:.3f}",
                f"{bl['tp']}/{bl['pp']}/{bl['dp']} {bl['pp_schedule'] or ''} v{bl['pp_virtual_stages']} "
                f"b{bl['micro_batch_size']}",
                f"{best['estimate']['step_time_s'] / est['step_time_s']:.3f}",
                f"{took:.1f}s",
            ]
        )
    table(
        rows,
        [
            "model",
            "P formula B",
            "t/p/d",
            "GiB",
            "step s",
            "pred TFLOP/s",
            "published",
            "ratio",
            "search best",
            "best/published",
            "search",
        ],
    )
    print("== 3c. --search for a 1T GPT (128 layers, h 25600) on 4096 H100 (512 nodes), global batch 3072")
    v = validate(_gpt_run(25600, 160, 128, 4096, 3072, tp=8, pp=64, peak=989.0, intra=450.0, inter=50.0, memory=79.6))
    started = time.perf_counter()
    found = search(v, top_k=3)
    took = time.perf_counter() - started
    for c in found:
        print(
            f"  #{c['rank']} {c['layout']}  {c['estimate']['step_time_s']:.2f} s/step, MFU "
            f"{c['estimate']['mfu']:.1%}: {c['why']}"
        )
    print(
        f"  search: {took:.2f} s, {found[0]['search']['evaluated']} layouts evaluated, "
        f"{found[0]['search']['fitting']} fit\n"
    )


PLAN_CHECK_RECIPES = ("gpt-dp", "gpt-3d")
PLAN_CHECK_OVERRIDES = ["data.max_bytes=300000"]
MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def _compute_profile(recipe: str, out: Path) -> Path:
    """`partrain bench compute recipe=...` on this machine, now (the profile the plan then uses)."""
    import subprocess

    from _harness import worker_env

    cmd = [sys.executable, "-m", "partrain.cli", "bench", "compute", f"recipe={recipe}", *PLAN_CHECK_OVERRIDES]
    proc = subprocess.run(cmd + ["--out", str(out)], capture_output=True, text=True, env=worker_env({}))
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench compute {recipe}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return out


def _comm_profile(recipe: str, out: Path) -> Path:
    """`partrain bench comm recipe=...` on this machine, now (gloo's measured bandwidths by op)."""
    import subprocess

    from _harness import worker_env

    cmd = [sys.executable, "-m", "partrain.cli", "bench", "comm", f"recipe={recipe}", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env({}))
    if proc.returncode != 0:
        raise RuntimeError(f"bench comm {recipe}: exit {proc.returncode}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return out


def _nominal_tokens_per_s(recipe: str) -> float:
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner import estimate
    from partrain.blueprint.validate import validate

    return estimate(validate(compose([f"recipe={recipe}", *PLAN_CHECK_OVERRIDES])))["tokens_per_s"]


def _plan_check_run(recipe: str, run_dir: Path, steps: int, env_extra: dict, extra: List[str] = ()) -> tuple:
    """One short `partrain train recipe=...` run: (its summary, the cores other processes used)."""
    import json
    import subprocess

    from _harness import partrain_command, worker_env
    from _machine_load import ForeignLoad, settle

    args = [f"recipe={recipe}", *PLAN_CHECK_OVERRIDES, f"train.steps={steps}", "train.eval_every=0"]
    args += ["train.eval_batches=0", f"train.run_dir={run_dir}", *extra]
    settle(5.0)
    with ForeignLoad() as load:
        proc = subprocess.run(partrain_command(args), capture_output=True, text=True, env=worker_env(env_extra))
    if proc.returncode != 0:
        raise RuntimeError(f"partrain train {' '.join(args)}: exit {proc.returncode}\n{proc.stdout[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text()), load.cores


def _stage_rows(recipe: str, summary: dict, threshold_summary: dict, tensor_peak: dict) -> List[List[str]]:
    block, mib = summary["planned_vs_measured"], 2**20
    rows = []
    for pp_rank, terms in block["planned_memory_terms"].items():
        stage = [r for r in summary["ranks"] if r["pp_rank"] == int(pp_rank)]
        other = [r for r in threshold_summary["ranks"] if r["pp_rank"] == int(pp_rank)]
        worst = max(stage, key=lambda r: r["peak_rss_bytes"])
        worst_t = max(r["peak_rss_bytes"] for r in other)
        tensors = terms["total"] - terms.get("process", 0)
        above = worst["peak_rss_bytes"] - worst["baseline_memory_bytes"]
        tensor = tensor_peak.get(recipe)
        rows.append(
            [
                recipe,
                pp_rank,
                len(stage),
                f"{terms['total'] / mib:.1f}",
                f"{worst['peak_rss_bytes'] / mib:.1f}",
                f"{terms['total'] / worst['peak_rss_bytes']:.3f}",
                f"{worst_t / mib:.1f}",
                f"{terms['total'] / worst_t:.3f}",
                f"{tensors / mib:.1f}",
                f"{above / mib:.1f}",
                f"{tensors / above:.3f}",
                f"{tensor / mib:.1f}" if tensor else "-",
                f"{tensors / tensor:.3f}" if tensor else "-",
            ]
        )
    return rows


def plan_check(steps: int, keep: str = "") -> None:
    print("== 4. the plan check of every run: planner (runtime accounting) vs measured, real runs on this machine")
    tensor_peak = {"gpt-dp": _tensor_peak("gpt-dp")}
    memory, speed = [], []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = keep or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for recipe in PLAN_CHECK_RECIPES:
            profile = _compute_profile(recipe, Path(tmp) / f"{recipe}-compute.json")
            links = _comm_profile(recipe, Path(tmp) / f"{recipe}-comm.json")
            extra = [f"cluster.compute_profile={profile}", f"cluster.comm_profile={links}"]
            summary, cores = _plan_check_run(recipe, Path(tmp) / recipe, steps, {}, extra)
            fixed, _ = _plan_check_run(recipe, Path(tmp) / f"{recipe}-mmap", steps, MMAP_THRESHOLD, extra)
            memory += _stage_rows(recipe, summary, fixed, tensor_peak)
            t = summary["planned_vs_measured"]["tokens_per_s"]
            nominal = _nominal_tokens_per_s(recipe)
            speed.append(
                [
                    recipe,
                    f"{nominal:,.0f}",
                    f"{nominal / t['measured']:.3f}",
                    f"{t['planned']:,.0f}",
                    f"{t['measured']:,.0f}",
                    f"{t['planned'] / t['measured']:.3f}",
                    f"{t['measured'] / t['planned']:.3f}",
                    f"{cores:.2f}",
                ]
            )
    table(
        memory,
        [
            "recipe",
            "pp stage",
            "ranks",
            "predicted MiB",
            "peak RSS MiB",
            "pred/meas",
            "peak RSS mmap128K",
            "pred/meas",
            "tensors MiB",
            "RSS-base MiB",
            "pred/meas",
            "tensor peak MiB",
            "pred/meas",
        ],
    )
    print(
        "predicted: the planner's total for the stage, tensors plus the 'process' term the compute profile measured\n"
        "(what every run's summary compares); peak RSS: VmHWM of the stage's worst rank; tensors: the predicted\n"
        "total without 'process', against RSS-base: peak RSS minus the RSS before the model was built (the heap\n"
        "glibc keeps and the library code paged in are in RSS-base; the code is in 'process'); tensor peak:\n"
        "torch's MemTracker over a steady step (after one untracked step) of one microbatch of gpt-dp's rank model\n"
        "in one process (parameters, gradients, optimizer state, activations, temporaries)\n"
    )
    table(
        speed,
        [
            "recipe",
            "nominal tokens/s",
            "pred/meas",
            "with profile",
            "measured tokens/s",
            "pred/meas",
            "meas/pred (runs' check)",
            "other load (cores)",
        ],
    )
    print(
        "measured tokens/s: the steady-state mean after 2 warm-up steps. nominal: cluster.peak_tflops (local-cpu:\n"
        "0.1) at the planner's CPU efficiency; with profile: `partrain bench compute` and `bench comm` run just\n"
        "before on this machine (matmul rates by shape, one decoder layer, bandwidth, ranks sharing cores scaled by\n"
        "that share; gloo's bus bandwidth by op)\n"
    )


TENSOR_PEAK_SCRIPT = """
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.runtime.mesh import build_mesh
from partrain.train.assemble import build_engine
v = validate(compose(json.loads(sys.argv[1])))
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=0, world_size=1)
engine = build_engine(v, build_mesh(v.layout, "cpu"), torch.device("cpu"))
b, s = v.run.train.micro_batch_size, v.run.train.seq_len
x = torch.randint(0, 256, (b, s))
def step():
    engine.optimizer.zero_grad(set_to_none=True)
    engine.forward_backward(x, x.clone(), 1.0)
    engine.clip(1.0)
    engine.optimizer.step()
step()  # the optimizer state exists from the second step on: measure a steady step
tracker = MemTracker()
tracker.track_external(*engine.model_parts, engine.optimizer)
with tracker:
    step()
peak = tracker.get_tracker_snapshot("peak")
print("@@peak", json.dumps(sum(v["Total"] for v in peak.values())))
dist.destroy_process_group()
"""


def _tensor_peak(recipe: str) -> int:
    """The tensor-level peak bytes of one rank of `recipe` (dp only) over a step, in a fresh process."""
    import json
    import os
    import subprocess

    from _harness import worker_env

    # One rank's model and micro batch: dp=1 on one process (the same per-rank shapes under DDP).
    overrides = [f"recipe={recipe}", "cluster.devices_per_node=1", "parallel.dp=1", "train.global_batch_size=4"]
    port = str(29600 + os.getpid() % 300)
    proc = subprocess.run(
        [sys.executable, "-c", TENSOR_PEAK_SCRIPT, json.dumps(overrides), port],
        capture_output=True,
        text=True,
        env=worker_env({"PYTHONPATH": str(ROOT)}),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@peak ")]
    if proc.returncode != 0 or not lines:
        print(f"tensor peak of {recipe} not measured: {proc.stderr[-500:]}")
        return 0
    return int(json.loads(lines[0].split(" ", 1)[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="no real training runs; fewer activation cases")
    parser.add_argument("--plan-check", action="store_true", help="only part 4 (every run's plan check)")
    parser.add_argument("--steps", type=int, default=10, help="steps of each part-4 run")
    parser.add_argument("--keep", default="", help="part 4: keep its profiles and runs in this folder")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if not args.plan_check:
        papers()
        activations(args.quick)
        model_states(args.quick)
    if not args.quick:
        plan_check(args.steps, args.keep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
