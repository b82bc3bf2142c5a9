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
from partrain.cli.common import JSON, OVERRIDES, RECIPES, compose_run, fail, stdout_console
from partrain.cli.config_cmds import list_recipes_cmd, show
from partrain.cli.data_cmds import data_app
from partrain.cli.launch_cmds import launch_app
from partrain.errors import ConfigError, Problem

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Declarative parallel training of Hugging Face language models (DP/ZeRO, TP, PP, EP, SP).",
)


def _print_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    from partrain import __version__

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    # Read from the installed metadata: importing torch would take seconds.
    print(f"partrain {__version__} (torch {of('torch')}, transformers {of('transformers')})")
    raise typer.Exit(0)


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
) -> None:
    """Declarative parallel training of Hugging Face language models (DP/ZeRO, TP, PP, EP, SP)."""


def _validated(overrides, recipes, as_json: bool):
    return _resolved(overrides, recipes, as_json)[0]


def _resolved(overrides, recipes, as_json: bool, fetch_data: bool = True):
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


def _preflight(validated, as_json: bool) -> List[dict]:
    """The launch's own preflight (partrain.preflight.check_before_launch) as a dry run: exit 2 with
    one message per problem, else what could not be checked offline (the report's "unchecked")."""
    from partrain.preflight import check_before_launch

    try:
        return [item.to_json() for item in check_before_launch(validated, dry_run=True)]
    except ConfigError as err:
        fail(err, as_json)


ACCOUNTING_STYLES = {"runtime": "autocast", "paper": "zero"}
"""`--accounting`: what partrain's runtime allocates (default), or the ZeRO paper's 16-bit 2+2+12 bytes."""

ACCOUNTING = typer.Option(
    "runtime",
    "--accounting",
    help="Memory accounting: runtime (what partrain train allocates: fp32 weights under autocast, its buffers) "
    "or paper (ZeRO's 16-bit 2+2+12 bytes per parameter, to reproduce published tables).",
)
CHECK = typer.Option(
    False, "--check", help="Exit 3 when the layout does not fit or this version cannot train it (for CI)."
)


def _mixed_style(accounting: str, as_json: bool) -> str:
    if accounting not in ACCOUNTING_STYLES:
        fail(
            ConfigError(Problem("--accounting", accounting, "must be runtime or paper", "pass --accounting runtime")),
            as_json,
        )
    return ACCOUNTING_STYLES[accounting]


SCHEDULE_SVG = typer.Option(None, "--schedule-svg", help="Also write the pipeline schedule picture to this SVG file.")


def _print_layout(
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
    conclude(report)
    if auto_choice is not None:
        report["auto"] = auto_choice
    if search_top:
        try:
            report["candidates"] = search(
                validated, top_k=search_top, mixed=mixed, runnable_only=not include_unsupported
            )
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
        _print_choice(auto_choice, stdout_console())
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
    validated, choice = _resolved(overrides, recipes, as_json, fetch_data=not dry_run)
    if dry_run:
        unchecked = _preflight(validated, as_json)  # the launch's checks, before any verdict is printed
        report = _print_layout(validated, as_json, all_ranks, schedule_svg, auto_choice=choice, unchecked=unchecked)
        _exit_for_check(report, check)
        return
    from partrain.blueprint.trainable import unsupported_features

    missing = unsupported_features(validated)
    if missing:
        fail(ConfigError([_unsupported_problem(text) for text in missing]), as_json)
    from partrain.train.display import Display

    # Decided once, here: a live display on a terminal, plain lines into a file or pipe, and with
    # --json nothing but the summary object on stdout (human text on stderr).
    display = Display.choose(as_json, sys.stdout.isatty())
    _print_choice(choice, display.console)
    _warn_if_predicted_not_to_fit(validated, display.console)
    from partrain.launch import launch

    try:
        code = launch(validated, console=display.console, environ=dict(os.environ), display=display, auto_choice=choice)
    except ConfigError as err:
        fail(err, as_json)
    raise typer.Exit(code)


def _print_choice(choice: Optional[dict], console) -> None:
    """The `parallel=auto` choice, before the layout report or the launch."""
    if choice is None:
        return
    from partrain.blueprint.planner.auto import choice_lines

    for line in choice_lines(choice):  # wrapped at the console's width, as the report below it
        console.print(line, markup=False, highlight=False)


def _warn_if_predicted_not_to_fit(validated, console) -> None:
    """The planner's verdict before a launch: a warning, not a refusal (a measured run decides)."""
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
    validated, choice = _resolved(overrides, recipes, as_json, fetch_data=False)
    # --check: the launch's preflight, as train --dry-run runs it; without: a plan reads no files.
    unchecked = _preflight(validated, as_json) if check else [PLAN_READS_NO_FILES]
    report = _print_layout(
        validated,
        as_json,
        all_ranks,
        schedule_svg,
        simulate_ranks=simulate_ranks,
        mixed=mixed,
        include_unsupported=include_unsupported,
        auto_choice=choice,
        unchecked=unchecked,
    )
    _exit_for_check(report, check)


def _exit_for_check(report: dict, check: bool) -> None:
    from partrain.blueprint.report.estimate import STATUS_EXIT_CODES

    if check and STATUS_EXIT_CODES[report["status"]]:
        raise typer.Exit(STATUS_EXIT_CODES[report["status"]])


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
        candidates = search(start or run, top_k=top, mixed=mixed, runnable_only=not include_unsupported)
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
        _print_layout(validated, as_json, all_ranks, schedule_svg, mixed=mixed, unchecked=[PLAN_READS_NO_FILES])


app.command()(show)
app.command("recipes")(list_recipes_cmd)


app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(bench_app, name="bench")
app.add_typer(launch_app, name="launch")
app.add_typer(data_app, name="data")


def command():
    """The click command of `app`, boolean flags shown without a type (typer writes `<bool>` beside
    flags that take no value, which reads as if they did)."""
    from typer import _click
    from typer.main import get_command

    root = get_command(app)

    def plain_flags(cmd) -> None:
        for param in cmd.get_params(_click.Context(cmd, info_name=cmd.name)):
            if getattr(param, "is_bool_flag", False):
                param.metavar = ""
        for sub in getattr(cmd, "commands", {}).values():
            plain_flags(sub)

    plain_flags(root)
    return root


def main(argv: Optional[List[str]] = None) -> None:
    """Console-script entry point."""
    try:
        command().main(args=argv, prog_name="partrain", standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
