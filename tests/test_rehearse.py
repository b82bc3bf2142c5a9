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
    # --out reproduces the reference without partrain: routed experts, as transformers computes them
    assert _plain_transformers_loss(out / "reproduce", step=1) == pytest.approx(
        verdict["steps"][0]["loss"]["reference"], rel=1e-5
    )


def _plain_transformers_loss(folder, step: int) -> float:
    """This test's own reading of reproduce/ (the format docs/rehearse.md documents), with transformers and
    safetensors only: step `step`'s loss, summed over the labelled tokens of its micro-batches over their count."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    facts = json.loads((folder / "batches" / "batches.json").read_text())
    tensors = load_file(str(folder / "batches" / f"step-{step:04d}.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(str(folder / "model"), dtype=torch.float32)
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for i in range(facts["microbatches_per_step"]):
            ids, labels, positions = (tensors[f"microbatch.{i}.{k}"] for k in ("input_ids", "labels", "position_ids"))
            assert ids.shape == (facts["rows_per_microbatch"], facts["seq_len"])
            logits = model(input_ids=ids, position_ids=positions).logits
            total += F.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="sum", ignore_index=-100
            ).double()
            count += int((labels != -100).sum())
    return float(total) / count


def test_a_difference_beyond_the_tolerance_names_the_step_and_the_quantity(tmp_path):
    """Zero tolerance on a real rehearsal (chat SFT, packed and masked, LoRA under FSDP): the first rounding
    difference is reported as a mismatch (the same path a real fault takes), and the CLI maps a failed
    verdict to exit 1. Its reproduce/ folder still gives the reference's first loss with plain transformers:
    masked labels, and packed rows whose position ids keep attention inside each chat."""
    from dataclasses import replace

    from safetensors.torch import load_file

    from partrain.rehearse.run import run_rehearsal

    overrides = ["recipe=sft-lora", "parallel.zero_stage=3"]
    plan = plan_rehearsal(validate(compose(overrides)), overrides, steps=2)
    verdict = run_rehearsal(replace(plan, loss_rtol=0.0, grad_norm_rtol=0.0), tmp_path)
    assert not verdict.passed and verdict.mismatch.startswith("step ")
    assert ("loss" in verdict.mismatch or "gradient norm" in verdict.mismatch) and "> 0e+00" in verdict.mismatch
    assert verdict.resumed == []  # a mismatch stops before the resume check

    folder = tmp_path / "reproduce"
    tensors = load_file(str(folder / "batches" / "step-0001.safetensors"))
    assert (tensors["microbatch.0.labels"] == -100).any()  # prompts are masked
    assert (tensors["microbatch.0.position_ids"][:, 1:] == 0).any()  # a chat starts inside a packed row
    expected = verdict.rows[0].loss_reference
    assert _plain_transformers_loss(folder, step=1) == pytest.approx(expected, rel=1e-5)
    assert verdict.reproduced["rel_diff"] <= 1e-5  # the rehearsal's own check agrees
    # docs/rehearse.md's command: the script the folder carries, in a plain interpreter
    printed = subprocess.run(
        [sys.executable, str(folder / "plain_step.py"), str(folder)], capture_output=True, text=True, check=True
    ).stdout
    assert float(printed.split()[-1]) == pytest.approx(expected, rel=1e-5)


def test_ctrl_c_stops_every_process_records_nothing_and_names_the_folder(tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group: the rehearsal and its runs stop within
    seconds, exit 130, and no verdict is recorded for the dry run."""
    import os
    import signal
    import time

    def own_group():
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as in a terminal (a test runner may ignore it)
        os.setsid()

    out, cache = tmp_path / "rehearsal", tmp_path / "cache"
    args = ["model=llama-tiny", "cluster.devices_per_node=1", "parallel.dp=1", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "partrain.cli", "rehearse", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=own_group,
        env={**os.environ, "XDG_CACHE_HOME": str(cache)},
    )
    deadline = time.monotonic() + 240
    while not (out / "layout" / "run" / "metrics.jsonl").exists():  # the runs are training
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stdout[-2000:] + stderr[-2000:]
    assert f"rehearsal interrupted: no verdict and nothing recorded; the unfinished runs are in {out}\n" in stderr
    assert not (out / "report.json").exists() and not cache.exists()
    # The training processes die with the signal; multiprocessing's fork server and resource tracker (which
    # ignore Ctrl-C) leave once they see their parent gone.
    deadline = time.monotonic() + 30
    while (left := _processes_of_group(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert left == []


def _processes_of_group(group: int):
    return subprocess.run(["ps", "-o", "pid=,args=", "-g", str(group)], capture_output=True, text=True).stdout.split(
        "\n"
    )[:-1]
