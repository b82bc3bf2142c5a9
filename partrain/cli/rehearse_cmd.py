"""`partrain rehearse`: train the user's layout and one process for a few steps on CPU and compare them.

Exit 0 when every step's loss and gradient norm match within the tolerance, 1 when one does not (or a run
fails), 2 for a configuration that cannot run (before any process starts).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from partrain.cli.common import JSON, OVERRIDES, RECIPES, fail, recipe_dirs
from partrain.cli.layout_view import resolved
from partrain.errors import ConfigError, Problem


def rehearse(
    overrides: Optional[List[str]] = OVERRIDES,
    steps: int = typer.Option(4, "--steps", help="Steps each run trains (at least 1)."),
    out: Optional[Path] = typer.Option(
        None,
        "--out",
        help="Folder for the runs, report.json and reproduce/ (the shrunk model's initial weights as a Hugging Face "
        "folder, every step's batches, a plain-transformers script); default: a new temporary folder, kept.",
    ),
    max_processes: int = typer.Option(
        16, "--max-processes", help="Most CPU processes the layout run starts; a larger world is reduced axis by axis."
    ),
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
) -> None:
    """Prove the layout on CPU: your config, shrunk, under its layout and in one process, step by step."""
    from partrain.blueprint.rehearsal import plan_rehearsal

    if steps < 1:
        fail(ConfigError(Problem("--steps", steps, "a rehearsal trains at least one step", "pass --steps 4")), as_json)
    if max_processes < 1:
        fail(
            ConfigError(Problem("--max-processes", max_processes, "must be at least 1", "pass --max-processes 16")),
            as_json,
        )
    validated, _ = resolved(overrides, recipes, as_json)
    dirs = recipe_dirs(recipes, dict(os.environ))
    try:
        plan = plan_rehearsal(validated, list(overrides or []), steps, max_processes)
        _check_runs(plan, dirs)
    except ConfigError as err:
        fail(err, as_json)
    root = _out_folder(out, as_json)
    console = Console(stderr=as_json, highlight=False)
    _print_plan(plan, root, console)
    from partrain.rehearse.run import run_rehearsal

    try:
        with console.status("starting ...") as progress:
            verdict = run_rehearsal(plan, root, dirs, on_phase=lambda text: progress.update(f"{text} ..."))
    except ConfigError as err:
        fail(err, as_json)
    except KeyboardInterrupt:  # Ctrl-C reached every process of the terminal's group: the runs are gone
        Console(stderr=True, highlight=False).print(
            f"rehearsal interrupted: no verdict and nothing recorded; the unfinished runs are in {root}",
            soft_wrap=True,  # the folder's path unbroken, to copy
        )
        raise typer.Exit(130)
    report = {"plan": plan.to_json(), "verdict": verdict.to_json()}
    (root / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    _record(validated, verdict.passed, root / "report.json")
    if as_json:
        print(json.dumps(report, indent=1, default=str))
    else:
        _print_verdict(verdict, root, console)
    raise typer.Exit(0 if verdict.passed else 1)


def _check_runs(plan, dirs: List[str]) -> None:
    """Both runs compose, validate and can train (ConfigError otherwise), before any process starts."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.trainable import unsupported_features
    from partrain.blueprint.validate import validate

    for overrides in (plan.layout_overrides, (*plan.layout_overrides, *plan.reference_overrides)):
        v = validate(compose(list(overrides), dirs))
        missing = unsupported_features(v)
        if missing:
            raise ConfigError([Problem("parallel", "layout", text, "see docs/families.md") for text in missing])


def _out_folder(out: Optional[Path], as_json: bool) -> Path:
    if out is None:
        return Path(tempfile.mkdtemp(prefix="partrain-rehearsal-"))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(ConfigError(Problem("--out", str(out), "exists and is not an empty folder", "name a new folder")), as_json)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _print_plan(plan, root: Path, console: Console) -> None:
    from partrain.blueprint.rehearsal import summary_lines

    console.print(f"[bold]rehearsal[/bold] in {root}")
    for line in summary_lines(plan):
        console.print(f"  {line}")
    for line in plan.not_rehearsed:
        console.print(f"  not rehearsed: {line}")


def _print_verdict(verdict, root: Path, console: Console) -> None:
    table = Table(title="layout against one process", title_justify="left")
    for name in (
        "step",
        "loss, 1 process",
        "loss, layout",
        "diff",
        "grad norm, 1 process",
        "grad norm, layout",
        "diff",
    ):
        table.add_column(name, justify="right")
    for r in verdict.rows:
        table.add_row(
            str(r.step),
            f"{r.loss_reference:.6f}",
            f"{r.loss_layout:.6f}",
            f"{r.loss_difference:.1e}",
            f"{r.grad_norm_reference:.6f}",
            f"{r.grad_norm_layout:.6f}",
            f"{r.grad_norm_difference:.1e}",
        )
    if verdict.rows:
        console.print(table)
    for r in verdict.resumed:
        where = "under the layout" if r["run"] == "layout" else "in one process"
        console.print(
            f"the {r['from']} checkpoint resumed {where}: loss within {r['loss_rel_diff']:.1e}, gradient norm "
            f"within {r['grad_norm_rel_diff']:.1e} of the uninterrupted {r['run']} run"
        )
    if verdict.reproduced:
        r = verdict.reproduced
        console.print(
            f"plain transformers from {r['folder']} (initial weights, batches, plain_step.py): step 1 loss "
            f"{r['plain_transformers_loss']:.6f}, within {r['rel_diff']:.1e} of the reference's"
        )
    if verdict.failed_run:
        console.print(f"[red]rehearsal failed[/red]: {verdict.failed_run}")
    elif verdict.mismatch:
        console.print(f"[red]the layout does not match one process[/red]: {verdict.mismatch}")
    else:
        resumed = ", and so do the resumed runs" if verdict.resumed else ""
        console.print(
            f"[green]the layout matches one process[/green]: every step's loss within {verdict.loss_rtol:.0e} and "
            f"gradient norm within {verdict.grad_norm_rtol:.0e}{resumed} (report: {root / 'report.json'})"
        )


def records_folder(environ: dict) -> Path:
    """Where rehearsals record their verdicts for the dry run: $XDG_CACHE_HOME/partrain/rehearsals, else
    ~/.cache/partrain/rehearsals."""
    cache = environ.get("XDG_CACHE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".cache")
    return Path(cache) / "partrain" / "rehearsals"


def _record(validated, passed: bool, report: Path) -> None:
    from datetime import datetime, timezone

    from partrain.blueprint.rehearsal import rehearsal_key

    folder = records_folder(dict(os.environ))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        record = {
            "passed": passed,
            "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "report": str(report),
        }
        (folder / f"{rehearsal_key(validated)}.json").write_text(json.dumps(record) + "\n")
    except OSError:  # a read-only home: the verdict is printed and in report.json all the same
        pass


def dry_run_hint(validated, overrides: List[str], environ: dict) -> str:
    """What the dry run says about rehearsing this configuration: the last rehearsal's verdict, or how."""
    import shlex

    from partrain.blueprint.rehearsal import rehearsal_key

    found = records_folder(environ) / f"{rehearsal_key(validated)}.json"
    command = "partrain rehearse " + " ".join(shlex.quote(o) for o in overrides)
    if found.is_file():
        try:
            record = json.loads(found.read_text())
            verdict = "matched one process" if record["passed"] else "did NOT match one process"
            return f"rehearsal: this configuration's layout {verdict} on CPU ({record['when']}; {record['report']})"
        except (OSError, ValueError, KeyError):
            pass
    return (
        f"rehearsal: this layout has not been rehearsed on this configuration; `{command.strip()}` trains it "
        "shrunk on this machine's CPU against one process (docs/rehearse.md)"
    )
