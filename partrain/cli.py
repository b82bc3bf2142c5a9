"""The `partrain` command line (Typer). Overrides are Hydra-style positional arguments.

Exit codes: 0 success, 2 bad config or usage (one message per problem, nothing created),
1 a failure while running.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from partrain.errors import ConfigError, Problem

RECIPES_ENV = "PARTRAIN_RECIPES"
"""Colon-separated recipe folders searched after --recipes and before the shipped recipes."""

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Declarative parallel training of Hugging Face language models (DP/ZeRO, TP, PP, EP, SP).",
)
checkpoint_app = typer.Typer(help="Inspect and export distributed checkpoints.", no_args_is_help=True)

OVERRIDES = typer.Argument(
    None, help="Hydra overrides: recipe=NAME, group=option (model=llama-tiny), key=value (parallel.tp=4)."
)
RECIPES = typer.Option(
    None, "--recipes", help=f"Extra recipe folder (repeatable); searched before ${RECIPES_ENV} and the shipped recipes."
)
JSON = typer.Option(False, "--json", help="Print the report as JSON (documented keys; see README).")


def _console() -> Console:
    return Console(highlight=False)


def _recipe_dirs(cli_dirs: Optional[List[Path]], environ: dict) -> List[str]:
    given = [("--recipes", str(d)) for d in cli_dirs or []]
    given += [(RECIPES_ENV, d) for d in environ.get(RECIPES_ENV, "").split(os.pathsep) if d]
    for source, d in given:  # checked even when no recipe is named: a folder the user gives must exist
        if not Path(d).expanduser().is_dir():
            raise ConfigError(Problem(source, d, "not a folder", "pass an existing folder of recipe YAML files"))
    return [d for _, d in given]


def _fail(err: ConfigError, as_json: bool) -> None:
    from partrain.blueprint.report.layout import error_report, render_errors

    if as_json:
        print(json.dumps(error_report(err), indent=1, default=str))
    else:
        render_errors(err, Console(stderr=True, highlight=False))
    raise typer.Exit(2)


def _validated(overrides, recipes, as_json: bool):
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate

    try:
        run = compose(overrides or [], _recipe_dirs(recipes, dict(os.environ)))
        return validate(run)
    except ConfigError as err:
        _fail(err, as_json)


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
            _fail(err, as_json)
    if simulate_ranks is not None:
        report["simulation"] = _simulation(validated, simulate_ranks, as_json)
    drawable = "bubble_fraction_simulated" in report.get("pipeline", {})
    if schedule_svg is not None and drawable:
        from partrain.blueprint.report.schedule import to_svg

        try:
            to_svg(schedule_grid_of(validated), schedule_svg)
        except OSError as exc:
            from partrain.blueprint.problems import os_error_problem

            _fail(ConfigError(os_error_problem("--schedule-svg", schedule_svg, exc, "write the picture")), as_json)
        report["pipeline"]["svg"] = str(schedule_svg)
    if as_json:
        print(json.dumps(report, default=str))
    else:
        picture = None
        if drawable:
            from partrain.blueprint.report.schedule import render_text

            picture = render_text(schedule_grid_of(validated), max_slots=120)
        render_layout(report, _console(), all_ranks=all_ranks, picture=picture)
        render_estimate(report["estimate"], _console())
        if "candidates" in report:
            render_candidates(report["candidates"], _console())
        if "simulation" in report:
            from partrain.blueprint.report.estimate import render_simulation

            render_simulation(report["simulation"], _console(), all_ranks=all_ranks)
        if schedule_svg is not None and not drawable:
            _console().print(f"no schedule picture: pp=1 or more than {SCHEDULE_PICTURE_LIMIT} pipeline slots")
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
        _fail(ConfigError([_unsupported_problem(text) for text in missing]), as_json)
    from partrain.launch import launch

    try:
        code = launch(validated, console=_console(), environ=dict(os.environ))
    except ConfigError as err:
        _fail(err, as_json)
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
            _fail(
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
            _fail(
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
        _fail(err, as_json)


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
        run = compose(overrides or [], _recipe_dirs(recipes, dict(os.environ)))
    except ConfigError as err:
        _fail(err, as_json)
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
        _console().print(table)
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
        found = list_recipes(_recipe_dirs(recipes, dict(os.environ)))
    except ConfigError as err:
        _fail(err, as_json)
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
    _console().print(table)


@checkpoint_app.command("info")
def checkpoint_info_cmd(
    path: Path = typer.Argument(..., help="A checkpoint folder (RUN_DIR/checkpoints/step-NNNNNNNN)."),
    as_json: bool = JSON,
) -> None:
    """Show a checkpoint's step, layout it was saved under, model, size and tensor count."""
    from partrain.checkpoint import checkpoint_info

    try:
        info = checkpoint_info(path)
    except ConfigError as err:
        _fail(err, as_json)
    if as_json:
        print(json.dumps(info, default=str))
        return
    from rich.table import Table

    table = Table(title=f"checkpoint {path}", show_header=False, title_justify="left")
    for key in ("step", "time", "world_size", "layout", "model", "size_bytes", "n_tensors", "n_parameters", "version"):
        if key in info:
            value = info[key]
            if key == "model" and isinstance(value, dict):
                value = f"{value.get('arch')} {value.get('name', '')}".strip()
            table.add_row(key, str(value))
    table.add_row("checksums", "SHA-256 of every file" if info.get("checksums") else "none (sizes only)")
    _console().print(table)


@checkpoint_app.command("export")
def checkpoint_export_cmd(
    path: Path = typer.Argument(..., help="A checkpoint folder."),
    hf: Path = typer.Option(..., "--hf", help="Output folder for an HF save_pretrained model."),
    tokenizer: Optional[Path] = typer.Option(
        None, "--tokenizer", help="Local HF tokenizer folder to copy (default: the run's, if any)."
    ),
    as_json: bool = JSON,
) -> None:
    """Write an HF `save_pretrained` folder (safetensors + config [+ tokenizer]) from a checkpoint, in one process."""
    from partrain.blueprint.problems import storage_error_words
    from partrain.checkpoint import export_hf
    from partrain.preflight import folder_problems

    try:
        if problems := folder_problems("--hf", hf):
            raise ConfigError(problems)
        out = export_hf(path, hf, str(tokenizer) if tokenizer else None)
    except ConfigError as err:
        _fail(err, as_json)
    except Exception as exc:  # the disk filling up while writing (safetensors wraps it): one line, no traceback
        if storage_error_words(exc) is None:
            raise
        Console(stderr=True, highlight=False).print(f"export to {hf} failed: {storage_error_words(exc)}", markup=False)
        raise typer.Exit(1)
    if as_json:
        print(json.dumps({"exported": str(out)}))
    else:
        _console().print(f"exported to [cyan]{out}[/cyan] (AutoModelForCausalLM.from_pretrained loads it offline)")


@checkpoint_app.command("verify")
def checkpoint_verify_cmd(
    path: Path = typer.Argument(..., help="A checkpoint folder, or a folder of them (RUN_DIR/checkpoints)."),
    as_json: bool = JSON,
) -> None:
    """Check each file's size and SHA-256 and DCP's index: one line per problem; exit 0 intact, 1 damaged."""
    from partrain.checkpoint.verify import report_json, report_lines, verify_path

    try:
        verdicts = verify_path(path)
    except ConfigError as err:
        _fail(err, as_json)
    print(json.dumps(report_json(path, verdicts)) if as_json else "\n".join(report_lines(verdicts)))
    raise typer.Exit(0 if all(v.ok for v in verdicts) else 1)


app.add_typer(checkpoint_app, name="checkpoint")

bench_app = typer.Typer(help="Measure the cluster for the planner.", no_args_is_help=True)


@bench_app.command("comm")
def bench_comm_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    sizes: Optional[str] = typer.Option(
        None,
        "--sizes",
        help="Message sizes in bytes, comma-separated; K, M, G = 2**10, 2**20, 2**30 "
        "(default 1K,64K,1M,16M on CPU, plus 256M on CUDA). The planner uses the largest.",
    ),
    iters: int = typer.Option(20, "--iters", help="Timed calls per op and size."),
    warmup: int = typer.Option(5, "--warmup", help="Untimed calls before timing."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Profile file to write (default runs/bench-comm/<cluster>-<time>.json)."
    ),
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
) -> None:
    """Measure all-reduce, all-gather, reduce-scatter, all-to-all and send/recv bandwidth over the cluster's process
    groups (nccl-tests' algbw/busbw by size) and save a profile for `cluster.comm_profile`."""
    from partrain.bench.comm_parent import (
        bench_problems,
        bench_settings,
        render_profile,
    )
    from partrain.bench.comm_parent import launch as bench_launch
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.runtime.context import cpu_count, from_environ

    try:  # composed as plan/train do; only problems of the cluster (and timeouts) stop a measurement
        run = compose(overrides or [], _recipe_dirs(recipes, dict(os.environ)))
        try:
            validate(run)
        except ConfigError as err:
            if bench_problems(err.problems):
                raise ConfigError(bench_problems(err.problems)) from None
        dist_env = from_environ(dict(os.environ))
        settings = bench_settings(run, sizes, iters, warmup, out, dist_env)
    except ConfigError as err:
        _fail(err, as_json)
    if dist_env is not None:  # under torchrun / srun (multi-node): this process is a worker
        from partrain.bench.comm import run as bench_run
        from partrain.runtime.lifecycle import leave

        code, profile = bench_run(settings, dist_env, show_progress=False)
        if code == 0 and dist_env.is_main:
            if as_json:
                print(json.dumps({"path": settings.out, **profile}))
            else:
                render_profile(profile, Path(settings.out), _console())
        leave(code)  # gloo may abort at a normal interpreter exit
    threads = run.train.threads_per_process or max(1, cpu_count() // settings.devices_per_node)
    code, cause, tail = bench_launch(settings, Console(stderr=True, highlight=False), dict(os.environ), threads)
    if code != 0:
        err = Console(stderr=True, highlight=False)
        err.print(tail, markup=False)
        err.print(f"[bold red]bench comm failed[/bold red] (torchrun exit code {code}): ", end="")
        err.print(cause or "see the output above", markup=False)
        raise typer.Exit(1)
    profile = json.loads(Path(settings.out).read_text())
    if as_json:
        print(json.dumps({"path": settings.out, **profile}))
    else:
        render_profile(profile, Path(settings.out), _console())


app.add_typer(bench_app, name="bench")


def main(argv: Optional[List[str]] = None) -> None:
    """Console-script entry point."""
    try:
        app(args=argv, prog_name="partrain", standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
