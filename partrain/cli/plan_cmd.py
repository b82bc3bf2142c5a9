"""`partrain plan`: a layout's report without training (and `--search` over every layout)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from partrain.cli.common import JSON, OVERRIDES, RECIPES, compose_run, fail, stdout_console
from partrain.cli.layout_view import (
    CHECK,
    PLAN_READS_NO_FILES,
    SCHEDULE_SVG,
    exit_for_check,
    preflight,
    print_layout,
    resolved,
    worded,
)
from partrain.errors import ConfigError, Problem

ACCOUNTING_STYLES = {"runtime": "autocast", "paper": "zero"}
"""`--accounting`: what partrain's runtime allocates (default), or the ZeRO paper's 16-bit 2+2+12 bytes."""

ACCOUNTING = typer.Option(
    "runtime",
    "--accounting",
    help="Memory accounting: runtime (what partrain train allocates: fp32 weights under autocast, its buffers) "
    "or paper (ZeRO's 16-bit 2+2+12 bytes per parameter, to reproduce published tables).",
)


def _mixed_style(accounting: str, as_json: bool) -> str:
    if accounting not in ACCOUNTING_STYLES:
        fail(
            ConfigError(Problem("--accounting", accounting, "must be runtime or paper", "pass --accounting runtime")),
            as_json,
        )
    return ACCOUNTING_STYLES[accounting]


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
    include_unsupported: bool = typer.Option(
        False, "--include-unsupported", help="--search also ranks layouts this version of partrain cannot train yet."
    ),
    explain_rank: Optional[int] = typer.Option(
        None,
        "--explain",
        min=1,
        help="With --search: also print candidate N's full report, as plan with its overrides would (with "
        "--json only that report).",
    ),
    accounting: str = ACCOUNTING,
    check: bool = CHECK,
) -> None:
    """Validate a layout and show its report: rank table, groups, schedule, per-rank memory, FLOPs,
    communication, bubble, predicted step time, tokens/s, MFU and whether it fits.

    With --search the starting degrees, ZeRO stage, recompute and micro batch need not be valid: the
    search keeps only the model, cluster, sequence length, sp and global batch."""
    mixed = _mixed_style(accounting, as_json)
    simulate_ranks = list(simulate_rank or []) if (simulate or simulate_rank) else None
    if search_layouts:
        explain = (explain_rank, all_ranks, schedule_svg)
        _search_cmd(overrides, recipes, top, mixed, include_unsupported, as_json, explain)
        return
    if explain_rank is not None:
        fail(ConfigError(Problem("--explain", explain_rank, "only goes with --search", "add --search")), as_json)
    validated, choice = resolved(overrides, recipes, as_json, fetch_data=False)
    # --check: the launch's preflight, as train --dry-run runs it; without: a plan reads no files.
    facts: dict = {}
    unchecked = preflight(validated, as_json, facts) if check else [PLAN_READS_NO_FILES]
    report = print_layout(
        validated,
        as_json,
        all_ranks,
        schedule_svg,
        simulate_ranks=simulate_ranks,
        mixed=mixed,
        include_unsupported=include_unsupported,
        auto_choice=choice,
        unchecked=unchecked,
        data_facts=facts,
    )
    exit_for_check(report, check)


def _search_cmd(overrides, recipes, top: int, mixed: str, include_unsupported: bool, as_json: bool, explain) -> None:
    """`plan --search`: the candidates table first, one line about the starting layout (whose degrees,
    micro batch, ZeRO stage and recompute the search never reads), then with --explain N candidate
    N's full report. `explain` is (N or None, all_ranks, schedule_svg)."""
    from partrain.blueprint.planner import search
    from partrain.blueprint.planner.search import auto_memory_fraction
    from partrain.blueprint.report.estimate import render_candidates
    from partrain.blueprint.validate import validate

    rank, all_ranks, schedule_svg = explain
    try:
        run = compose_run(overrides, recipes, False)
        try:
            start, ignored = validate(run), []
        except ConfigError as err:
            start, ignored = None, err.problems
        candidates = worded(search(start or run, top_k=top, mixed=mixed, runnable_only=not include_unsupported))
    except ConfigError as err:
        fail(err, as_json)
    if rank is not None and not 1 <= rank <= len(candidates):
        why = f"must be the rank of a listed candidate (1 to {len(candidates)})"
        fail(ConfigError(Problem("--explain", rank, why, "pass a listed rank, or raise --top")), as_json)
    if as_json and rank is None:
        out = {
            "valid": start is not None,
            "starting_layout_problems": [p.to_json() for p in ignored],
            "auto_memory_fraction": auto_memory_fraction(run.parallel.auto_memory_margin),
            "candidates": candidates,
        }
        print(json.dumps(out, default=str))
    elif not as_json:
        console = stdout_console()
        render_candidates(candidates, console)
        if start is None:
            keys = ", ".join(dict.fromkeys(p.key for p in ignored))
            console.print(f"the starting layout is not valid ({keys}): the search does not read it", markup=False)
        else:
            console.print("the starting layout is valid; the search does not read it", markup=False)
    if not candidates:
        raise typer.Exit(2)
    if rank is not None:
        try:
            validated = validate(compose_run([*(overrides or []), *candidates[rank - 1]["overrides"]], recipes, False))
        except ConfigError as err:
            fail(err, as_json)
        if not as_json:
            stdout_console().print(f"\n#{rank} in full:", markup=False)
        print_layout(validated, as_json, all_ranks, schedule_svg, mixed=mixed, unchecked=[PLAN_READS_NO_FILES])
