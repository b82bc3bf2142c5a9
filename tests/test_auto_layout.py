"""`parallel=auto` (issue 21): the planner chooses the layout that `partrain train` runs.

In-process: the choice is stable, trainable and within the memory margin for gpt-3d's model on 8
CPU processes and for the planning-size recipes; fixed degrees are honoured; impossible constraints
exit 2 naming them. Real runs: gpt-dp chosen on 8 processes, saved, and resumed with parallel=auto
on 4 processes (a new layout) continues with the uninterrupted run's losses (1e-5); llama-fsdp-tp
with parallel=auto trains and its summary holds planned vs measured and the choice's check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.planner.auto import RECORD_FILE, choose_layout
from partrain.blueprint.trainable import unsupported_features
from partrain.testing.parity import max_relative_difference, run_training
from partrain.train.auto_check import auto_verdict

GIB = 2**30


def _choose(*overrides: str):
    overrides = [*overrides, "parallel=auto"]
    return choose_layout(compose(overrides), overrides)


@pytest.mark.parametrize(
    "recipe",
    ["gpt-3d", "gpt-dp", "llama-fsdp-tp", "mixtral-ep", "llama3-8b-h100", "llama3-70b-h100", "gpt3-175b-h100"],
)
def test_the_choice_is_stable_trainable_and_keeps_the_margin(recipe, cli):
    validated, record = _choose(f"recipe={recipe}")
    again, record_again = _choose(f"recipe={recipe}")
    assert record["chosen"]["overrides"] == record_again["chosen"]["overrides"]
    assert unsupported_features(validated) == []
    assert record["chosen"]["memory_gib"] <= record["usable_memory_gib"] + 1e-9
    cluster = validated.run.cluster  # a CPU node's memory is shared by its processes
    share = cluster.device_memory_gib / (cluster.devices_per_node if cluster.device == "cpu" else 1)
    assert record["usable_memory_gib"] == pytest.approx(share * 0.9)
    assert (
        validated.run.parallel.auto
        and validated.run.train.global_batch_size == compose([f"recipe={recipe}"]).train.global_batch_size
    )
    # The chosen degrees, given by hand, pass `train --dry-run --check` (no "cannot train" verdict).
    nodes = validated.run.cluster.nodes  # a multi-node launch's own checks: rendezvous, shared checkpoint folder
    launch = ["checkpoint.dir=ckpt", "--node-rank", "0", "--rdzv-endpoint", "node0:29400"] if nodes > 1 else []
    ran = cli("train", f"recipe={recipe}", *record["chosen"]["overrides"], *launch, "--dry-run", "--check", "--json")
    assert ran.code == 0, ran.stdout
    report = json.loads(ran.stdout)
    assert report["status"] == "ready" and "cannot train" not in json.dumps(report)


def test_gpt3d_model_on_eight_processes_prefers_fewer_microbatches_on_ties():
    validated, record = _choose("recipe=gpt-3d")
    assert validated.world_size == 8
    runner = record["runner_up"]
    assert runner is not None and runner["overrides"] != record["chosen"]["overrides"]
    if runner["step_time_s"] == pytest.approx(record["chosen"]["step_time_s"], rel=1e-4):
        assert validated.microbatches <= runner["layout"]["microbatches"]


def test_degrees_fixed_on_the_command_line_are_honoured():
    validated, record = _choose("recipe=gpt-3d", "parallel.tp=2", "train.micro_batch_size=2")
    assert (validated.layout.tp, validated.run.train.micro_batch_size) == (2, 2)
    assert record["fixed"] == {"parallel.tp": 2, "train.micro_batch_size": 2}
    validated, _ = _choose("recipe=gpt-3d", "parallel.pp=2", "parallel.zero_stage=0")
    assert validated.layout.pp == 2 and validated.run.parallel.zero_stage == 0
    validated, _ = _choose("recipe=gpt-3d", "parallel.tp_sequence_parallel=true")
    assert validated.layout.tp > 1 and validated.run.parallel.tp_sequence_parallel
    # The recipe's own degrees (dp2 x tp2 x pp2) are only a starting point: on 4 processes they are invalid.
    validated, record = _choose("recipe=gpt-3d", "cluster.devices_per_node=4")
    assert validated.world_size == 4 and record["fixed"] == {}


def test_the_dry_run_shows_the_choice_and_creates_nothing(run_partrain):
    ran = run_partrain("train", "recipe=gpt-3d", "parallel=auto", "parallel.tp=2", "--dry-run")
    assert ran.code == 0, ran.stderr
    assert "parallel=auto chose: dp4 x tp2" in ran.stdout and "runner-up:" in ran.stdout
    assert "fixed on the command line: parallel.tp=2" in ran.stdout
    assert ran.created() == [] and ran.spawned == []


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["parallel.tp=3"], "parallel.tp"),  # no layout of 8 processes has tp 3
        (["parallel.tp=2", "parallel.pp=8"], "parallel.pp"),  # 16 > 8 processes
        (["parallel.dp_shard=2"], "parallel.dp_shard"),  # the search sets it itself
        (["train.microbatches=4"], "train.microbatches"),
        (["parallel.auto_memory_margin=1.5"], "parallel.auto_memory_margin"),
        (["cluster.device_memory_gib=0.001"], "parallel"),  # nothing fits at all
    ],
)
def test_impossible_constraints_exit_2_naming_them(cli, overrides, key):
    ran = cli("train", "recipe=gpt-3d", "parallel=auto", *overrides, "--dry-run")
    assert ran.code == 2, ran.stdout
    text = ran.stdout + ran.stderr
    assert key in text and "Traceback" not in text
    assert ran.spawned == []


def test_a_compute_profile_drives_the_choice():
    profile = Path(__file__).parent / "fixtures" / "gpu_h200_compute_profile.json"
    _, nominal = _choose("recipe=llama3-8b-h100")
    _, profiled = _choose("recipe=llama3-8b-h100", f"cluster.compute_profile={profile}")
    assert nominal["compute_source"] == "nominal" and profiled["compute_source"] == f"profile:{profile}"
    assert profiled["chosen"]["step_time_s"] != nominal["chosen"]["step_time_s"]


def test_the_run_says_when_the_choice_is_slower_than_planned_or_inside_the_margin():
    _, record = _choose("recipe=gpt-dp")
    planned = record["chosen"]["tokens_per_s"]
    fine = auto_verdict(record, 0.5 * record["usable_memory_gib"] * GIB, planned / 1.2)
    assert fine["warnings"] == [] and not fine["slower_than_planned"] and not fine["memory_in_margin"]
    slow = auto_verdict(record, 1.01 * record["usable_memory_gib"] * GIB, planned / 1.5)
    assert slow["slower_than_planned"] and slow["memory_in_margin"] and len(slow["warnings"]) == 2
    assert all(" ".join(record["runner_up"]["overrides"]) in text for text in slow["warnings"])
    # On a CPU the step time is information naming the host's load; memory in the margin still warns.
    cpu = auto_verdict(record, 1.01 * record["usable_memory_gib"] * GIB, planned / 1.5, cpu_load="CPU: load x")
    assert cpu["slower_than_planned"] and [w[:40] for w in cpu["warnings"]] == [slow["warnings"][1][:40]]
    (info,) = cpu["info"]
    assert "takes 1.50x the predicted time (CPU: load x)" in info and fine["info"] == []


def _losses(run_dir) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


COMMON = ["train.seq_len=64", "data.max_bytes=1000000", "parallel=auto"]


@pytest.mark.slow
def test_auto_runs_train_and_resume_on_fewer_processes_with_a_new_layout(tmp_path):
    """gpt-dp chosen on 4 processes, checkpoint at step 3, 6 steps; resumed with parallel=auto on 2
    processes from step 3: a different layout, the same losses (1e-5). llama-fsdp-tp trains with
    parallel=auto on 2 processes and reports planned vs measured with the choice's check."""
    cache = [f"data.cache_dir={tmp_path / 'cache'}"]
    many = ["recipe=gpt-dp", "cluster.devices_per_node=4", *COMMON, *cache, "checkpoint.every_steps=3"]
    straight = run_training(many, tmp_path / "many", 6)
    chosen_many = json.loads((tmp_path / "many" / RECORD_FILE).read_text())["chosen"]["layout"]
    assert chosen_many["dp"] * chosen_many["tp"] * chosen_many["pp"] == 4
    block = straight.summary["planned_vs_measured"]
    assert block["memory"]["planned"] > 0 and block["tokens_per_s"]["planned"] > 0
    assert block["auto"]["chosen"] == json.loads((tmp_path / "many" / RECORD_FILE).read_text())["chosen"]["overrides"]

    ckpt = tmp_path / "many" / "checkpoints" / "step-00000003"
    fewer = ["recipe=gpt-dp", "cluster.devices_per_node=2", *COMMON, *cache, f"checkpoint.resume={ckpt}"]
    run_training(fewer, tmp_path / "fewer", 6)
    chosen_fewer = json.loads((tmp_path / "fewer" / RECORD_FILE).read_text())["chosen"]["layout"]
    assert chosen_fewer["dp"] * chosen_fewer["tp"] * chosen_fewer["pp"] == 2 and chosen_fewer != chosen_many
    before, after = _losses(tmp_path / "many"), _losses(tmp_path / "fewer")
    assert sorted(after) == [4, 5, 6]
    diff = max_relative_difference([before[s] for s in after], [after[s] for s in after])
    print(f"parallel=auto: 4 processes {chosen_many} -> 2 processes {chosen_fewer}: max relative difference {diff:.2e}")
    assert diff <= 1e-5
    config = (tmp_path / "fewer" / "config.yaml").read_text()
    assert f"dp: {chosen_fewer['dp']}" in config and "auto: true" in config

    llama = run_training(["recipe=llama-fsdp-tp", "cluster.devices_per_node=2", *COMMON, *cache], tmp_path / "llama", 3)
    assert llama.summary["planned_vs_measured"]["auto"]["runner_up"] is not None
    assert len(llama.losses) == 3
