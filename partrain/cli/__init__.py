"""The `partrain` command line (Typer). Overrides are Hydra-style positional arguments.

Exit codes: 0 success; 2 bad config or usage (one message per problem, nothing created);
1 a failure while running (or a run that ended without training); 128 + N when stopped by signal N
(130 Ctrl-C, 143 SIGTERM, 129 when torchrun or the workers were lost).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from partrain.cli.bench_cmds import bench_app
from partrain.cli.checkpoint_cmds import checkpoint_app
from partrain.cli.common import JSON, OVERRIDES, RECIPES, fail, recipe_dirs, stdout_console
from partrain.errors import ConfigError, Problem

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Declarative parallel training of Hugging Face language models (DP/ZeRO, TP, PP, EP, SP).",
)


def _validated(overrides, recipes, as_json: bool):
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate

    try:
        run = compose(overrides or [], recipe_dirs(recipes, dict(os.environ)))
        return validate(run)
    except ConfigError as err:
        fail(err, as_json)


SCHEDULE_SVG = typer.Option(None, "--schedule-svg", help="Also write the pipeline schedule picture to this SVG file.")


def _print_layout(
    validated,
    as_json: bool,
    all_ranks: bool,
    schedule_svg: Optional[Path] = None,
    search_top: int = 0,
    simulate_ranks: Optional[List[int]] = None,
) -> dict:
    from partrain.blueprint.planner import estimate, search
    from partrain.blueprint.report.estimate import (
        render_candidates,
        render_estimate,
        verdict_text,
    )
    from partrain.blueprint.report.layout import (
        SCHEDULE_PICTURE_LIMIT,
        layout_report,
        render_layout,
        schedule_grid_of,
    )

    report = layout_report(validated)
    report["estimate"] = estimate(validated)
    report["verdict"] += "; " + verdict_text(report["estimate"])
    if search_top:
        try:
            report["candidates"] = search(validated, top_k=search_top)
        except ConfigError as err:
            fail(err, as_json)
    if simulate_ranks is not None:
        report["simulation"] = _simulation(validated, simulate_ranks, as_json)
    drawable = "bubble_fraction_simulated" in report.get("pipeline", {})
    if schedule_svg is not None and drawable:
        from partrain.blueprint.report.schedule import to_svg

        try:
            to_svg(schedule_grid_of(validated), schedule_svg)
        except OSError as exc:
            from partrain.blueprint.problems import os_error_problem

            fail(ConfigError(os_error_problem("--schedule-svg", schedule_svg, exc, "write the picture")), as_json)
        report["pipeline"]["svg"] = str(schedule_svg)
    if as_json:
        print(json.dumps(report, default=str))
    else:
        picture = None
        if drawable:
            from partrain.blueprint.report.schedule import render_text

            picture = render_text(schedule_grid_of(validated), max_slots=120)
        render_layout(report, stdout_console(), all_ranks=all_ranks, picture=picture)
        render_estimate(report["estimate"], stdout_console())
        if "candidates" in report:
            render_candidates(report["candidates"], stdout_console())
        if "simulation" in report:
            from partrain.blueprint.report.estimate import render_simulation

            render_simulation(report["simulation"], stdout_console(), all_ranks=all_ranks)
        if schedule_svg is not None and not drawable:
            stdout_console().print(f"no schedule picture: pp=1 or more than {SCHEDULE_PICTURE_LIMIT} pipeline slots")
    return report


@app.command()
def train(
    overrides: Optional[List[str]] = OVERRIDES,
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Validate and show the layout; start no process, create no file."
    ),
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
    all_ranks: bool = typer.Option(False, "--all-ranks", help="Show every rank and group in the terminal tables."),
    schedule_svg: Optional[Path] = SCHEDULE_SVG,
) -> None:
    """Compose, validate and train (launches workers with torchrun)."""
    validated = _validated(overrides, recipes, as_json)
    if dry_run:
        _print_layout(validated, as_json, all_ranks, schedule_svg)
        return
    from partrain.blueprint.trainable import unsupported_features

    missing = unsupported_features(validated)
    if missing:
        fail(ConfigError([_unsupported_problem(text) for text in missing]), as_json)
    from partrain.launch import launch

    try:
        code = launch(validated, console=stdout_console(), environ=dict(os.environ))
    except ConfigError as err:
        fail(err, as_json)
    raise typer.Exit(code)


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


def _simulation(validated, ranks: List[int], as_json: bool) -> dict:
    world = validated.layout.world_size
    for rank in ranks:
        if not 0 <= rank < world:
            fail(
                ConfigError(
                    Problem(
                        "--simulate-rank",
                        rank,
                        f"must be a rank of this layout (0 to {world - 1})",
                        "pass a rank below the world size, or omit it for the first and last rank of each pipeline "
                        "stage",
                    )
                ),
                as_json,
            )
    from partrain.blueprint.trainable import IMPLEMENTED

    # sp changes where parameters live (FSDP shards over dp x sp): until the runtime builds it, a
    # simulation would report a different model than the estimate. Experts over ep are built by
    # shard_on_meta (parallel/expert_parallel.apply_ep), so ep is simulated.
    for axis, what in (("sp", "sequence/context parallelism"),):
        degree = getattr(validated.layout, axis)
        if degree > 1 and not IMPLEMENTED[axis]:
            fail(
                ConfigError(
                    Problem(
                        f"parallel.{axis}",
                        degree,
                        f"--simulate builds what `partrain train` builds, and {what} is not built yet",
                        f"simulate with parallel.{axis}=1, or drop --simulate (the estimate covers parallel.{axis})",
                    )
                ),
                as_json,
            )
    from partrain.simulate.fake_world import simulate

    try:
        return simulate(validated, ranks).to_json()
    except ConfigError as err:  # a wrapper refusing this layout, as `partrain train` would
        fail(err, as_json)


@app.command()
def plan(
    overrides: Optional[List[str]] = OVERRIDES,
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
    all_ranks: bool = typer.Option(False, "--all-ranks", help="Show every rank and group in the terminal tables."),
    schedule_svg: Optional[Path] = SCHEDULE_SVG,
    search_layouts: bool = typer.Option(
        False,
        "--search",
        help="Rank every valid layout of this model, cluster and global batch by predicted step time; show the "
        "fastest that fit.",
    ),
    top: int = typer.Option(10, "--top", min=1, help="How many layouts --search shows."),
    simulate: bool = typer.Option(
        False,
        "--simulate",
        help="Build the real model on meta and apply partrain's real parallel wrappers under torch's fake process "
        "group at the full world size; report each simulated rank's parameter shapes and bytes next to the "
        "estimate (the first and last rank of each pipeline stage unless --simulate-rank).",
    ),
    simulate_rank: Optional[List[int]] = typer.Option(
        None, "--simulate-rank", help="Simulate this global rank (repeatable; implies --simulate)."
    ),
) -> None:
    """Validate a layout and show its report: rank table, groups, schedule, per-rank memory, FLOPs,
    communication, bubble, predicted step time, tokens/s, MFU and whether it fits."""
    simulate_ranks = list(simulate_rank or []) if (simulate or simulate_rank) else None
    report = _print_layout(
        _validated(overrides, recipes, as_json),
        as_json,
        all_ranks,
        schedule_svg,
        search_top=top if search_layouts else 0,
        simulate_ranks=simulate_ranks,
    )
    if search_layouts and not report.get("candidates"):
        raise typer.Exit(2)


@app.command()
def show(
    overrides: Optional[List[str]] = OVERRIDES,
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
    explain: bool = typer.Option(
        False, "--explain", help="List every config key with its type, value and documentation."
    ),
) -> None:
    """Print the composed, resolved config (YAML), as a worker would read it."""
    from partrain.blueprint.config.compose import compose, to_yaml

    try:
        run = compose(overrides or [], recipe_dirs(recipes, dict(os.environ)))
    except ConfigError as err:
        fail(err, as_json)
    if explain:
        from partrain.blueprint.config.docs import explain_rows

        rows = explain_rows(run)
        if as_json:
            print(json.dumps(rows, default=str))
            return
        from rich.table import Table

        table = Table(title="config keys")
        for col in ("key", "type", "value", "meaning"):
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(row["key"], row["type"], repr(row["value"]), row["doc"])
        stdout_console().print(table)
        return
    if as_json:
        from dataclasses import asdict

        print(json.dumps(asdict(run), default=str))
    else:
        print(to_yaml(run), end="")


@app.command("recipes")
def list_recipes_cmd(as_json: bool = JSON, recipes: Optional[List[Path]] = RECIPES) -> None:
    """List the recipes, one line each (user folders first; shadowed shipped recipes are marked)."""
    from partrain.blueprint.config.recipes import list_recipes

    try:
        found = list_recipes(recipe_dirs(recipes, dict(os.environ)))
    except ConfigError as err:
        fail(err, as_json)
    if as_json:
        print(
            json.dumps(
                [
                    {
                        "name": r.name,
                        "description": r.description,
                        "path": str(r.path),
                        "shipped": r.shipped,
                        "shadows": str(r.shadows) if r.shadows else None,
                    }
                    for r in found.values()
                ]
            )
        )
        return
    from rich.table import Table

    table = Table(title="recipes (partrain train recipe=NAME)", title_justify="left")
    table.add_column("name", style="bold")
    table.add_column("description")
    table.add_column("source")
    for r in found.values():
        source = "shipped" if r.shipped else str(r.path.parent)
        if r.shadows:
            source += f" (overrides {r.shadows})"
        table.add_row(r.name, r.description, source)
    stdout_console().print(table)


app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(bench_app, name="bench")


def main(argv: Optional[List[str]] = None) -> None:
    """Console-script entry point."""
    try:
        app(args=argv, prog_name="partrain", standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
