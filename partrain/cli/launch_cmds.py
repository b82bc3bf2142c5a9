"""`partrain launch slurm`: the sbatch script of a layout, for a SLURM cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from partrain.cli.common import JSON, OVERRIDES, RECIPES, compose_run, fail, stdout_console
from partrain.errors import ConfigError, Problem

launch_app = typer.Typer(help="Write the launch script of a layout for a cluster scheduler.", no_args_is_help=True)


@launch_app.command("slurm")
def slurm_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    time: Optional[str] = typer.Option(None, "--time", help="Time limit HH:MM:SS or D-HH:MM:SS (#SBATCH --time)."),
    partition: Optional[str] = typer.Option(None, "--partition", help="SLURM partition (#SBATCH --partition)."),
    account: Optional[str] = typer.Option(None, "--account", help="SLURM account (#SBATCH --account)."),
    cpus_per_task: Optional[int] = typer.Option(
        None,
        "--cpus-per-task",
        help="CPU cores per task (one task = one worker); default train.threads_per_process, else 8.",
    ),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the script to this file instead of printing it."),
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
) -> None:
    """Validate the layout and print its sbatch script (one SLURM task per device).

    --nodes = cluster.nodes, --ntasks-per-node = cluster.devices_per_node, `srun partrain train
    OVERRIDES checkpoint.resume=auto`, SIGTERM 120 s before the time limit and a requeue after the
    checkpoint it triggers."""
    from partrain.runtime.sbatch import SbatchOptions, check_cpus, check_name, parse_time, sbatch_script

    try:
        options = SbatchOptions(
            time=parse_time(time) if time is not None else None,
            partition=check_name("--partition", partition),
            account=check_name("--account", account),
            cpus_per_task=check_cpus(cpus_per_task),
        )
        validated = _trainable(list(overrides or []), recipes)
        script = sbatch_script(validated, list(overrides or []), options)
        if out is not None:
            _write(out, script)
    except ConfigError as err:
        fail(err, as_json)
    if as_json:
        c = validated.run.cluster
        report = {"nodes": c.nodes, "tasks_per_node": c.devices_per_node, "world_size": validated.world_size}
        report.update(gpus_per_node=c.devices_per_node if c.device == "cuda" else 0, script=script)
        print(json.dumps(dict(report, out=str(out) if out is not None else None)))
    elif out is not None:
        stdout_console().print(f"wrote {out}: submit it with `sbatch {out}`", markup=False)
    else:
        print(script, end="")
    if validated.run.checkpoint.every_steps <= 0:
        Console(stderr=True, highlight=False).print(
            "warning: checkpoint.every_steps=0: a preempted or timed-out job saves nothing and its requeue starts "
            "from step 0; add checkpoint.every_steps=N",
            markup=False,
        )


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
