"""Data-parallel throughput: partrain vs a plain PyTorch loop and HF Accelerate, in one invocation.

    /work/venv/bin/python benchmarks/dp.py            # full run (~5-6 min on 2 idle cores)
    /work/venv/bin/python benchmarks/dp.py --quick    # one repetition, fewer steps (~2 min)

Every configuration trains the same HF model (GPT-2 built from config, a few million parameters,
compute-bound), on the same packed tokens and the same global batches (partrain's TokenBatches),
one torch thread per process, fp32, AdamW(foreach=False), grad clipping, microbatches of the same
size. Pairs compared (partrain first, its baseline measured in the same invocation):

    partrain dp=1                     vs  a hand-written PyTorch loop, 1 process   target >= 0.95x
    partrain dp=2 zero_stage=0 (DDP)  vs  Accelerate DDP, 2 processes (torchrun)   target >= 1.00x
    partrain dp=2 zero_stage=3 (FSDP2), fsdp_grad_sync=last_microbatch
                                      vs  Accelerate FSDP2, 2 processes             target >= 1.00x
    partrain dp=2 zero_stage=3, fsdp_grad_sync=every_microbatch (the default; shown, no target)

Each pair runs A B A B A B (--repeats 3). Step time is measured the same way everywhere: rank 0,
perf_counter from before zero_grad and the data fetch to after optimizer.step, no barrier
(partrain: metrics.jsonl `step_time_s`; baselines: benchmarks/_baselines/hf_loop.py). The first
--warmup steps of every run are dropped; the figure is the median over the timed steps of all
repetitions, tokens/s = global_batch x seq_len / median step time. Ratios are tokens/s of partrain
over tokens/s of its baseline. Also printed: per-rank model-state bytes (params + grads + AdamW
state) from partrain's summary.json and from the baselines, against the ideal (full / world for FSDP).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from _harness import RunResult, partrain_command, read_partrain_run, training_spec, worker_env  # noqa: E402
from _machine_load import ForeignLoad, settle  # noqa: E402 - sibling module (scripts run from benchmarks/)

from partrain.runtime.torchrun import torchrun_command

HERE = Path(__file__).resolve().parent
NOISY_CORES = 0.3
"""A run during which other processes used more CPU cores than this (on average) is flagged as noisy."""
BASELINE_SCRIPT = HERE / "_baselines" / "hf_loop.py"


@dataclass
class Config:
    key: str
    label: str
    kind: str  # "partrain" | "plain" | "accelerate-ddp" | "accelerate-fsdp"
    procs: int
    overrides: List[str] = field(default_factory=list)
    baseline: Optional[str] = None  # key of the config this one is compared with
    target: Optional[float] = None  # minimum tokens/s ratio vs baseline
    short: str = ""  # name in the ratio column


def model_overrides(args) -> List[str]:
    return [
        f"model.config.n_embd={args.n_embd}",
        f"model.config.n_layer={args.n_layer}",
        f"model.config.n_head={args.n_head}",
        f"train.seq_len={args.seq_len}",
        f"train.global_batch_size={args.global_batch}",
        f"train.micro_batch_size={args.micro_batch}",
    ]


def configs(args) -> List[Config]:
    dp1 = ["parallel.dp=1", "cluster.devices_per_node=1", "parallel.zero_stage=0"]
    dp2 = ["parallel.dp=2", "cluster.devices_per_node=2"]
    return [
        Config("plain", "plain PyTorch loop, 1 proc", "plain", 1, short="plain loop"),
        Config("pt1", "partrain dp=1", "partrain", 1, dp1, baseline="plain", target=0.95),
        Config("acc-ddp", "Accelerate DDP, 2 procs", "accelerate-ddp", 2, short="Accelerate DDP"),
        Config(
            "pt-ddp",
            "partrain dp=2 zero0 (DDP)",
            "partrain",
            2,
            dp2 + ["parallel.zero_stage=0"],
            baseline="acc-ddp",
            target=1.0,
        ),
        Config("acc-fsdp", "Accelerate FSDP2, 2 procs", "accelerate-fsdp", 2, short="Accelerate FSDP2"),
        # Accelerate reduce-scatters once per step (no_sync on all but the last microbatch): the
        # like-for-like partrain setting is fsdp_grad_sync=last_microbatch. partrain's default
        # (every microbatch: gradients stay sharded, more traffic) is shown beside it, no target.
        Config(
            "pt-fsdp",
            "partrain dp=2 zero3 sync last",
            "partrain",
            2,
            dp2 + ["parallel.zero_stage=3", "parallel.fsdp_grad_sync=last_microbatch"],
            baseline="acc-fsdp",
            target=1.0,
        ),
        Config(
            "pt-fsdp-every",
            "partrain dp=2 zero3 sync every",
            "partrain",
            2,
            dp2 + ["parallel.zero_stage=3", "parallel.fsdp_grad_sync=every_microbatch"],
            baseline="acc-fsdp",
        ),
    ]


def common_overrides(args, cache: Path) -> List[str]:
    return [
        "recipe=gpt-dp",
        *model_overrides(args),
        f"train.steps={args.steps}",
        "train.eval_every=0",
        "train.eval_batches=0",
        "train.threads_per_process=1",
        f"data.cache_dir={cache}",
    ]


def make_spec(args, cache: Path) -> dict:
    """What the baseline loops need, taken from the composed partrain config (so the model and data agree)."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.data import prepare_tokens
    from partrain.models.build import ATTN_IMPLEMENTATION

    v = validate(compose(common_overrides(args, cache) + ["parallel.dp=1", "cluster.devices_per_node=1"]))
    run = v.run
    packed = prepare_tokens(run.data)  # tokenizes once into the shared cache; partrain runs reuse it
    kwargs = dict(run.model.config or {})
    attn = kwargs.pop("attn_implementation", ATTN_IMPLEMENTATION)
    kwargs.pop("experts_implementation", None)
    return {
        "arch": run.model.arch,
        "config": kwargs,
        "attn_implementation": attn,
        "meta_path": str(packed.meta_path),
        **training_spec(v),
    }


def run_partrain(cfg: Config, args, cache: Path, run_dir: Path) -> RunResult:
    cmd = partrain_command([*common_overrides(args, cache), *cfg.overrides, f"train.run_dir={run_dir}"])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=worker_env())
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return read_partrain_run(run_dir, wall)


def run_baseline(cfg: Config, args, spec_path: Path, run_dir: Path) -> RunResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "result.json"
    if cfg.procs == 1:
        cmd = [sys.executable, str(BASELINE_SCRIPT), str(spec_path), str(out), cfg.kind]
    else:
        cmd = torchrun_command(cfg.procs, [BASELINE_SCRIPT, spec_path, out, cfg.kind])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=worker_env(), cwd=run_dir)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    return RunResult(result["step_time_s"], wall, result["ranks"], result["losses"], result.get("kind", ""))


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one run per configuration, 8 steps (about 2 minutes)")
    parser.add_argument("--steps", type=int, default=16, help="steps per run, warmup included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps of each run left out")
    parser.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="runs per configuration, interleaved A B A B ... (run-to-run spread is a few %%: use >= 3)",
    )
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated config keys (plain,pt1,acc-ddp,pt-ddp,acc-fsdp,pt-fsdp,pt-fsdp-every)",
    )
    parser.add_argument("--keep", default="", help="keep run folders here instead of a temporary folder")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="before each run wait up to this many seconds for other processes to use < 0.25 cores (0: never)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.repeats = 8, 2, 1
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    all_cfgs = configs(args)
    if args.only:
        wanted = set(args.only.split(","))
        all_cfgs = [c for c in all_cfgs if c.key in wanted]
    by_key = {c.key: c for c in all_cfgs}

    tmp_ctx = tempfile.TemporaryDirectory(prefix="partrain-bench-dp-") if not args.keep else None
    root = Path(args.keep).resolve() if args.keep else Path(tmp_ctx.name)
    root.mkdir(parents=True, exist_ok=True)
    cache = root / "data-cache"
    started = time.perf_counter()
    load_start = _load()
    try:
        spec = make_spec(args, cache)
        spec_path = root / "spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        tokens = spec["tokens_per_step"]
        console.print(
            f"[bold]dp benchmark[/bold]: gpt2 n_embd={args.n_embd} n_layer={args.n_layer} n_head={args.n_head}, "
            f"global batch {args.global_batch} x {args.seq_len} tokens, micro batch {args.micro_batch}, "
            f"{args.steps} steps/run ({args.warmup} warmup), {args.repeats} repetition(s), 1 thread/process; "
            f"runs in {root}"
        )

        # Order: each baseline/partrain pair A B A B, pairs one after the other.
        # (A baseline shared by several partrain configs runs once per repetition: A B C A B C.)
        pairs: List[List[Config]] = []
        for c in all_cfgs:
            if c.baseline and c.baseline in by_key:
                group = next((g for g in pairs if g[0].key == c.baseline), None)
                if group is None:
                    pairs.append([by_key[c.baseline], c])
                else:
                    group.append(c)
        paired = {c.key for p in pairs for c in p}
        pairs += [[c] for c in all_cfgs if c.key not in paired]
        results: Dict[str, List[RunResult]] = {c.key: [] for c in all_cfgs}
        errors: Dict[str, str] = {}
        for group in pairs:
            for rep in range(args.repeats):
                for cfg in group:
                    if cfg.key in errors:
                        continue
                    run_dir = root / f"{cfg.key}-{rep}"
                    waited = settle(args.settle) if args.settle > 0 else 0.0
                    try:
                        with ForeignLoad() as load:
                            if cfg.kind == "partrain":
                                r = run_partrain(cfg, args, cache, run_dir)
                            else:
                                r = run_baseline(cfg, args, spec_path, run_dir)
                        r.foreign_cores = load.cores
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:
                        errors[cfg.key] = str(exc)
                        console.print(f"[red]{cfg.label} failed[/red]:\n{exc}", markup=True)
                        continue
                    results[cfg.key].append(r)
                    timed = r.step_times[args.warmup :]
                    console.print(
                        f"  {cfg.label:<30} run {rep + 1}: median {statistics.median(timed) * 1e3:7.1f} ms/step, "
                        f"process wall {r.wall_s:5.1f} s, other processes used {r.foreign_cores:.2f} cores"
                        + (f" (waited {waited:.0f} s for a quiet moment)" if waited >= 2 else ""),
                        highlight=False,
                    )

        # Figures.
        med: Dict[str, float] = {}
        for key, runs in results.items():
            timed = [t for r in runs for t in r.step_times[args.warmup :]]
            if timed:
                med[key] = statistics.median(timed)

        table = Table(
            title=f"data-parallel throughput (median over {args.steps - args.warmup} timed steps x "
            f"{args.repeats} runs; {tokens} tokens/step)",
            title_justify="left",
        )
        for col, just in (
            ("config", "left"),
            ("tokens/s", "right"),
            ("step ms (median)", "right"),
            ("ratio vs baseline", "right"),
            ("target", "right"),
            ("met?", "center"),
            ("per-run median ms", "right"),
            ("other load (cores)", "right"),
        ):
            table.add_column(col, justify=just)
        all_met = True
        for c in all_cfgs:
            if c.key not in med:
                table.add_row(c.label, "failed", "", "", "", "", "", "")
                all_met = all_met and c.target is None
                continue
            ratio = target = met = ""
            if c.baseline:
                target = f">= {c.target:.2f}x" if c.target is not None else "-"
                if c.baseline in med:
                    value = med[c.baseline] / med[c.key]  # tokens/s ratio = inverse step-time ratio
                    ratio = f"{value:.3f}x vs {by_key[c.baseline].short}"
                    if c.target is not None:
                        ok = value >= c.target
                        all_met = all_met and ok
                        met = "[green]yes[/green]" if ok else "[red]no[/red]"
                else:
                    met = "no baseline"
            per_run = " / ".join(f"{statistics.median(r.step_times[args.warmup :]) * 1e3:.0f}" for r in results[c.key])
            others = " / ".join(
                f"{r.foreign_cores:.2f}" + ("*" if r.foreign_cores > NOISY_CORES else "") for r in results[c.key]
            )
            table.add_row(
                c.label, f"{tokens / med[c.key]:,.0f}", f"{med[c.key] * 1e3:.1f}", ratio, target, met, per_run, others
            )
        console.print(table)

        scale = Table(title="scaling (1 process, 1 thread -> 2 processes x 1 thread)", title_justify="left")
        scale.add_column("config")
        scale.add_column("speedup vs 1 proc", justify="right")
        for key, one in (("pt-ddp", "pt1"), ("pt-fsdp", "pt1"), ("acc-ddp", "plain"), ("acc-fsdp", "plain")):
            if key in med and one in med:
                scale.add_row(by_key[key].label, f"{med[one] / med[key]:.2f}x vs {by_key[one].label}")
        if scale.row_count:
            console.print(scale)

        full = None
        for key in ("plain", "pt1"):
            if results.get(key):
                full = results[key][0].ranks[0]["model_state_bytes"]
                break
        mem = Table(title="per-rank model state (params + grads + AdamW state) after step 1", title_justify="left")
        for col in ("config", "rank", "model state", "ideal", "vs ideal"):
            mem.add_column(col, justify="left" if col == "config" else "right")
        for c in all_cfgs:
            if not results.get(c.key):
                continue
            sharded = c.kind == "accelerate-fsdp" or "parallel.zero_stage=3" in c.overrides
            for r in sorted(results[c.key][0].ranks, key=lambda x: x["rank"]):
                ideal = (full / c.procs if sharded else full) if full else None
                mem.add_row(
                    c.label,
                    str(r["rank"]),
                    _fmt_bytes(r["model_state_bytes"]),
                    _fmt_bytes(ideal) if ideal else "?",
                    f"{r['model_state_bytes'] / ideal:.3f}x" if ideal else "?",
                )
        console.print(mem)

        notes = []
        for c in all_cfgs:
            kinds = {r.note for r in results.get(c.key, []) if r.note}
            if kinds:
                notes.append(f"{c.label}: Accelerate ran {', '.join(sorted(kinds))}")
        first = {k: rs[0].losses[:3] for k, rs in results.items() if rs}
        notes.append(
            "first losses (sanity; partrain and the baselines initialise weights differently): "
            + "; ".join(f"{by_key[k].label}: {', '.join(f'{x:.3f}' for x in v)}" for k, v in first.items())
        )
        notes.append(
            f"total benchmark wall time {time.perf_counter() - started:.0f} s; load average at start "
            f"{load_start}, at end {_load()} (other processes on these cores make every figure noisier)"
        )
        for n in notes:
            console.print(n, highlight=False)
        noisy = sum(r.foreign_cores > NOISY_CORES for rs in results.values() for r in rs)
        if noisy:
            console.print(
                f"[yellow]warning: in {noisy} run(s) (marked *) other processes used more than {NOISY_CORES} "
                "cores: those step times are inflated by contention and the ratios are unreliable; "
                "rerun on a quiet machine[/yellow]"
            )
        if errors:
            console.print(f"[red]{len(errors)} configuration(s) failed: {', '.join(errors)}[/red]")
            return 1
        return 0 if all_met else 3
    finally:
        if tmp_ctx is not None:
            tmp_ctx.cleanup()


if __name__ == "__main__":
    sys.exit(main())
