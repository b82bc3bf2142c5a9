"""Expert-parallel throughput, memory and all-to-all bytes: partrain ep=2 vs transformers' own EP, in one invocation.

    python benchmarks/ep.py            # 2 runs per side, interleaved, 12 steps (~5-8 min on 2 cores)
    python benchmarks/ep.py --quick    # 1 run per side, 8 steps (~2-3 min)

Every side trains the same HF MixtralForCausalLM (from config: hidden 128, ffn 256 per expert,
4 layers, 8 experts top-2, 4 heads, 2 KV heads, vocab 256; about 2.5M parameters), fp32, in 2
processes with 1 torch thread each, from the *same* initial weights (ep.py saves one randomly
initialised model with save_pretrained; partrain loads it with model.pretrained=, transformers with
from_pretrained), on the same batches (partrain's TokenBatches, same seed, global batch 16 x 128
tokens, each rank its contiguous 8 sequences in microbatches of 4), AdamW(foreach=False), the same
warmup+cosine learning rate, gradient clipping to 1.0, router load-balancing loss with the model's
router_aux_loss_coef on both sides.

    HF EP      (benchmarks/_baselines/hf_ep.py, torchrun): from_pretrained(dir, distributed_config=
               DistributedConfig(ep_size=2, fsdp_size=2, ep_implementation="all_to_all")): dense
               parameters FSDP2 over both ranks, 4 experts per rank, token all-to-all.
    partrain ep=2 zero3: parallel.dp=2 ep=2 zero_stage=3, the same sharding as HF EP (FSDP2 dense,
               experts split over ep, edp = 1).            Compared with HF EP.
    partrain ep=2 zero0: parallel.dp=2 ep=2 zero_stage=0 (dense replicated, DDP-style all-reduce).
    partrain ep=1 zero0: parallel.dp=2 ep=1 zero_stage=0 on the same 2 processes (every rank holds
               all 8 experts; no all-to-all).              Compared with partrain ep=2 zero0.

Step time is measured the same way on every side: rank 0, perf_counter from before zero_grad and the
data fetch to after optimizer.step, no barrier (partrain: metrics.jsonl `step_time_s`). The first
--warmup steps of every run are dropped; the figure is the median over the timed steps of all runs,
tokens/s = global batch x seq_len / median step time. Memory per rank: model state (params + grads +
AdamW state of the local shards, after step 1) and peak RSS of each worker; the table shows the
larger rank. Also printed, not a target: CPU ms per timed step per worker (`_harness.run_watched`,
from /proc): on a shared 2-core machine wall-clock step times of identical runs differ up to 2x with
other processes' load, the workers' own CPU time far less. Exit code 0 when partrain ep=2 zero3
reaches >= 1.00x HF tokens/s and <= 1.00x its model state, 3 when a target is missed, 1 when a run failed.

All-to-all bytes: one extra partrain ep=2 zero0 run counts, in each worker, the bytes
`torch.distributed.all_to_all_single` sends to the other rank (benchmarks/_baselines/a2a_count/
sitecustomize.py: token rows in forward, their gradients in backward, the int64 split counts apart),
per step, against the planner's prediction for the same config (`partrain plan`: estimate
comm_bytes_per_step.ep = MoE layers x microbatches x 4 x tokens x top_k x hidden x 4 bytes x (ep-1)/ep,
balanced routing assumed). HF's token bytes are counted too (forward calls of its
all_to_all_single_autograd; backward moves the same bytes reversed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

from _harness import (  # noqa: E402 - sibling module
    RunResult,
    partrain_command,
    read_partrain_run,
    run_watched,
    training_spec,
    worker_env,
)
from _machine_load import ForeignLoad, settle  # noqa: E402 - sibling module (scripts run from benchmarks/)

from partrain.runtime.torchrun import torchrun_command

HERE = Path(__file__).resolve().parent
BASELINE_SCRIPT = HERE / "_baselines" / "hf_ep.py"
COUNTER_DIR = HERE / "_baselines" / "a2a_count"
PROCS = 2

SIDES = {  # key: (label, partrain overrides or None for HF)
    "hf": ("HF EP (ep_size=2, fsdp_size=2)", None),
    "pt-ep2-z3": ("partrain dp=2 ep=2 zero3", ["parallel.ep=2", "parallel.zero_stage=3"]),
    "pt-ep2": ("partrain dp=2 ep=2 zero0", ["parallel.ep=2", "parallel.zero_stage=0"]),
    "pt-ep1": ("partrain dp=2 ep=1 zero0", ["parallel.ep=1", "parallel.zero_stage=0"]),
}
COMPARE = {"pt-ep2-z3": "hf", "pt-ep2": "pt-ep1"}
"""Side -> the side it is compared with (ratios, targets only against HF)."""


def base_overrides(args, cache: Path) -> List[str]:
    return [
        "model=mixtral-tiny",
        "cluster=local-cpu",
        f"cluster.devices_per_node={PROCS}",
        f"parallel.dp={PROCS}",
        f"model.config.hidden_size={args.hidden}",
        f"model.config.intermediate_size={args.ffn}",
        f"model.config.num_hidden_layers={args.layers}",
        f"model.config.num_local_experts={args.experts}",
        f"model.config.num_experts_per_tok={args.top_k}",
        f"train.seq_len={args.seq_len}",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "train.eval_batches=0",
        "train.threads_per_process=1",
        f"data.cache_dir={cache}",
    ]


def make_spec(args, root: Path) -> dict:
    """Compose partrain's config once; tokenize; save the shared initial weights; describe it all for the baseline."""
    import torch
    from transformers import AutoModelForCausalLM

    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner.estimate import estimate
    from partrain.blueprint.planner.rank_state import model_state_bytes_per_rank
    from partrain.blueprint.validate import validate
    from partrain.data import prepare_tokens
    from partrain.models.build import hf_config

    cache = root / "data-cache"
    v = validate(compose(base_overrides(args, cache) + SIDES["pt-ep2"][1]))
    run = v.run
    packed = prepare_tokens(run.data, cache)
    config = hf_config(run.model)  # exactly the config partrain builds (use_cache=False, sdpa)
    torch.manual_seed(run.train.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    init_dir = root / "init"
    model.save_pretrained(init_dir)
    est = estimate(v)
    planned_state = {
        key: model_state_bytes_per_rank(validate(compose(base_overrides(args, cache) + ov)))
        for key, (_, ov) in SIDES.items()
        if ov is not None
    }
    return {
        "init_dir": str(init_dir),
        "attn_implementation": config._attn_implementation,
        "meta_path": str(packed.meta_path),
        **training_spec(v),
        "ep": PROCS,
        "microbatches": v.microbatches,
        "n_params": n_params,
        "n_expert_params": n_expert,
        "vocab_size": config.vocab_size,
        "timeout_s": run.train.timeout_s,
        "planner_ep_bytes_per_step": est["comm_bytes_per_step"]["ep"],
        "planner_moe": est["moe"],
        "planner_link": est["links"]["ep"],
        "planner_state_bytes": planned_state,
    }


def _run(cmd: List[str], run_dir: Path, args, env: Optional[Dict[str, str]] = None) -> float:
    run_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(run_dir / "stdout.txt", "w") as out, open(run_dir / "stderr.txt", "w") as err:
        proc = subprocess.run(
            cmd, stdout=out, stderr=err, text=True, env=worker_env(env), cwd=run_dir, timeout=args.timeout
        )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)}\nexit {proc.returncode}\n{(run_dir / 'stdout.txt').read_text()[-3000:]}\n"
            f"{(run_dir / 'stderr.txt').read_text()[-3000:]}"
        )
    return time.perf_counter() - t0


def run_partrain(
    args, key: str, spec: dict, cache: Path, run_dir: Path, env: Optional[Dict[str, str]] = None
) -> RunResult:
    overrides = [*base_overrides(args, cache), *SIDES[key][1], f"model.pretrained={spec['init_dir']}"]
    cmd = partrain_command([*overrides, f"train.run_dir={run_dir}"])
    if env:  # the counted run: plain subprocess with the counter on PYTHONPATH
        return read_partrain_run(run_dir, _run(cmd, run_dir, args, env))
    wall, cpu_ms = run_watched(cmd, run_dir, run_dir / "metrics.jsonl", "partrain.worker", args)
    return read_partrain_run(run_dir, wall, cpu_ms)


def run_hf(args, spec_path: Path, run_dir: Path) -> RunResult:
    out = run_dir / "result.json"
    cmd = torchrun_command(PROCS, [BASELINE_SCRIPT, spec_path, out, run_dir / "steps.jsonl"])
    wall, cpu_ms = run_watched(cmd, run_dir, run_dir / "steps.jsonl", BASELINE_SCRIPT.name, args)
    r = json.loads(out.read_text())
    return RunResult(
        r["step_time_s"],
        wall,
        r["ranks"],
        r["losses"],
        cpu_ms=cpu_ms,
        extra={k: r[k] for k in ("expert_dtensors", "local_expert_shape", "aux_loss_coef", "threads")},
    )


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def _kb(n: float) -> str:
    return f"{n / 1e3:,.1f}"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per side of 8 steps")
    parser.add_argument("--steps", type=int, default=12, help="steps per run, warmup included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, interleaved")
    parser.add_argument("--only", default="", help="comma-separated sides (hf, pt-ep2-z3, pt-ep2, pt-ep1); default all")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--keep", default="", help="keep run folders here instead of a temporary folder")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per run")
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="before each run wait up to this many seconds for other processes to use < 0.25 cores (0: never)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 8, 1
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    keys = [k for k in SIDES if not args.only or k in args.only.split(",")]

    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 170)
    tmp_ctx = tempfile.TemporaryDirectory(prefix="partrain-bench-ep-") if not args.keep else None
    root = Path(args.keep).resolve() if args.keep else Path(tmp_ctx.name)
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        spec = make_spec(args, root)
        spec_path = root / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        cache = root / "data-cache"
        tokens = spec["tokens_per_step"]
        console.print(
            f"[bold]ep benchmark[/bold]: mixtral hidden={args.hidden} ffn={args.ffn} layers={args.layers} "
            f"experts={args.experts} top-{args.top_k} vocab={spec['vocab_size']} ({spec['n_params'] / 1e6:.2f}M "
            "params, "
            f"{spec['n_expert_params'] / 1e6:.2f}M in experts), global batch {args.global_batch} x {args.seq_len} "
            "tokens, "
            f"micro batch {args.micro_batch}, {PROCS} processes x 1 thread, {args.steps} steps/run ({args.warmup} "
            "warmup), "
            f"{args.repeats} run(s) per side; folder {root}"
        )

        results: Dict[str, List[RunResult]] = {k: [] for k in keys}
        for rep in range(args.repeats):
            for key in keys:
                label = SIDES[key][0]
                waited = settle(args.settle) if args.settle > 0 else 0.0
                run_dir = root / f"{key}-{rep}"
                try:
                    with ForeignLoad() as load:
                        r = (
                            run_hf(args, spec_path, run_dir)
                            if key == "hf"
                            else run_partrain(args, key, spec, cache, run_dir)
                        )
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    console.print(f"[red]{label} failed[/red]:\n{exc}", markup=True)
                    return 1
                r.foreign_cores = load.cores
                results[key].append(r)
                console.print(
                    f"  {label:<32} run {rep + 1}: median {statistics.median(r.step_times[args.warmup :]) * 1e3:7.1f} "
                    f"ms/step, CPU {r.cpu_ms:5.0f} ms/step/rank, process wall {r.wall_s:5.1f} s, other processes "
                    f"used {r.foreign_cores:.2f} cores"
                    + (f" (waited {waited:.0f} s for a quiet moment)" if waited >= 2 else "")
                )

        med = {k: statistics.median([t for r in rs for t in r.step_times[args.warmup :]]) for k, rs in results.items()}
        cpu = {k: statistics.median([r.cpu_ms for r in rs]) for k, rs in results.items()}
        state = {k: max(x["model_state_bytes"] for x in rs[0].ranks) for k, rs in results.items()}
        rss = {k: max(x["peak_rss_bytes"] for r in rs for x in r.ranks) for k, rs in results.items()}

        table = Table(
            title=f"expert parallel, {PROCS} processes x 1 thread: median over {args.steps - args.warmup} timed "
            "steps x "
            f"{args.repeats} run(s), {tokens} tokens/step; memory: the larger rank",
            title_justify="left",
        )
        for col in (
            "config",
            "tokens/s",
            "step ms",
            "CPU ms/step/rank",
            "model state MiB/rank",
            "peak RSS MiB/rank",
            "ratio vs",
            "target",
            "met?",
        ):
            table.add_column(col, justify="left" if col in ("config", "ratio vs", "target") else "right")
        all_met = True
        for key in keys:
            ratio = target = met = ""
            other = COMPARE.get(key)
            if other in results:
                speed, mem, rr = med[other] / med[key], state[key] / state[other], rss[key] / rss[other]
                cpu_ratio = cpu[key] / cpu[other]
                ratio = (
                    f"{SIDES[other][0]}:\ntok/s {speed:.3f}x\nstate {mem:.3f}x\nRSS {rr:.3f}x\n(CPU {cpu_ratio:.3f}x)"
                )
                if other == "hf":
                    checks = [speed >= 1.0, mem <= 1.0]
                    all_met = all_met and all(checks)
                    target = "\ntok/s >= 1.00x\nstate <= 1.00x\n(RSS, CPU: info)"
                    met = "\n" + "\n".join("[green]yes[/green]" if ok else "[red]no[/red]" for ok in checks)
                else:
                    target = "\n(info)"
            table.add_row(
                SIDES[key][0],
                f"{tokens / med[key]:,.0f}",
                f"{med[key] * 1e3:.1f}",
                f"{cpu[key]:.0f}",
                _mib(state[key]),
                _mib(rss[key]),
                ratio,
                target,
                met,
            )
        console.print(table)
        for key in keys:
            console.print(
                f"  {SIDES[key][0]}: per-run median ms "
                + " / ".join(f"{statistics.median(r.step_times[args.warmup :]) * 1e3:.0f}" for r in results[key])
                + "; CPU ms/step/rank "
                + " / ".join(f"{r.cpu_ms:.0f}" for r in results[key])
                + "; other processes used "
                + " / ".join(f"{r.foreign_cores:.2f}" for r in results[key])
                + " cores"
            )

        ranks = Table(
            title="model state per rank (first run of each side; planner: model_state_bytes_per_rank)",
            title_justify="left",
        )
        for col in (
            "config",
            "rank",
            "model state MiB",
            "planner MiB",
            "of which ideal experts / ep MiB",
            "peak RSS MiB",
        ):
            ranks.add_column(col, justify="left" if col == "config" else "right")
        for key in keys:
            for x in sorted(results[key][0].ranks, key=lambda x: x["rank"]):
                planned = spec["planner_state_bytes"].get(key)
                ranks.add_row(
                    SIDES[key][0],
                    str(x["rank"]),
                    _mib(x["model_state_bytes"]),
                    _mib(planned[x["rank"]]) if planned else "-",
                    _mib(spec["n_expert_params"] * 16 / (PROCS if key != "pt-ep1" else 1)),
                    _mib(x["peak_rss_bytes"]),
                )
        console.print(ranks)

        # ---- all-to-all bytes: one counted partrain ep=2 run vs the planner (and HF's own count)
        counted = root / "a2a-count"
        counted.mkdir(exist_ok=True)
        pythonpath = os.pathsep.join(
            [str(COUNTER_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        )
        try:
            run_partrain(
                args,
                "pt-ep2",
                spec,
                cache,
                root / "pt-ep2-counted",
                env={"PYTHONPATH": pythonpath, "PARTRAIN_BENCH_A2A_DIR": str(counted)},
            )
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            console.print(f"[red]counted run failed[/red]:\n{exc}", markup=True)
            return 1
        per_rank = [json.loads((counted / f"a2a-{r}.json").read_text()) for r in range(PROCS)]
        predicted = spec["planner_ep_bytes_per_step"]
        moe = spec["planner_moe"]
        a2a = Table(
            title=f"all-to-all bytes one rank sends to the other per step (mean over {args.steps} steps), vs the "
            "planner "
            f"(balanced routing; ep link {spec['planner_link']})",
            title_justify="left",
        )
        for col in (
            "rank",
            "token rows fwd kB",
            "gradients bwd kB",
            "total kB",
            "planner kB",
            "measured / planner",
            "split counts kB",
            "calls/step",
        ):
            a2a.add_column(col, justify="right")
        for r, t in enumerate(per_rank):
            total = (t["forward_sent_bytes"] + t["backward_sent_bytes"]) / args.steps
            a2a.add_row(
                str(r),
                _kb(t["forward_sent_bytes"] / args.steps),
                _kb(t["backward_sent_bytes"] / args.steps),
                _kb(total),
                _kb(predicted),
                f"{total / predicted:.3f}x" if predicted else "-",
                _kb(t["count_sent_bytes"] / args.steps),
                f"{t['calls'] / args.steps:.0f}",
            )
        console.print(a2a)
        layer = moe["all_to_all_bytes_per_layer_microbatch"]
        console.print(
            f"planner: {moe['moe_layers_on_rank']} MoE layers x {spec['microbatches']} microbatches x (dispatch "
            f"{_kb(layer['dispatch_forward'])} "
            f"+ combine {_kb(layer['combine_forward'])} + backward {_kb(layer['backward'])}) kB = {_kb(predicted)} "
            "kB/step; "
            f"{moe['routed_pairs_per_layer']:.0f} (token, expert) pairs per layer and microbatch, half of them off-rank"
        )
        if "hf" in results:
            hf_sent = [
                statistics.mean(x["a2a_forward_sent_bytes_per_step"])
                for x in sorted(results["hf"][0].ranks, key=lambda x: x["rank"])
            ]
            console.print(
                "HF EP token all-to-all, forward, per step: "
                + ", ".join(f"rank {i} {_kb(b)} kB" for i, b in enumerate(hf_sent))
                + f" (x2 with backward: {', '.join(_kb(2 * b) for b in hf_sent)} kB; planner {_kb(predicted)} kB)"
            )
            console.print(
                f"HF baseline: {results['hf'][0].extra.get('expert_dtensors')} expert DTensors, local shape "
                f"{results['hf'][0].extra.get('local_expert_shape')}, aux coef "
                f"{results['hf'][0].extra.get('aux_loss_coef')}"
            )

        for key in keys:
            losses = results[key][0].losses
            console.print(f"losses {SIDES[key][0]}: {', '.join(f'{x:.4f}' for x in losses[:4])} ... {losses[-1]:.4f}")
        if "hf" in results and "pt-ep2-z3" in results:
            a, b = results["hf"][0].losses, results["pt-ep2-z3"][0].losses
            console.print(
                f"max relative LM-loss difference HF vs partrain ep=2 zero3: "
                f"{max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b)):.1e} (sanity: same weights and batches; "
                "the aux-loss formulas differ slightly: HF pools all layers, partrain averages per layer)"
            )
        console.print(f"total benchmark wall time {time.perf_counter() - started:.0f} s")
        return 0 if all_met else 3
    finally:
        if tmp_ctx is not None:
            tmp_ctx.cleanup()


if __name__ == "__main__":
    sys.exit(main())
