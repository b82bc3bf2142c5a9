"""`partrain launch slurm`: the sbatch script of a layout, for a SLURM cluster."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from partrain.cli.common import JSON, OVERRIDES, RECIPES, compose_run, fail, stdout_console
from partrain.errors import ConfigError, Problem
from partrain.runtime.sbatch import DEFAULT_MAX_REQUEUES
from partrain.runtime.shared_checkpoints import checkpoint_dir_problems

launch_app = typer.Typer(help="Write the launch script of a layout for a cluster scheduler.", no_args_is_help=True)


@launch_app.command("slurm")
def slurm_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    time: Optional[str] = typer.Option(None, "--time", help="Time limit HH:MM:SS or D-HH:MM:SS (#SBATCH --time)."),
    partition: Optional[str] = typer.Option(
        None, "--partition", help="SLURM partition (#SBATCH --partition); default the cluster's default partition."
    ),
    account: Optional[str] = typer.Option(None, "--account", help="SLURM account (#SBATCH --account)."),
    cpus_per_task: Optional[int] = typer.Option(
        None,
        "--cpus-per-task",
        help="CPU cores per task (one task = one worker); default train.threads_per_process, else the "
        "partition's CPUs per node / tasks per node as sinfo lists them (at most 8 on GPU nodes), else 8 "
        "on GPU clusters and 1 on CPU clusters.",
    ),
    max_requeues: int = typer.Option(
        DEFAULT_MAX_REQUEUES,
        "--max-requeues",
        help="Requeue the job after the time-limit warning at most this many times in all (SLURM_RESTART_COUNT); "
        "0 = never. A user's scancel and a preemption are never requeued by the script.",
    ),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the script to this file instead of printing it."),
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
) -> None:
    """Validate the layout and print its sbatch script (one SLURM task per device).

    --nodes = cluster.nodes, --ntasks-per-node = cluster.devices_per_node, `srun partrain train
    OVERRIDES checkpoint.resume=auto train.run_id=ID`: USR1 120 s before the time limit saves and
    requeues; SIGTERM (scancel, preemption) saves and ends. Every submission of the script continues
    run ID (a new script is a new run). When `sinfo` is on PATH, a request the partition cannot
    hold is refused (exit 2)."""
    from partrain.runtime import partition as slurm_partition
    from partrain.runtime.sbatch import (
        SbatchOptions,
        check_cpus,
        check_max_requeues,
        check_name,
        parse_time,
        sbatch_script,
    )

    try:
        options = SbatchOptions(
            time=parse_time(time) if time is not None else None,
            partition=check_name("--partition", partition),
            account=check_name("--account", account),
            cpus_per_task=check_cpus(cpus_per_task),
            max_requeues=check_max_requeues(max_requeues),
            run_id=_new_run_id(),
        )
        validated = _trainable(list(overrides or []), recipes)
        if shared := checkpoint_dir_problems(validated.run):  # srun's tasks would refuse it anyway: say so now
            raise ConfigError(shared)
        sinfo = slurm_partition.read_sinfo()
        options = _fit_partition(validated.run, options, sinfo)
        script = sbatch_script(validated, list(overrides or []), options)
        if out is not None:
            _write(out, script)
    except ConfigError as err:
        fail(err, as_json)
    if as_json:
        print(json.dumps(_json_report(validated, options, script, sinfo, out)))
    elif out is not None:
        stdout_console().print(f"wrote {out}: submit it with `sbatch {out}`", markup=False)
    else:
        print(script, end="")
    _warn(validated, sinfo)


def _fit_partition(run, options, sinfo):
    """`options` with the partition's CPUs per node, when `sinfo` read the partitions; a ConfigError
    when the partition cannot hold the job. Unchanged when sinfo is not there (nothing to check)."""
    from partrain.runtime import partition as slurm_partition
    from partrain.runtime.sbatch import job_request

    if sinfo.groups is None:
        return options
    gpus = run.cluster.devices_per_node if run.cluster.device == "cuda" else 0
    node_cpus = slurm_partition.cpus_per_node(sinfo.groups, options.partition, run.cluster.nodes, gpus)
    options = dataclasses.replace(options, node_cpus=node_cpus)
    problems = slurm_partition.partition_problems(sinfo.groups, options.partition, job_request(run, options))
    if problems:
        raise ConfigError(problems)
    return options


def _json_report(validated, options, script: str, sinfo, out: Optional[Path]) -> dict:
    """`launch slurm --json`: the job's shape, the script, and whether the partition was checked."""
    from partrain.runtime.sbatch import job_request

    c = validated.run.cluster
    report = {"nodes": c.nodes, "tasks_per_node": c.devices_per_node, "world_size": validated.world_size}
    report.update(gpus_per_node=c.devices_per_node if c.device == "cuda" else 0, script=script)
    report.update(cpus_per_task=job_request(validated.run, options).cpus_per_task, max_requeues=options.max_requeues)
    report.update(partition_checked=sinfo.groups is not None, partition_unchecked=sinfo.unchecked or None)
    return dict(report, out=str(out) if out is not None else None)


def _warn(validated, sinfo) -> None:
    """The notes on stderr after the script: an unchecked partition, a job that would save nothing."""
    warnings = Console(stderr=True, highlight=False)
    if sinfo.groups is None:
        warnings.print(f"note: the partition was not checked ({sinfo.unchecked})", markup=False)
    ck = validated.run.checkpoint
    if ck.every_steps <= 0 and not ck.save_final:
        warnings.print(
            "warning: checkpoint.every_steps=0 and checkpoint.save_final=false: a preempted or timed-out job saves "
            "nothing and its requeue starts from step 0; add checkpoint.every_steps=N",
            markup=False,
        )
    elif ck.every_steps <= 0:
        warnings.print(
            "note: checkpoint.every_steps=0: the job saves at SIGTERM and at its end only, so a crashed node loses "
            "every step since the start; add checkpoint.every_steps=N",
            markup=False,
        )


def _new_run_id() -> str:
    """The run id a new script gets: the time it was written (a new script, a new run)."""
    return datetime.now().strftime("%Y%m%d-%H%M%S")


def _trainable(overrides: List[str], recipes):
    """The validated run, refused (ConfigError) exactly as `partrain train` refuses it."""
    from partrain.blueprint.planner.auto import resolve_layout
    from partrain.blueprint.trainable import unsupported_features

    validated, _ = resolve_layout(compose_run(overrides, recipes), overrides)
    missing = unsupported_features(validated)
    if missing:
        problems = []
        for text in missing:
            key, _, rest = text.partition(" ")
            name, _, value = key.partition("=")
            rule = f"{rest.strip('()') or 'this feature'} is not implemented in this version of partrain"
            problems.append(Problem(name, value, rule, "remove it from the layout"))
        raise ConfigError(problems)
    return validated


def _write(out: Path, script: str) -> None:
    from partrain.blueprint.problems import os_error_problem

    try:
        out.write_text(script)
        out.chmod(0o755)
    except OSError as exc:
        raise ConfigError(os_error_problem("--out", out, exc, "write the script")) from None
