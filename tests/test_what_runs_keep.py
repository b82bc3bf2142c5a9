"""A run keeps what it trained (issue 45): the last step is saved by default, the summary names it and
the export commands that run as printed; a run set to keep nothing says so at launch and in the dry
run. And the cluster the user names is the cluster that runs."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError

ONE_PROCESS_LORA = [
    "recipe=sft-lora",
    "cluster.devices_per_node=1",
    "parallel.dp=1",
    "train.steps=3",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.eval_every=0",
    "train.eval_batches=0",
    "train.threads_per_process=1",  # beside the suite's other workers: two spinning OpenMP threads crawl
]


def test_a_finished_lora_run_keeps_its_last_step_and_prints_export_commands_that_work(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *ONE_PROCESS_LORA, f"train.run_dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    checkpoint = run_dir / "checkpoints" / "step-00000003"
    assert summary["checkpoint"] == str(checkpoint) and (checkpoint / "partrain.json").is_file()
    assert f"summary: checkpoint {checkpoint}" in proc.stdout
    commands = summary["export_commands"]
    assert [c.split()[-2] for c in commands] == ["--peft", "--hf"]
    for command in commands:  # as printed: each writes its folder
        assert f"summary: export: {command}" in proc.stdout
        args = shlex.split(command)
        assert args[:3] == ["partrain", "checkpoint", "export"]
        out = subprocess.run(
            [sys.executable, "-m", "partrain.cli", *args[1:]], capture_output=True, text=True, timeout=300, cwd=tmp_path
        )
        assert out.returncode == 0, out.stdout + out.stderr
    assert (run_dir / "adapter" / "adapter_config.json").is_file()
    assert (run_dir / "merged" / "config.json").is_file()


def test_the_dry_run_says_where_the_last_step_goes(cli):
    ran = cli("train", "recipe=gpt-dp", "train.run_dir=runs/a", "train.steps=30", "--dry-run", "--json")
    assert ran.code == 0, ran.stderr
    saves = json.loads(ran.stdout)["saves"]
    assert saves["keys"] == ["checkpoint.save_final=true"] and saves["nothing"] is None
    assert saves["final"] == "runs/a/checkpoints/step-00000030"
    ran = cli("train", "recipe=gpt-dp", "train.run_dir=runs/a", "--dry-run")
    assert "checkpoints" in ran.stdout and "the last step to runs/a/checkpoints/step-" in ran.stdout


def test_a_run_that_keeps_nothing_says_so_in_the_dry_run_and_at_launch(cli):
    off = ["recipe=gpt-dp", "checkpoint.save_final=false"]
    ran = cli("train", *off, "--dry-run", "--json")
    assert ran.code == 0, ran.stderr
    saves = json.loads(ran.stdout)["saves"]
    assert saves["keys"] == [] and "saves nothing" in saves["nothing"] and "save_final" in saves["nothing"]
    ran = cli("train", *off, "--dry-run")
    assert "this run saves nothing" in ran.stdout
    ran = cli("train", *off)  # the launch itself is refused by the fixture, after the warning
    assert "warning: this run saves nothing" in ran.stdout
    ran = cli("train", *off, "checkpoint.every_steps=5", "--dry-run", "--json")
    assert json.loads(ran.stdout)["saves"]["nothing"] is None


def test_a_multi_node_run_keeping_its_last_step_needs_a_shared_folder():
    from partrain.runtime.shared_checkpoints import checkpoint_dir_problems

    (problem,) = checkpoint_dir_problems(compose(["recipe=gpt-dp", "cluster.nodes=2", "parallel.dp=4"]))
    assert problem.key == "checkpoint.dir" and "checkpoint.save_final=true" in problem.rule
    run = compose(["recipe=gpt-dp", "cluster.nodes=2", "parallel.dp=4", "checkpoint.save_final=false"])
    assert checkpoint_dir_problems(run) == []


def test_a_strategy_that_cannot_save_skips_the_final_checkpoint_and_says_so(cli):
    overrides = ["recipe=gpt-dp", "parallel.dp_sync=parameter-server"]
    validate(compose(overrides))  # plan and train it as before
    ran = cli("train", *overrides, "--dry-run", "--json")
    saves = json.loads(ran.stdout)["saves"]
    assert saves["final"] is None and "parameter-server cannot checkpoint yet" in saves["nothing"]
    assert "warning: parallel.dp_sync=parameter-server cannot checkpoint" in cli("train", *overrides).stdout
    with pytest.raises(ConfigError) as err:  # what it would have to save is refused
        validate(compose([*overrides, "checkpoint.every_steps=5"]))
    (problem,) = [p for p in err.value.problems if p.key.startswith("checkpoint.")]
    assert problem.key == "checkpoint.every_steps" and "checkpoint.every_steps=0" in problem.fix


@pytest.mark.parametrize("recipe", ["sft-lora", "gpt-dp", "gpt-3d", "llama-fsdp-tp"])
def test_a_cluster_named_on_the_command_line_beats_the_recipes_machine_keys(recipe):
    run = compose([f"recipe={recipe}", "cluster=h100x8"])
    assert (run.cluster.name, run.cluster.devices_per_node, run.cluster.backend) == ("h100x8", 8, "nccl")
    # a cluster key on the command line still beats both
    assert compose([f"recipe={recipe}", "cluster=h100x8", "cluster.devices_per_node=4"]).cluster.devices_per_node == 4
    # without a cluster group on the command line the recipe's keys apply, as before
    assert compose([f"recipe={recipe}"]).cluster.name == "local-cpu"


def test_the_cluster_row_of_the_dry_run_shows_the_named_cluster(cli):
    ran = cli(
        "train",
        "recipe=sft-lora",
        "cluster=h100x8",
        "parallel.dp=8",
        "train.micro_batch_size=2",
        "train.eval_batches=0",
        "--dry-run",
    )
    assert "h100x8: 1 node(s) x 8 devices" in ran.stdout, ran.stdout + ran.stderr


@pytest.mark.parametrize(
    "overrides, backend",
    [
        (["cluster.device=cuda"], "nccl"),
        (["cluster.device=cuda", "cluster.backend=gloo"], "gloo"),  # asked for by name
        (["cluster=h100x8", "cluster.device=cpu"], "gloo"),
        (["cluster=h100x8"], "nccl"),
        ([], "gloo"),
    ],
)
def test_a_device_named_on_the_command_line_brings_its_backend(overrides, backend):
    assert compose(["recipe=sft-lora", *overrides]).cluster.backend == backend
