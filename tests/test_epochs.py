"""train.epochs (issue 45): passes over the training split instead of steps, counted from the data by
the preflight (the dry run shows the count) and by every worker alike."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.epochs import steps_for_epochs
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError

TEXT = ["recipe=gpt-dp", "data.max_bytes=12000", "train.seq_len=64", "train.eval_every=0", "train.eval_batches=0"]


@pytest.mark.parametrize("epochs,per_epoch,steps", [(1, 7, 7), (3, 7, 21), (0.5, 7, 4), (0.01, 7, 1), (2.2, 10, 22)])
def test_epochs_come_to_the_ceiling_of_their_batches(epochs, per_epoch, steps):
    assert steps_for_epochs(epochs, per_epoch) == steps


def test_the_dry_run_counts_windows_steps_a_pass_and_steps(cli):
    ran = cli("train", *TEXT, "train.epochs=2", "--dry-run", "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    report = json.loads(ran.stdout)
    epochs = report["epochs"]
    assert epochs["unit"] == "windows" and epochs["epochs"] == 2
    assert epochs["steps_per_epoch"] == epochs["per_epoch"] // report["batch"]["global_batch_size"]
    assert epochs["steps"] == 2 * epochs["steps_per_epoch"]
    assert report["saves"]["final"].endswith(f"step-{epochs['steps']:08d}")
    text = cli("train", *TEXT, "train.epochs=2", "--dry-run").stdout
    assert f"{epochs['steps']:,} steps" in text and "windows a pass" in text


def test_the_dry_run_counts_packed_chat_windows(cli):
    ran = cli("train", "recipe=sft-lora", "train.epochs=1", "train.eval_every=0", "--dry-run", "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    epochs = json.loads(ran.stdout)["epochs"]
    assert epochs["unit"] == "packed windows" and epochs["steps"] == epochs["steps_per_epoch"] >= 1


def test_a_warmup_longer_than_the_epochs_is_refused_before_launch(cli):
    ran = cli("train", *TEXT, "train.epochs=0.1", "optim.schedule=wsd", "optim.warmup_steps=90", "--dry-run")
    assert ran.code == 2 and "train.epochs=0.1 comes to train.steps=" in ran.stderr, ran.stderr


@pytest.mark.parametrize(
    "overrides,rule",
    [(["train.epochs=-1"], "must be >= 0"), (["train.epochs=1", "data.streaming=true"], "not known before training")],
)
def test_bad_epochs_are_refused(overrides, rule):
    with pytest.raises(ConfigError) as err:
        validate(compose(["recipe=gpt-dp", *overrides]))
    assert any(p.key == "train.epochs" and rule in p.rule for p in err.value.problems)


def test_a_one_process_run_trains_the_steps_its_epochs_come_to(tmp_path):
    from partrain.preflight import check_before_launch

    overrides = [*TEXT, "cluster.devices_per_node=1", "parallel.dp=1", "train.epochs=1.5"]
    overrides.append("train.threads_per_process=1")  # beside the suite's other workers (209 s with two threads)
    overrides.append("checkpoint.save_final=false")
    overrides.append(f"data.cache_dir={tmp_path / 'cache'}")
    facts: dict = {}
    check_before_launch(validate(compose(overrides)), dry_run=True, facts=facts)  # the dry run's count
    steps = facts["epochs"]["steps"]
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *overrides, f"train.run_dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == steps
