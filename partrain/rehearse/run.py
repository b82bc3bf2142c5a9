"""Run a rehearsal (partrain.blueprint.rehearsal's plan) and judge it: the layout and the one-process
reference trained for real, then compared step by step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from partrain.blueprint.rehearsal import RehearsalPlan
from partrain.rehearse.parity import RunRecord


@dataclass(frozen=True)
class StepRow:
    """One step of both runs."""

    step: int
    loss_reference: float
    loss_layout: float
    grad_norm_reference: float
    grad_norm_layout: float

    @property
    def loss_difference(self) -> float:
        return _relative(self.loss_reference, self.loss_layout)

    @property
    def grad_norm_difference(self) -> float:
        return _relative(self.grad_norm_reference, self.grad_norm_layout)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "loss": {"reference": self.loss_reference, "layout": self.loss_layout, "rel_diff": self.loss_difference},
            "grad_norm": {
                "reference": self.grad_norm_reference,
                "layout": self.grad_norm_layout,
                "rel_diff": self.grad_norm_difference,
            },
        }


def _relative(expected: float, actual: float) -> float:
    if not (math.isfinite(expected) and math.isfinite(actual)):
        return 0.0 if expected == actual or (math.isnan(expected) and math.isnan(actual)) else math.inf
    return abs(actual - expected) / max(abs(expected), 1e-12)


@dataclass
class Verdict:
    """The comparison: every step's row, the first difference beyond the tolerance (or None)."""

    rows: List[StepRow]
    loss_rtol: float
    grad_norm_rtol: float
    mismatch: Optional[str] = None
    """The first step and quantity that differ beyond their tolerance, in words; None when all match."""
    failed_run: Optional[str] = None
    """A run that did not train (the layout or the reference), with where its logs are."""
    resumed: List[dict] = field(default_factory=list)
    """The layout's checkpoint resumed under the layout ("layout") and in one process ("reference"): the
    largest relative differences of the resumed steps' losses and gradient norms against the same steps of
    the uninterrupted run of that layout."""
    run_dirs: dict = field(default_factory=dict)
    reproduced: Optional[dict] = None
    """Step 1 recomputed with plain transformers from ROOT/reproduce (partrain.rehearse.reproduce): its
    loss, the reference's, their relative difference and the folder; None when the reference did not train."""

    @property
    def passed(self) -> bool:
        return self.mismatch is None and self.failed_run is None

    def to_json(self) -> dict:
        return {
            "passed": self.passed,
            "loss_rtol": self.loss_rtol,
            "grad_norm_rtol": self.grad_norm_rtol,
            "mismatch": self.mismatch,
            "failed_run": self.failed_run,
            "steps": [r.to_json() for r in self.rows],
            "resumed": self.resumed,
            "run_dirs": {k: str(v) for k, v in self.run_dirs.items()},
            "reproduced": self.reproduced,
        }


def compare(reference: RunRecord, layout: RunRecord, loss_rtol: float, grad_norm_rtol: float) -> Verdict:
    rows = [
        StepRow(i + 1, lr, ll, gr, gl)
        for i, (lr, ll, gr, gl) in enumerate(
            zip(reference.losses, layout.losses, reference.grad_norms, layout.grad_norms)
        )
    ]
    dirs = {"reference": reference.run_dir, "layout": layout.run_dir}
    verdict = Verdict(rows, loss_rtol, grad_norm_rtol, run_dirs=dirs)
    if len(reference.losses) != len(layout.losses):
        verdict.mismatch = f"the layout ran {len(layout.losses)} steps, the reference {len(reference.losses)}"
        return verdict
    for row in rows:
        for name, diff, ref, got, rtol in (
            ("loss", row.loss_difference, row.loss_reference, row.loss_layout, loss_rtol),
            ("gradient norm", row.grad_norm_difference, row.grad_norm_reference, row.grad_norm_layout, grad_norm_rtol),
        ):
            if diff > rtol:
                verdict.mismatch = (
                    f"step {row.step}: the {name} is {got:.7g} under the layout and {ref:.7g} in one process, "
                    f"a relative difference of {diff:.2e} > {rtol:.0e}"
                )
                return verdict
    return verdict


LAYOUT, REFERENCE = "layout", "reference"


def run_rehearsal(
    plan: RehearsalPlan,
    root: Path,
    recipe_dirs: Sequence[str] = (),
    timeout_s: float = 900,
    quiet: bool = True,
    on_phase: Callable[[str], None] = lambda text: None,
) -> Verdict:
    """Train the plan's layout and reference under root/layout and root/reference, write root/reproduce and
    check it with plain transformers, then (resume_step > 0) resume the layout's checkpoint at resume_step
    under the layout and in one process (root/<name>-resumed); their verdict. on_phase: told what starts
    (the CLI's progress line). Raises ConfigError for a run the CLI would refuse (exit 2)."""

    cases = {
        LAYOUT: list(plan.layout_overrides),
        REFERENCE: [*plan.layout_overrides, *plan.reference_overrides],
    }
    on_phase(f"training the layout ({plan.world} processes) and the reference (1 process), {plan.steps} steps each")
    runs = _train(cases, root, recipe_dirs, timeout_s, quiet)
    if isinstance(runs, Verdict):
        runs.loss_rtol, runs.grad_norm_rtol = plan.loss_rtol, plan.grad_norm_rtol
        return runs
    verdict = compare(runs[REFERENCE], runs[LAYOUT], plan.loss_rtol, plan.grad_norm_rtol)
    on_phase("writing reproduce/ and recomputing step 1 with plain transformers")
    _reproduce(verdict, runs[REFERENCE], root, plan)
    if not plan.resume_step or not verdict.passed:
        return verdict
    # The layout's checkpoint, resumed under the layout and in one process: both must continue as the
    # uninterrupted runs did (the one-process resume reshards every tensor and its optimizer state).
    checkpoint = runs[LAYOUT].run_dir / f"checkpoints/step-{plan.resume_step:08d}"
    resumed_cases = {
        f"{name}-resumed": [*overrides, f"checkpoint.resume={checkpoint}", "checkpoint.every_steps=0"]
        for name, overrides in cases.items()
    }
    on_phase(f"resuming the layout's step-{plan.resume_step} checkpoint under the layout and in one process")
    resumed = _train(resumed_cases, root, recipe_dirs, timeout_s, quiet)
    if isinstance(resumed, Verdict):
        verdict.failed_run = resumed.failed_run
        return verdict
    after = slice(plan.resume_step, None)
    for name in cases:
        straight, again = runs[name], resumed[f"{name}-resumed"]
        loss = max([_relative(e, a) for e, a in zip(straight.losses[after], again.losses)] + [0.0])
        grad = max([_relative(e, a) for e, a in zip(straight.grad_norms[after], again.grad_norms)] + [0.0])
        verdict.resumed.append(
            {"run": name, "from": f"layout step {plan.resume_step}", "loss_rel_diff": loss, "grad_norm_rel_diff": grad}
        )
        where = "under the layout" if name == LAYOUT else "in one process"
        if len(again.losses) != len(straight.losses[after]):
            problem = f"trained {len(again.losses)} steps, not {len(straight.losses[after])}"
        elif loss > plan.loss_rtol:
            problem = f"differs in loss from the uninterrupted {name} run by {loss:.2e} > {plan.loss_rtol:.0e}"
        elif grad > plan.grad_norm_rtol:
            problem = (
                f"differs in gradient norm from the uninterrupted {name} run by {grad:.2e} > {plan.grad_norm_rtol:.0e}"
            )
        else:
            continue
        if verdict.mismatch is None:
            verdict.mismatch = f"the layout's step-{plan.resume_step} checkpoint resumed {where} {problem}"
    return verdict


def _reproduce(verdict: Verdict, reference: RunRecord, root: Path, plan: RehearsalPlan) -> None:
    """Write ROOT/reproduce and check that plain transformers gives the reference's first loss from it: the
    folder then reproduces the reference, and partrain's model computes what transformers' does."""
    from partrain.rehearse.plain_step import plain_loss
    from partrain.rehearse.reproduce import no_progress_bars, write_reproduction

    folder = write_reproduction(reference.run_dir, root, plan.steps)
    with no_progress_bars():
        loss = plain_loss(folder, 1)
    difference = _relative(reference.losses[0], loss)
    verdict.reproduced = {
        "folder": str(folder),
        "plain_transformers_loss": loss,
        "reference_loss": reference.losses[0],
        "rel_diff": difference,
    }
    if difference > plan.loss_rtol and verdict.mismatch is None:
        verdict.mismatch = (
            f"step 1: plain transformers computes a loss of {loss:.7g} from {folder} (the shrunk model's initial "
            f"weights and the first batch), the one-process reference logged {reference.losses[0]:.7g}, a relative "
            f"difference of {difference:.2e} > {plan.loss_rtol:.0e}"
        )


def _train(cases, root: Path, recipe_dirs, timeout_s: float, quiet: bool):
    """train_all's records, or a Verdict naming the run that did not train."""
    from partrain.rehearse.runs import train_all

    try:
        return train_all(cases, root, timeout_s=timeout_s, recipe_dirs=recipe_dirs, quiet=quiet)
    except RuntimeError as exc:
        dirs = {name: root / name / "run" for name in cases}
        unfinished = [n for n, d in dirs.items() if not (d / "summary.json").is_file()]
        # The launch that failed is the newest: its processes' output says why.
        launches = sorted(root.glob("processes-*"), key=lambda d: d.stat().st_mtime)
        output = f"{launches[-1]}/rank*.out" if launches else f"{root}/processes-*/rank*.out"
        verdict = Verdict([], 0.0, 0.0, run_dirs=dirs)
        verdict.failed_run = (
            f"{' and '.join(unfinished) or 'a'} run(s) did not finish ({exc}); the failing processes' output: "
            f"{output}; the runs' logs: {', '.join(str(dirs[n] / 'logs') for n in unfinished)}"
        )
        return verdict
