"""Checkpoints through the real trainer: exact resume, resharding across layouts, surviving kill -9.

The straight and resumed runs train in real processes through the worker's code, sharing a launch
per process count (testing.in_process.train_all); the killed-worker run and the 4-process export go
through `partrain train` and `partrain export` themselves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from partrain.rehearse.runs import train_all
from partrain.testing.hf_check import export_with_cli, logits_difference
from partrain.testing.parity import max_relative_difference, parity_args

pytestmark = pytest.mark.slow

COMMON = ["train.seq_len=64", "data.max_bytes=1000000", "train.eval_every=0"]
DP = ["recipe=gpt-dp", "parallel.dp=2", "train.global_batch_size=8", "train.micro_batch_size=2"]
THREE_D = ["recipe=gpt-3d"]  # dp2 x tp2 x pp2, global batch 8, micro batch 2


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def _losses(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def straight_3d(tmp_path_factory, data_cache):
    """gpt-3d for 10 steps, saving every 5 and exporting at the end, in 8 real processes through the
    worker's code (testing.in_process.train_all); the run folder."""
    extra = [f"data.cache_dir={data_cache}", "checkpoint.every_steps=5", "checkpoint.export_hf=true"]
    runs = train_all({"straight": parity_args(THREE_D + COMMON + extra, 10)}, tmp_path_factory.mktemp("straight3d"))
    return runs["straight"].run_dir


RESUME_LAYOUTS = {
    "same-3d-layout": THREE_D,
    "dp4": ["recipe=gpt-3d", "parallel.tp=1", "parallel.pp=1", "parallel.dp=4", "cluster.devices_per_node=4"],
    "one-process": ["recipe=gpt-3d", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "cluster.devices_per_node=1"],
}


@pytest.fixture(scope="module")
def resumed_3d(straight_3d, tmp_path_factory, data_cache):
    """Each RESUME_LAYOUTS entry resuming the step-5 checkpoint to step 10 (one launch per process count)."""
    ckpt = straight_3d / "checkpoints" / "step-00000005"
    extra = [f"data.cache_dir={data_cache}", f"checkpoint.resume={ckpt}"]
    cases = {name: parity_args(layout + COMMON + extra, 10) for name, layout in RESUME_LAYOUTS.items()}
    return train_all(cases, tmp_path_factory.mktemp("resumed3d"))


def test_3d_checkpoint_exports_to_hf_with_four_processes(straight_3d, tmp_path):
    """gpt-3d's checkpoint (dp2 x tp2 x pp2: pipeline stages, TP shards, GPT-2's fused QKV saved whole)
    exported by 4 processes, each writing one shard, and the run's own export at its end
    (checkpoint.export_hf=true): from_pretrained gives the logits of the checkpoint's model exactly."""
    ckpt = straight_3d / "checkpoints" / "step-00000010"
    report = export_with_cli(ckpt, tmp_path / "hf", nproc=4)
    assert [Path(s["file"]).name for s in report["shards"]] == [
        f"model-{k:05d}-of-00004.safetensors" for k in (1, 2, 3, 4)
    ]
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding: written once, as save_pretrained does
    assert logits_difference(tmp_path / "hf", ckpt) == 0.0
    assert logits_difference(straight_3d / "hf", ckpt) == 0.0


@pytest.mark.parametrize("name", list(RESUME_LAYOUTS))
def test_3d_checkpoint_resumes_under_any_layout(name, straight_3d, resumed_3d):
    """Saved under dp2 x tp2 x pp2 at step 5; resumed under the same layout the remaining steps match
    the straight run within 1e-6, and under dp4 / one process the first loss after loading matches (1e-5)."""
    straight, resumed = _losses(straight_3d), _losses(resumed_3d[name].run_dir)
    assert sorted(resumed) == [6, 7, 8, 9, 10]
    if name == "same-3d-layout":
        assert max_relative_difference([straight[s] for s in resumed], [resumed[s] for s in resumed]) <= 1e-6
    else:
        assert abs(resumed[6] - straight[6]) / straight[6] <= 1e-5


def test_dp_resume_is_exact_and_survives_a_killed_worker(tmp_path, data_cache):
    """A straight dp2 run and one resuming its step-5 checkpoint (one shared launch, the worker's code):
    the losses agree within 1e-6. Then a run through `partrain train` whose worker is SIGKILLed."""
    base = DP + COMMON + [f"data.cache_dir={data_cache}", "checkpoint.every_steps=5", "checkpoint.keep_last=0"]
    straight = tmp_path / "straight" / "run"
    resume = [f"checkpoint.resume={straight / 'checkpoints' / 'step-00000005'}"]
    runs = train_all({"straight": parity_args(base, 20)}, tmp_path)
    runs |= train_all({"resumed": parity_args(base + resume, 20)}, tmp_path)
    a, b = _losses(straight), _losses(runs["resumed"].run_dir)
    assert sorted(b) == list(range(6, 21))
    assert max_relative_difference([a[s] for s in b], [b[s] for s in b]) <= 1e-6

    # kill -9 one worker after the step-5 checkpoint (before the last step): torchrun restarts the
    # job, which resumes by itself.
    killed = tmp_path / "killed"
    args = [*base, "train.steps=20", f"train.run_dir={killed}", "train.max_restarts=1", "train.eval_batches=0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "partrain.cli", "train", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    victim = None
    while victim is None and time.monotonic() < deadline and proc.poll() is None:
        if (killed / "checkpoints" / "step-00000005").exists() and (killed / "metrics.jsonl").exists():
            steps = _losses(killed)
            if steps and max(steps) < 20:
                # Workers only ("-u -m partrain.worker DIR"), never torchrun's agent, whose command line names it too.
                pids = subprocess.run(
                    ["pgrep", "-f", "--", f"-u -m partrain.worker {killed}"], capture_output=True, text=True
                ).stdout.split()
                if pids:
                    victim = pids[-1]
                    subprocess.run(["kill", "-9", victim])
        time.sleep(0.05)
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert victim is not None, "the run ended before a worker could be killed"
    assert proc.returncode == 0, out[-3000:]
    final_killed = json.loads((killed / "summary.json").read_text())["final_loss"]
    assert abs(final_killed - a[20]) / a[20] <= 1e-6
