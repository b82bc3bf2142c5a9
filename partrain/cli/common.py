"""What every `partrain` subcommand shares: the common options, the recipe search path and the
one way a config error is reported (exit 2)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

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
JSON = typer.Option(False, "--json", help="Print the report as JSON (documented keys; see README).")


def stdout_console() -> Console:
    return Console(highlight=False)


def recipe_dirs(cli_dirs: Optional[List[Path]], environ: dict) -> List[str]:
    given = [("--recipes", str(d)) for d in cli_dirs or []]
    given += [(RECIPES_ENV, d) for d in environ.get(RECIPES_ENV, "").split(os.pathsep) if d]
    for source, d in given:  # checked even when no recipe is named: a folder the user gives must exist
        if not Path(d).expanduser().is_dir():
            raise ConfigError(Problem(source, d, "not a folder", "pass an existing folder of recipe YAML files"))
    return [d for _, d in given]


def compose_run(overrides: List[str], recipes: Optional[List[Path]]):
    """Compose the config, then resolve Hub ids (model.pretrained, data.tokenizer, data.source) to
    local snapshot folders, as every command must before validating (partrain.preflight.hub)."""
    from partrain.blueprint.config.compose import compose
    from partrain.preflight.hub import resolve_hub_ids

    return resolve_hub_ids(compose(overrides or [], recipe_dirs(recipes, dict(os.environ))))


def fail(err: ConfigError, as_json: bool) -> None:
    from partrain.blueprint.report.layout import error_report, render_errors

    if as_json:
        print(json.dumps(error_report(err), indent=1, default=str))
    else:
        render_errors(err, Console(stderr=True, highlight=False))
    raise typer.Exit(2)
