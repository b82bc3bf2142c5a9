"""What `partrain train --dry-run` and `partrain plan` share: compose and resolve a run, the launch's
preflight as a dry run, and the layout report (tables, estimate, candidates, simulation, picture)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from partrain.cli.common import compose_run, fail, stdout_console
from partrain.errors import ConfigError, Problem


def resolved(overrides, recipes, as_json: bool, fetch_data: bool = True):
    """(ValidatedRun, record of the `parallel=auto` choice or None). With parallel=auto the layout the
    recipe states is only a starting point: the planner chooses (partrain.blueprint.planner.auto).
    fetch_data=False: a Hub dataset is not downloaded (dry run, plan; see compose_run)."""
    from partrain.blueprint.planner.auto import resolve_layout

    try:
        return resolve_layout(compose_run(overrides, recipes, fetch_data), overrides or [])
    except ConfigError as err:
        fail(err, as_json)


PLAN_READS_NO_FILES = {
    "check": "files",
    "why": "plan reads no data, tokenizer, weights or checkpoint; plan --check and train --dry-run do",
}
"""The "unchecked" entry of a `plan` without --check: it plans runs for clusters it is not on."""


def preflight(validated, as_json: bool, facts: Optional[dict] = None) -> List[dict]:
    """The launch's own preflight (partrain.preflight.check_before_launch) as a dry run: exit 2 with
    one message per problem, else what could not be checked offline (the report's "unchecked").
    facts: filled with what the preflight found for the report (its "fine_tuning" data facts)."""
    from partrain.preflight import check_before_launch

    try:
        return [item.to_json() for item in check_before_launch(validated, dry_run=True, facts=facts)]
    except ConfigError as err:
        fail(err, as_json)


CHECK = typer.Option(
    False, "--check", help="Exit 3 when the layout does not fit or this version cannot train it (for CI)."
)


SCHEDULE_SVG = typer.Option(None, "--schedule-svg", help="Also write the pipeline schedule picture to this SVG file.")


def _add_epochs(report: dict, validated, data_facts: Optional[dict]) -> None:
    """train.epochs counted in steps by the preflight: the report's `epochs`, and its `saves` at that length."""
    if not (data_facts and data_facts.get("epochs")):
        return
    from partrain.blueprint.config.saving import saving_plan
    from partrain.blueprint.epochs import with_epochs_as_steps

    report["epochs"] = data_facts["epochs"]
    report["saves"] = saving_plan(with_epochs_as_steps(validated, data_facts["epochs"]["steps_per_epoch"]).run)


def print_layout(
    validated,
    as_json: bool,
    all_ranks: bool,
    schedule_svg: Optional[Path] = None,
    search_top: int = 0,
    simulate_ranks: Optional[List[int]] = None,
    mixed: str = "autocast",
    include_unsupported: bool = False,
    auto_choice: Optional[dict] = None,
    unchecked: Optional[List[dict]] = None,
    data_facts: Optional[dict] = None,
) -> dict:
    from partrain.blueprint.planner import estimate, search
    from partrain.blueprint.report.estimate import (
        conclude,
        render_candidates,
        render_estimate,
    )
    from partrain.blueprint.report.layout import (
        SCHEDULE_PICTURE_LIMIT,
        layout_report,
        render_layout,
        schedule_grid_of,
    )

    report = layout_report(validated)
    report["estimate"] = estimate(validated, mixed=mixed)
    report["unchecked"] = list(unchecked or [])
    if data_facts and data_facts.get("fine_tuning"):  # what the preflight measured of fine-tuning rows
        from partrain.blueprint.report.fine_tuning import fine_tuning_section

        report["fine_tuning"] = fine_tuning_section(validated, data_facts["fine_tuning"])
    _add_epochs(report, validated, data_facts)
    conclude(report)
    if auto_choice is not None:
        report["auto"] = auto_choice
    if search_top:
        try:
            report["candidates"] = worded(
                search(validated, top_k=search_top, mixed=mixed, runnable_only=not include_unsupported)
            )
        except ConfigError as err:
            fail(err, as_json)
    if simulate_ranks is not None:
        report["simulation"] = simulation(validated, simulate_ranks, as_json)
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
        print_choice(auto_choice, stdout_console())
        picture = None
        if drawable:
            from partrain.blueprint.report.schedule import render_text

            picture = render_text(schedule_grid_of(validated), max_slots=120, line_width=stdout_console().width)
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


def worded(candidates: List[dict]) -> List[dict]:
    """The search's candidates with each estimate's notes in words beside its "note_data", as the
    report's own estimate has them (`conclude`): the JSON keeps both. Returns the same list."""
    from partrain.blueprint.report.notes import word_notes

    for candidate in candidates:
        word_notes(candidate["estimate"])
    return candidates


def print_choice(choice: Optional[dict], console) -> None:
    """The `parallel=auto` choice, before the layout report or the launch."""
    if choice is None:
        return
    from partrain.blueprint.planner.auto import choice_lines

    for line in choice_lines(choice):  # wrapped at the console's width, as the report below it
        console.print(line, markup=False, highlight=False)


def simulation(validated, ranks: List[int], as_json: bool) -> dict:
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


def exit_for_check(report: dict, check: bool) -> None:
    from partrain.blueprint.report.estimate import STATUS_EXIT_CODES

    if check and STATUS_EXIT_CODES[report["status"]]:
        raise typer.Exit(STATUS_EXIT_CODES[report["status"]])
