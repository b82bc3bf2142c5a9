"""`partrain train`: compose, validate and launch the workers (or, with --dry-run, only report)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from partrain.cli.common import JSON, OVERRIDES, RECIPES, fail, stdout_console
from partrain.cli.layout_view import (
    CHECK,
    SCHEDULE_SVG,
    exit_for_check,
    preflight,
    print_choice,
    print_layout,
    resolved,
)
from partrain.errors import ConfigError, Problem


def train(
    overrides: Optional[List[str]] = OVERRIDES,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate and show the layout; start no process, create no file."
    ),
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
    all_ranks: bool = typer.Option(False, "--all-ranks", help="Show every rank and group in the terminal tables."),
    schedule_svg: Optional[Path] = SCHEDULE_SVG,
    check: bool = CHECK,
    node_rank: Optional[int] = typer.Option(
        None,
        "--node-rank",
        help="Multi-node: this machine's node, 0..cluster.nodes-1; node K runs global ranks K x devices_per_node "
        "onwards, so node 0 runs global rank 0 and holds the summary (sets cluster.node_rank).",
    ),
    rdzv_endpoint: Optional[str] = typer.Option(
        None,
        "--rdzv-endpoint",
        help="Multi-node: HOST:PORT of the rendezvous on node 0, the same on every node (sets cluster.rdzv_endpoint).",
    ),
) -> None:
    """Compose, validate and train (launches workers with torchrun)."""
    if check and not dry_run:
        fail(ConfigError(Problem("--check", True, "only goes with --dry-run", "add --dry-run")), as_json)
    # The flags win over the keys: Hydra applies the last override of a key.
    overrides = [*(overrides or []), *([f"cluster.node_rank={node_rank}"] if node_rank is not None else [])]
    overrides += [f"cluster.rdzv_endpoint={rdzv_endpoint}"] if rdzv_endpoint is not None else []
    validated, choice = resolved(overrides, recipes, as_json, fetch_data=not dry_run)
    if dry_run:
        _refuse_what_the_launch_refuses(validated, as_json)
        facts: dict = {}
        unchecked = preflight(validated, as_json, facts)  # the launch's checks, before any verdict is printed
        report = print_layout(
            validated, as_json, all_ranks, schedule_svg, auto_choice=choice, unchecked=unchecked, data_facts=facts
        )
        if not as_json and validated.world_size > 1:
            from partrain.cli.rehearse_cmd import dry_run_hint

            stdout_console().print(dry_run_hint(validated, list(overrides), dict(os.environ)), markup=False)
        exit_for_check(report, check)
        return
    from partrain.blueprint.trainable import unsupported_features

    missing = unsupported_features(validated)
    if missing:
        fail(ConfigError([_unsupported_problem(text) for text in missing]), as_json)
    from partrain.train.display import Display

    # Decided once, here: a live display on a terminal, plain lines into a file or pipe, and with
    # --json nothing but the summary object on stdout (human text on stderr).
    display = Display.choose(as_json, sys.stdout.isatty())
    print_choice(choice, display.console)
    _warn_if_predicted_not_to_fit(validated, display.console)
    from partrain.launch import launch

    try:
        code = launch(validated, console=display.console, environ=dict(os.environ), display=display, auto_choice=choice)
    except ConfigError as err:
        fail(err, as_json)
    raise typer.Exit(code)


def _refuse_what_the_launch_refuses(validated, as_json: bool) -> None:
    """The dry run's share of the launch's own checks, with its messages: a multi-node run's
    rendezvous endpoint, node rank and shared checkpoint folder (under srun or the user's torchrun,
    which do the rendezvous, only the folder), so a dry run never says ready for what train refuses."""
    from partrain.multinode import rendezvous_of
    from partrain.runtime.context import from_environ
    from partrain.runtime.shared_checkpoints import checkpoint_dir_problems

    try:
        if from_environ(dict(os.environ)) is None:
            rendezvous_of(validated)
        elif problems := checkpoint_dir_problems(validated.run):
            raise ConfigError(problems)
    except ConfigError as err:
        fail(err, as_json)


def _warn_if_predicted_not_to_fit(validated, console) -> None:
    """The planner's verdict before a launch: a warning, not a refusal (a measured run decides); and
    the warning of a run that keeps nothing."""
    from partrain.blueprint.config.saving import nothing_note
    from partrain.blueprint.planner import estimate
    from partrain.blueprint.report.estimate import verdict_text
    from partrain.runtime.context import from_environ

    worker = from_environ(dict(os.environ))
    if worker is not None and not worker.is_main:  # under srun / the user's torchrun: said once, by rank 0
        return
    est = estimate(validated)
    if not est["fits"]:
        text = f"warning: the planner predicts this layout {verdict_text(est)}; `partrain plan` shows the breakdown"
        console.print(text, markup=False)
    if note := nothing_note(validated.run):
        console.print(f"warning: {note}", markup=False)


def _unsupported_problem(text: str):
    from partrain.errors import Problem

    key, _, rest = text.partition(" ")
    name, _, value = key.partition("=")
    return Problem(
        name,
        value,
        f"{rest.strip('()') or 'this feature'} is not implemented in this version of partrain",
        "remove it from the layout (see `partrain train ... --dry-run` for what runs now)",
    )
