"""`partrain show` and `partrain recipes`: the composed config, its differences, the recipes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer

from partrain.cli.common import JSON, OVERRIDES, RECIPES, compose_on_this_machine, fail, recipe_dirs, stdout_console
from partrain.errors import ConfigError, Problem


def show(
    overrides: Optional[List[str]] = OVERRIDES,
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
    explain: bool = typer.Option(
        False, "--explain", help="List every config key with its type, value and documentation."
    ),
    diff: bool = typer.Option(
        False, "--diff", help="Show only the keys that differ from the defaults (or from the recipe --against names)."
    ),
    against: Optional[str] = typer.Option(
        None, "--against", help="With --diff: compare with this recipe instead of the defaults."
    ),
) -> None:
    """Print the composed, resolved config (YAML), as a worker would read it."""
    from partrain.blueprint.config.compose import to_yaml

    try:
        run = compose_on_this_machine(overrides or [], recipes)
    except ConfigError as err:
        fail(err, as_json)
    choice = None
    if run.parallel.auto:
        run, choice = _chosen(overrides, recipes, as_json)
    if against is not None and not diff:
        fail(ConfigError(Problem("--against", against, "only goes with --diff", "add --diff")), as_json)
    if diff:
        _show_diff(run, against, recipes, as_json)
        return
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

        print(json.dumps({**asdict(run), **({"auto_choice": choice} if choice else {})}, default=str))
    else:
        if choice is not None:
            print(_choice_comment(choice))
        print(to_yaml(run), end="")


def _chosen(overrides, recipes, as_json: bool):
    """(the run with the layout parallel=auto chooses, the record of the choice): what `train` runs."""
    from partrain.blueprint.planner.auto import choose_layout
    from partrain.cli.common import compose_run

    try:
        validated, record = choose_layout(compose_run(overrides or [], recipes, False), overrides or [])
    except ConfigError as err:
        fail(err, as_json)
    return validated.run, record


COMMENT_WIDTH = 100
"""`show`'s comment lines stay within the width the reports keep (YAML itself is printed as it is)."""


def _choice_comment(record: dict) -> str:
    """YAML comment lines saying the layout below was chosen by parallel=auto, and how it does."""
    import textwrap

    from partrain.blueprint.planner.auto import memory_phrase, short_layout

    chosen = record["chosen"]
    text = (
        f"parallel=auto chose this layout: {short_layout(chosen['layout'])}; predicted "
        f"{chosen['step_time_s']:.4g} s/step, {memory_phrase(record)}"
    )
    return "\n".join("# " + line for line in textwrap.wrap(text, width=COMMENT_WIDTH - 2))


def _show_diff(run, against: Optional[str], recipes, as_json: bool) -> None:
    """`show --diff`: one line per key that differs from the defaults or from a recipe."""
    from partrain.blueprint.config.docs import config_diff

    try:
        base = compose_on_this_machine([f"recipe={against}"] if against else [], recipes)
    except ConfigError as err:
        if against:  # the recipe is named by --against, not by an override
            err = ConfigError([Problem("--against", against, p.rule, p.fix) for p in err.problems])
        fail(err, as_json)
    rows = config_diff(run, base)
    if as_json:
        print(json.dumps({"against": against or "defaults", "differences": rows}, default=str))
        return
    print(f"# differences from {f'recipe {against}' if against else 'the defaults'}: {len(rows)} keys")
    for row in rows:
        print(f"{row['key']}: {_yaml_value(row['value'])}  # {against or 'default'}: {_yaml_value(row['base'])}")


def _yaml_value(value) -> str:
    return json.dumps(value) if isinstance(value, (bool, type(None))) or value == "" else str(value)


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
