"""Parity of a layout against one process: the overrides that make any layout the one-process reference,
the per-step records of a finished run, and their comparison within a stated tolerance.

`partrain rehearse` and the suite's parity tests both compare this way: the same model, data and seed,
every parallel degree 1 on a one-process cluster, each step's loss and gradient norm within a relative
tolerance.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import List, Sequence

from partrain.blueprint.rehearsal import REFERENCE_OVERRIDES

FP32_RTOL = 1e-5
"""The parity tolerance of an fp32 layout against one process, relative, every step's loss and
gradient norm. The runs do the same arithmetic in another order (all-reduce and reduce-scatter
sums, TP partial sums, pipeline microbatches), so they differ by fp32 rounding (2^-24 = 6e-8 per
operation), which a few steps of training grow by a few orders of magnitude but not to 1e-5.
Measured over the suite (1245 tests, issue 50): at most 1.9e-6 (LoRA ddp2 with recompute, gradient
norm), a margin of 5x; nearly every layout stays below 1e-6. A fault (a missing average, a wrong
shard, a dropped gradient) shows at 1e-3 or more."""


@dataclass
class RunRecord:
    losses: List[float]
    grad_norms: List[float]
    run_dir: Path
    summary: dict


def parity_args(overrides: Sequence[str], steps: int) -> List[str]:
    """A parity run's overrides: `steps` steps, no eval (the gradient norms and losses are compared), no
    final checkpoint unless the overrides ask for one (they come later and win)."""
    return [
        "checkpoint.save_final=false",
        *overrides,
        f"train.steps={steps}",
        "train.eval_every=0",
        "train.eval_batches=0",
    ]


def read_record(run_dir: Path) -> RunRecord:
    """A finished run's per-step losses and gradient norms (metrics.jsonl) and its summary.json."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_only = [r for r in records if "loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return RunRecord([r["loss"] for r in steps_only], [r["grad_norm"] for r in steps_only], run_dir, summary)


def reference_overrides(overrides: Sequence[str]) -> List[str]:
    return [*overrides, *REFERENCE_OVERRIDES]


def max_relative_difference(expected: Sequence[float], actual: Sequence[float]) -> float:
    if len(expected) != len(actual):
        raise AssertionError(f"step counts differ: {len(expected)} vs {len(actual)}")
    return max(_relative_difference(e, a) for e, a in zip(expected, actual))


def _relative_difference(expected: float, actual: float) -> float:
    # An overflowed fp16 step has an inf/NaN gradient norm on both sides: that agrees.
    if not math.isfinite(expected) or not math.isfinite(actual):
        return 0.0 if (math.isnan(expected) and math.isnan(actual)) or expected == actual else math.inf
    return abs(actual - expected) / max(abs(expected), 1e-12)


def check_parity(reference: RunRecord, layout: RunRecord, rtol: float = FP32_RTOL) -> dict:
    """Raises AssertionError naming the worst step when losses or gradient norms differ."""
    loss_diff = max_relative_difference(reference.losses, layout.losses)
    grad_diff = max_relative_difference(reference.grad_norms, layout.grad_norms)
    if loss_diff > rtol or grad_diff > rtol:
        raise AssertionError(
            f"parity broken: loss rel diff {loss_diff:.2e}, grad-norm rel diff {grad_diff:.2e} (tolerance {rtol:.0e})\n"
            f"reference losses {reference.losses}\nlayout losses    {layout.losses}"
        )
    return {"loss_rel_diff": loss_diff, "grad_norm_rel_diff": grad_diff}
