"""Start a validated run: run folder, data, then torchrun workers with a live progress display.

Under an existing torchrun or srun (RANK / SLURM_PROCID set) this process is itself the worker.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Mapping, Optional

from partrain.blueprint.config.compose import to_yaml
from partrain.blueprint.validate import ValidatedRun
from partrain.errors import ConfigError, Problem
from partrain.preflight import check_before_launch
from partrain.runtime.context import DistEnv, cpu_count, from_environ
from partrain.runtime.torchrun import torchrun_command
from partrain.train.metrics import parse_event
from partrain.worker import DATA_MANIFEST


def default_run_dir(v: ValidatedRun, job_id: Optional[str] = None) -> Path:
    name = v.run.recipe or v.run.model.name or "default"
    stamp = job_id or time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / name / stamp


def _unique(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}-{n}")
        n += 1
    return candidate


def prepare_run_dir(v: ValidatedRun, run_dir: Path) -> Path:
    """Write the run folder: resolved config.yaml and data.json. The data is tokenized and checked
    by `partrain.preflight.check_before_launch` first; here it is found in the cache."""
    from partrain.data import prepare_tokens

    packed = prepare_tokens(v.run.data, Path(v.run.data.cache_dir).expanduser() if v.run.data.cache_dir else None)
    run_dir.mkdir(parents=True, exist_ok=True)
    v.run.train.run_dir = str(run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(v.run))
    (run_dir / DATA_MANIFEST).write_text(json.dumps({"meta_path": str(packed.meta_path)}))
    return run_dir


def worker_command(v: ValidatedRun, run_dir: Path) -> list:
    """torchrun starting `partrain.worker RUN_DIR` in every process of this machine."""
    return torchrun_command(
        v.world_size,
        ["-m", "partrain.worker", run_dir],
        max_restarts=v.run.train.max_restarts,
        log_dir=run_dir / "torchrun",
        quiet_other_ranks=True,
    )


def launch(v: ValidatedRun, console, environ: Mapping[str, str]) -> int:
    """Returns the exit code for the CLI."""
    env = from_environ(environ)
    if env is not None:
        return _run_as_worker(v, env, environ)
    check_before_launch(v)
    if v.run.cluster.nodes > 1:
        raise_config(
            Problem(
                "cluster.nodes",
                v.run.cluster.nodes,
                "a multi-node run needs a launcher on every node",
                "start `partrain train ...` under torchrun (--nnodes, --rdzv-endpoint) or srun on each node",
            )
        )
    if v.run.cluster.device == "cuda":
        import torch

        if torch.cuda.device_count() < v.world_size:
            raise_config(
                Problem(
                    "cluster.device",
                    "cuda",
                    f"the layout needs {v.world_size} GPUs, this machine has {torch.cuda.device_count()}",
                    "use cluster=local-cpu, or a smaller layout",
                )
            )
    try:
        run_dir = prepare_run_dir(v, Path(v.run.train.run_dir) if v.run.train.run_dir else _unique(default_run_dir(v)))
    except ConfigError as err:
        raise_config(*err.problems)
    threads = v.run.train.threads_per_process or max(1, cpu_count() // v.world_size)
    child_env = dict(environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    console.print(f"[bold]partrain[/bold]: {v.world_size} processes, run folder [cyan]{run_dir}[/cyan]")
    proc = subprocess.Popen(worker_command(v, run_dir), stdout=subprocess.PIPE, text=True, env=child_env, bufsize=1)
    summary = _follow(proc, console)
    code = proc.wait()
    if code != 0:
        _report_failure(run_dir, code, console)
        return 1
    if summary:
        _print_summary(summary, console)
    return 0


def raise_config(*problems: Problem) -> None:
    raise ConfigError(list(problems))


def _run_as_worker(v: ValidatedRun, env: DistEnv, environ: Mapping[str, str]) -> int:
    from partrain import worker
    from partrain.runtime.lifecycle import leave

    job = environ.get("TORCHELASTIC_RUN_ID") or environ.get("SLURM_JOB_ID") or "job"
    run_dir = Path(v.run.train.run_dir) if v.run.train.run_dir else default_run_dir(v, job_id=job)
    if env.is_main:
        check_before_launch(v)
        prepare_run_dir(v, run_dir)
    else:
        deadline = time.monotonic() + v.run.train.timeout_s
        while not (run_dir / DATA_MANIFEST).exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank 0 did not prepare {run_dir} within train.timeout_s")
            time.sleep(0.2)
    leave(worker.main(run_dir, env, v))


def _follow(proc: subprocess.Popen, console) -> Optional[dict]:
    """Render rank 0's events as a live progress bar; pass other output through."""
    from rich.progress import (
        BarColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    summary = None
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
    task = None
    with progress:
        for line in proc.stdout:
            event = parse_event(line)
            if event is None:
                progress.console.print(line.rstrip("\n"), highlight=False, markup=False)
                continue
            kind = event["event"]
            if kind == "start":
                task = progress.add_task(
                    "train", total=event["steps"], completed=event.get("first_step", 0), info="starting"
                )
            elif kind == "step" and task is not None:
                info = f"loss {event['loss']:.4f}  lr {event['lr']:.2e}  {event['tokens_per_s']:,.0f} tok/s"
                progress.update(task, completed=event["step"], info=info)
            elif kind == "eval":
                progress.console.print(f"step {event['step']}: eval loss {event['eval_loss']:.4f}", markup=False)
            elif kind == "summary":
                summary = event
    return summary


def _report_failure(run_dir: Path, code: int, console) -> None:
    errors = (
        sorted((run_dir / "errors").glob("rank-*.txt"), key=lambda p: p.stat().st_mtime)
        if (run_dir / "errors").exists()
        else []
    )
    if errors:
        first = errors[0].read_text().split("\n\n", 1)[0]
        console.print("[bold red]training failed[/bold red]: ", end="", highlight=False)
        console.print(first, markup=False, highlight=False)
        console.print(f"traceback: {errors[0]}; logs: {run_dir / 'logs'}", markup=False, highlight=False)
    else:
        console.print(
            f"[bold red]training failed[/bold red] (torchrun exit code {code}); logs: {run_dir}", highlight=False
        )


def _print_summary(summary: dict, console) -> None:
    from rich.table import Table

    table = Table(title="run summary", show_header=False, title_justify="left")
    table.add_row("steps", str(summary["steps"]))
    table.add_row("final train loss", f"{summary['final_loss']:.4f}")
    if summary.get("eval_loss") is not None:
        table.add_row("final eval loss", f"{summary['eval_loss']:.4f}")
    table.add_row("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s")
    for r in summary["ranks"]:
        experts = f", expert params {r['expert_param_bytes'] / 2**20:.2f} MiB" if "expert_param_bytes" in r else ""
        table.add_row(
            f"rank {r['rank']} memory",
            f"model state {r['model_state_bytes'] / 2**20:.2f} MiB{experts}, peak RSS "
            f"{r['peak_rss_bytes'] / 2**20:.0f} MiB",
        )
    table.add_row("run folder", summary["run_dir"])
    console.print(table)
    if summary.get("moe"):
        from partrain.blueprint.report.expert_load import expert_load_table

        console.print(expert_load_table(summary["moe"]))
