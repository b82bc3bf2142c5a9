"""What every `partrain` subcommand shares: the common options, the recipe search path and the
one way a config error is reported (exit 2)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable, List, Mapping, Optional, Sequence

import typer
from rich.console import Console

from partrain.errors import ConfigError, Problem

RECIPES_ENV = "PARTRAIN_RECIPES"
"""Colon-separated recipe folders searched after --recipes and before the shipped recipes."""


OVERRIDES = typer.Argument(
    None, help="Hydra overrides: recipe=NAME, group=option (model=llama-tiny), key=value (parallel.tp=4)."
)
RECIPES = typer.Option(
    None, "--recipes", help=f"Extra recipe folder (repeatable); searched before ${RECIPES_ENV} and the shipped recipes."
)
JSON = typer.Option(False, "--json", help="Print the report as JSON (documented keys; see docs/planner.md).")


REPORT_WIDTH = 100
"""Columns of a report written to a file or a pipe with no terminal to measure and no COLUMNS set."""


def report_width(
    environ: Mapping[str, str], terminal_size: Callable[[int], Sequence[int]] = os.get_terminal_size
) -> Optional[int]:
    """The console width to force, or None to let rich measure it.

    COLUMNS wins when set, and a terminal on stdin, stdout or stderr gives its width (rich measures
    both; `partrain plan | less` keeps the terminal's width). With neither, rich would choose 80
    columns, which wraps most rows of the summary and step tables into two lines; the reports are laid
    out for REPORT_WIDTH columns, and a log file or a CI page has no width of its own."""
    if environ.get("COLUMNS", "").isdigit():
        return None
    for fd in (0, 1, 2):
        try:
            if terminal_size(fd)[0] > 0:
                return None
        except (AttributeError, ValueError, OSError):  # not a terminal
            continue
    return REPORT_WIDTH


def stdout_console() -> Console:
    return Console(highlight=False, width=report_width(os.environ))


def recipe_dirs(cli_dirs: Optional[List[Path]], environ: dict) -> List[str]:
    given = [("--recipes", str(d)) for d in cli_dirs or []]
    given += [(RECIPES_ENV, d) for d in environ.get(RECIPES_ENV, "").split(os.pathsep) if d]
    for source, d in given:  # checked even when no recipe is named: a folder the user gives must exist
        if not Path(d).expanduser().is_dir():
            raise ConfigError(Problem(source, d, "not a folder", "pass an existing folder of recipe YAML files"))
    return [d for _, d in given]


def local_gpus(which: Callable = shutil.which, run: Callable = subprocess.run):
    """This machine's GPUs as nvidia-smi lists them (blueprint.config.local_gpus); none where it is not
    installed, fails, or takes over 10 s. Composing with them turns the default CPU cluster into them."""
    from partrain.blueprint.config.local_gpus import NO_GPUS, NVIDIA_SMI_QUERY, parse_nvidia_smi

    if which(NVIDIA_SMI_QUERY[0]) is None:
        return NO_GPUS
    try:
        done = run(list(NVIDIA_SMI_QUERY), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return NO_GPUS
    return parse_nvidia_smi(done.stdout) if done.returncode == 0 else NO_GPUS


def compose_on_this_machine(overrides: List[str], recipes: Optional[List[Path]]):
    """compose() with the recipe folders of --recipes and $PARTRAIN_RECIPES and this machine's GPUs."""
    from partrain.blueprint.config.compose import compose

    return compose(overrides or [], recipe_dirs(recipes, dict(os.environ)), local_gpus())


def compose_run(overrides: List[str], recipes: Optional[List[Path]], fetch_data: bool = True):
    """Compose the config, then resolve Hub ids (model.pretrained, data.tokenizer, data.source) to
    local snapshot folders, as every command must before validating (partrain.preflight.hub).
    fetch_data=False (dry run, plan): a Hub dataset only from the local Hub cache, never downloaded."""
    from partrain.preflight.hub import resolve_hub_ids

    return resolve_hub_ids(compose_on_this_machine(overrides, recipes), fetch_data)


def fail(err: ConfigError, as_json: bool) -> None:
    from partrain.blueprint.report.layout import error_report, render_errors

    if as_json:
        print(json.dumps(error_report(err), indent=1, default=str))
    else:
        render_errors(err, Console(stderr=True, highlight=False))
    raise typer.Exit(2)
