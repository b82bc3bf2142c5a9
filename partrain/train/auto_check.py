"""A `parallel=auto` run checks the planner's choice against what it measures: when the measured
step is more than SLOWER_THAN_PLANNED x the predicted one, or the measured peak memory enters the
safety margin the choice kept free, it says so and names the next-best layout (the runner-up).

Said twice: once early (rank 0, a few steps after warm-up, in the worker's log) so a long run can be
stopped and restarted with the runner-up, and once in the run summary ("planned_vs_measured" ->
"auto").

On a CPU the machine's other load decides the step time, so there a slow step is information (with
the load named), not a warning; memory inside the margin warns on every device."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from partrain.blueprint.planner.auto import RECORD_FILE, SLOWER_THAN_PLANNED

log = logging.getLogger("partrain")

GIB = 2**30

EARLY_CHECK_AFTER_WARMUP = 3
"""Timed steps after warm-up before the early check."""


def read_auto_record(run_dir) -> Optional[dict]:
    """The run folder's record of the `parallel=auto` choice, or None (not an auto run, or unreadable)."""
    if run_dir is None:
        return None
    path = Path(run_dir) / RECORD_FILE
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError) as exc:
        log.warning("parallel=auto: cannot read %s (%s); the choice is not checked", path, exc)
        return None


def auto_verdict(
    record: dict, measured_memory_bytes: float, measured_tokens_per_s: float, cpu_load: Optional[str] = None
) -> dict:
    """{"chosen", "runner_up", "slower_than_planned", "memory_in_margin", "step_time_ratio", "warnings",
    "info"}. cpu_load: on a CPU run, the host's load in words (plan_check.load_text); a slow step is
    then one "info" sentence naming it, never a warning."""
    chosen, runner = record["chosen"], record.get("runner_up")
    planned = chosen["tokens_per_s"]
    ratio = planned / measured_tokens_per_s if measured_tokens_per_s > 0 and planned > 0 else None
    slower = ratio is not None and ratio > SLOWER_THAN_PLANNED
    allowed = record["usable_memory_gib"] * GIB
    in_margin = measured_memory_bytes > allowed
    nxt = (
        "the next-best layout is " + " ".join(runner["overrides"]) if runner else "no other layout was predicted to fit"
    )
    warnings, info = [], []
    if slower and cpu_load is not None:
        info.append(
            f"parallel=auto: the chosen layout's step takes {ratio:.2f}x the predicted time ({cpu_load}); "
            "the step time of a CPU run is not checked against the plan"
        )
    elif slower:
        warnings.append(
            f"parallel=auto: the chosen layout's step takes {ratio:.2f}x the predicted time "
            f"(more than {SLOWER_THAN_PLANNED:.1f}x); {nxt} (predicted {runner['step_time_s']:.4g} s/step)"
            if runner
            else f"parallel=auto: the chosen layout's step takes {ratio:.2f}x the predicted time; {nxt}"
        )
    if in_margin:
        warnings.append(
            f"parallel=auto: measured peak memory {measured_memory_bytes / GIB:.2f} GiB is inside the "
            f"{record['memory_margin']:.0%} safety margin (at most {allowed / GIB:.2f} GiB planned); {nxt}"
        )
    return {
        "chosen": chosen["overrides"],
        "runner_up": runner["overrides"] if runner else None,
        "step_time_ratio": ratio,
        "slower_than_planned": slower,
        "memory_in_margin": in_margin,
        "warnings": warnings,
        "info": info,
    }
