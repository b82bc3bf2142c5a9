"""The fine-tuning guide's two-command flow, offline (issue 37 item 8): a short pretraining run of the
built-in Llama, exported with `checkpoint export --hf`, then `recipe=sft-lora model.pretrained=DIR` on the
generated builtin-chat set under dp2; the chat loss must fall. Also the set's rows and `data make-chat`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from partrain.data.builtin_chat import ROWS, chat_rows

PRETRAIN = [
    "model=llama-tiny",
    "cluster.devices_per_node=1",
    "parallel.dp=1",
    "train.steps=3",
    "train.seq_len=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=4",
    "train.eval_every=0",
    "data.max_bytes=50000",
    "checkpoint.every_steps=3",
]
SFT_STEPS = 12


def _train(args, run_dir: Path) -> list:
    """`partrain train ARGS` in a process of its own; the per-step losses from its metrics."""
    done = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *args, f"train.run_dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r and "step" in r and not r.get("eval")]


def test_pretrain_export_then_sft_lora_the_loss_falls(tmp_path):
    from typer.testing import CliRunner

    from partrain.cli import app

    cache = f"data.cache_dir={tmp_path / 'cache'}"
    _train([*PRETRAIN, cache], tmp_path / "pretrain")
    (checkpoint,) = sorted((tmp_path / "pretrain" / "checkpoints").glob("step-*"))
    exported = CliRunner().invoke(app, ["checkpoint", "export", str(checkpoint), "--hf", str(tmp_path / "base")])
    assert exported.exit_code == 0, exported.output
    args = ["recipe=sft-lora", f"model.pretrained={tmp_path / 'base'}", f"train.steps={SFT_STEPS}", cache]
    losses = _train([*args, "train.eval_every=0", "optim.warmup_steps=2"], tmp_path / "sft")
    assert len(losses) == SFT_STEPS
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first - 0.2, losses


def test_the_generated_chat_set_is_fixed_and_masks_every_kind_of_turn(tmp_path):
    rows = list(chat_rows())
    assert len(rows) == ROWS and rows == list(chat_rows()), "the same rows on every run"
    roles = [[m["role"] for m in r["messages"]] for r in rows]
    assert ["system", "user", "assistant"] in roles and ["user", "assistant", "user", "assistant"] in roles
    from typer.testing import CliRunner

    from partrain.cli import app

    out = tmp_path / "chats.jsonl"
    made = CliRunner().invoke(app, ["data", "make-chat", str(out), "--rows", "50"])
    assert made.exit_code == 0, made.output
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows[:50]


def _records(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_sft_then_dpo_as_the_preference_guide_gives_it(tmp_path):
    """docs/preference-tuning.md's flow, offline: a short sft-lora run exported with `checkpoint export --hf`,
    then `recipe=dpo-lora model.pretrained=DIR` as shipped (60 steps, dp2): the DPO loss starts at log 2 (the
    adapters start at zero, so the policy is its reference), falls, and the chosen answers come to win."""
    import math

    from typer.testing import CliRunner

    from partrain.cli import app

    cache = f"data.cache_dir={tmp_path / 'cache'}"
    _train(["recipe=sft-lora", "train.steps=6", "train.eval_every=0", cache], tmp_path / "sft")
    (checkpoint,) = sorted((tmp_path / "sft" / "checkpoints").glob("step-*"))
    exported = CliRunner().invoke(app, ["checkpoint", "export", str(checkpoint), "--hf", str(tmp_path / "merged")])
    assert exported.exit_code == 0, exported.output
    losses = _train(["recipe=dpo-lora", f"model.pretrained={tmp_path / 'merged'}", cache], tmp_path / "dpo")
    steps = [r for r in _records(tmp_path / "dpo") if "rewards/accuracies" in r]
    assert len(losses) == len(steps) == 60
    assert math.isclose(losses[0], math.log(2), rel_tol=1e-6) and steps[0]["rewards/margins"] == 0.0
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    accuracy = sum(s["rewards/accuracies"] for s in steps[-10:]) / 10
    print(f"dpo loss {first:.4f} -> {last:.4f}, reward accuracy of the last 10 steps {accuracy:.2f}")
    assert last < first - 0.08, losses
    assert accuracy > 0.7 and steps[-1]["rewards/margins"] > 0.1, steps[-10:]
