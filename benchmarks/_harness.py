"""What the benchmark scripts share: the result of one run, the workers' environment, the
optimizer/batch part of a baseline's spec, reading a partrain run folder, and running a command
while sampling its workers' CPU time from /proc (Linux)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional


@dataclass
class RunResult:
    step_times: List[float]
    wall_s: float
    ranks: List[dict]
    losses: List[float]
    note: str = ""
    foreign_cores: float = float("nan")
    """Average CPU cores used by processes other than this benchmark's while the run lasted."""
    cpu_ms: float = float("nan")
    """CPU milliseconds per timed step per worker (see run_watched)."""
    extra: dict = field(default_factory=dict)


def worker_env(extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """One thread per worker, quiet and offline HF, and no outer launcher's variables."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        TRANSFORMERS_VERBOSITY="error",
        HF_HUB_OFFLINE="1",
    )
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)  # partrain would otherwise act as a worker of an outer launcher
    env.update(extra or {})
    return env


def training_spec(v) -> dict:
    """The batch, seed, optimizer and schedule of a validated run, for a baseline loop to copy."""
    run, o = v.run, v.run.optim
    return {
        "seq_len": run.train.seq_len,
        "global_batch_size": v.global_batch_size,
        "micro_batch_size": run.train.micro_batch_size,
        "steps": run.train.steps,
        "seed": run.train.seed,
        "lr": o.lr,
        "min_lr_ratio": o.min_lr_ratio,
        "warmup_steps": o.warmup_steps,
        "weight_decay": o.weight_decay,
        "beta1": o.beta1,
        "beta2": o.beta2,
        "eps": o.eps,
        "grad_clip": o.grad_clip,
        "tokens_per_step": v.tokens_per_step,
    }


def partrain_command(overrides: List[str]) -> List[str]:
    return [sys.executable, "-m", "partrain.cli", "train", *overrides]


def read_partrain_run(run_dir: Path, wall_s: float, cpu_ms: float = float("nan")) -> RunResult:
    """Step times and losses from metrics.jsonl, per-rank figures from summary.json."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_time_s" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return RunResult(
        [r["step_time_s"] for r in steps], wall_s, summary["ranks"], [r["loss"] for r in steps], cpu_ms=cpu_ms
    )


def measure_training(overrides: List[str], run_dir: Path, tokens_per_step: int, skip: int = 3) -> dict:
    """`partrain train OVERRIDES train.run_dir=RUN_DIR` in a process of its own; its tokens/s (tokens_per_step
    over the median step time, the first `skip` steps dropped), the largest per-rank model state and peak RSS,
    the last loss and the 1-minute load average at its end (summary.json)."""
    import statistics

    cmd = partrain_command([*overrides, f"train.run_dir={run_dir}"])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = read_partrain_run(run_dir, time.perf_counter() - t0)
    step = statistics.median(result.step_times[skip:] or result.step_times)
    summary = json.loads((run_dir / "summary.json").read_text())
    load = ((summary.get("planned_vs_measured") or {}).get("cpu_load") or {}).get("load_average_1m", float("nan"))
    return {
        "tokens_per_s": tokens_per_step / step,
        "state": max(r["model_state_bytes"] for r in result.ranks),
        "rss": max(r["peak_rss_bytes"] for r in result.ranks),
        "loss": result.losses[-1],
        "load": load,
    }


def _descendants(pid: int) -> List[int]:
    out = []
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            kids = [int(k) for k in f.read().split()]
    except OSError:
        return out
    for k in kids:
        out.append(k)
        out.extend(_descendants(k))
    return out


def _cpu_s(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as f:
            return f.read().replace("\0", " ")
    except OSError:
        return ""


def _lines(path: Path) -> int:
    try:
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def run_watched(
    cmd: List[str],
    run_dir: Path,
    progress: Path,
    marker: str,
    args,
    procs: int = 2,
    env_extra: Optional[Dict[str, str]] = None,
) -> tuple:
    """Run cmd; while it trains, read the CPU time of its worker processes (cmdline contains `marker`;
    not torchrun's agent)
    when rank 0 has logged --warmup steps and when it has logged all of them.

    Returns (wall_s, cpu_ms_per_step_per_rank or nan). CPU time counts only what the workers
    themselves ran (all their threads), so other processes on the machine change it far less than
    the wall-clock step time: a cross-check for noisy machines (Linux /proc only).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    out, err = open(run_dir / "stdout.txt", "w"), open(run_dir / "stderr.txt", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=worker_env(env_extra), cwd=run_dir)
    workers: List[int] = []
    marks: List[tuple] = []  # (lines logged, cpu seconds of all workers)
    try:
        while proc.poll() is None:
            if time.perf_counter() - t0 > args.timeout:
                proc.kill()
                raise subprocess.TimeoutExpired(cmd, args.timeout)
            if len(workers) < procs:
                workers = [
                    p
                    for p in _descendants(proc.pid)
                    if marker in _cmdline(p) and "torch.distributed.run" not in _cmdline(p)
                ]
            n = _lines(progress)
            wanted = args.warmup if not marks else args.steps
            if len(workers) == procs and n >= wanted and len(marks) < 2:
                cpu = [_cpu_s(p) for p in workers]
                if all(c is not None for c in cpu):
                    marks.append((n, sum(cpu)))
            time.sleep(0.02)
    finally:
        out.close()
        err.close()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)}\nexit {proc.returncode}\n{(run_dir / 'stdout.txt').read_text()[-3000:]}\n"
            f"{(run_dir / 'stderr.txt').read_text()[-3000:]}"
        )
    cpu_ms = float("nan")
    if len(marks) == 2 and marks[1][0] > marks[0][0]:
        cpu_ms = (marks[1][1] - marks[0][1]) / (marks[1][0] - marks[0][0]) / procs * 1e3
    return wall, cpu_ms
