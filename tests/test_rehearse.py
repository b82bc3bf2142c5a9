"""`partrain rehearse` for real: the user's layout, shrunk, in several gloo processes against one process, through
the CLI; a difference beyond the tolerance names the step and the quantity. (The plans: test_rehearse_plan.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.rehearsal import plan_rehearsal
from partrain.blueprint.validate import validate


def _rehearse(*args: str, timeout: int = 300):
    return subprocess.run(
        [sys.executable, "-m", "partrain.cli", "rehearse", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "overrides",
    [
        # MoE with ep, tp and pp: experts over ep, the rest over tp, stages over pp
        [
            "recipe=mixtral-ep",
            "parallel.dp=2",
            "parallel.ep=2",
            "parallel.tp=2",
            "parallel.pp=2",
            "cluster.devices_per_node=8",
        ],
        # (docs/rehearse.md's worked example, run by test_doc_commands, rehearses gpt-3d under tp x FSDP:
        # GPT-2's fused q|k|v bias was once saved permuted there, which its resume checks found.)
    ],
    ids=["mixtral-ep-tp-pp"],
)
def test_the_layout_matches_one_process_and_both_resume(overrides, tmp_path):
    out = tmp_path / "rehearsal"
    ran = _rehearse(*overrides, "--out", str(out), "--json")
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    report = json.loads(ran.stdout)
    assert report == json.loads((out / "report.json").read_text())
    verdict = report["verdict"]
    assert verdict["passed"] and len(verdict["steps"]) == 4
    assert [r["run"] for r in verdict["resumed"]] == ["layout", "reference"]
    assert all(r["from"] == "layout step 2" and r["loss_rel_diff"] <= 1e-5 for r in verdict["resumed"])
    assert verdict["resumed"][0]["loss_rel_diff"] == 0.0  # the same processes replay the same arithmetic
    summary = json.loads((out / "layout" / "run" / "summary.json").read_text())
    assert len(summary["ranks"]) == report["plan"]["world"] == 8


def test_a_difference_beyond_the_tolerance_names_the_step_and_the_quantity(tmp_path):
    """Zero tolerance on a real dp2 rehearsal: the first rounding difference is reported as a mismatch
    (the same path a real fault takes), and the CLI maps a failed verdict to exit 1."""
    from dataclasses import replace

    from partrain.rehearse.run import run_rehearsal

    overrides = ["recipe=gpt-dp", "parallel.zero_stage=3"]
    plan = plan_rehearsal(validate(compose(overrides)), overrides, steps=2)
    verdict = run_rehearsal(replace(plan, loss_rtol=0.0, grad_norm_rtol=0.0), tmp_path)
    assert not verdict.passed and verdict.mismatch.startswith("step ")
    assert ("loss" in verdict.mismatch or "gradient norm" in verdict.mismatch) and "> 0e+00" in verdict.mismatch
    assert verdict.resumed == []  # a mismatch stops before the resume check
