"""Sequence/context parallelism (parallel.sp, Ulysses and zig-zag ring) for real against the one-process run.

Every layout trains in real processes (gloo) through the worker's code and is compared with the
single-process run of the same model, data and seed: per-step losses, gradient norms and the final
eval loss within 1e-5 relative (fp32). One reference per (model, sequence length); the runs of one
process count share a launch (testing.in_process.train_all). Also: a checkpoint saved under sp2
resumed under sp4 through `partrain train` itself, and the bad inputs exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from partrain.rehearse.runs import train_all
from partrain.testing.parity import RunRecord, max_relative_difference, reference_overrides

pytestmark = pytest.mark.slow

STEPS = 5
RTOL = 1e-5
"""sp layouts vs one process, fp32, every step's loss and gradient norm and the eval loss, relative
(partrain.testing.parity.FP32_RTOL's reasoning). Measured (2026-12-07): at most 9.2e-7 (Ulysses sp2 x
dp2 FSDP, gradient norm), a margin of 11x; the losses at most 2.0e-7."""
# Two ranks' worth of rows (dp2 takes one each), microbatches of one row; tiny models.
COMMON = [
    "data.max_bytes=1000000",
    "train.global_batch_size=2",
    "train.micro_batch_size=1",
    "train.precision=fp32",
    "train.eval_every=0",
    "train.eval_batches=1",
    "parallel.dp=1",
    "parallel.zero_stage=0",
]
LLAMA = ["recipe=llama-long-sp", "model.config.num_hidden_layers=2"]
QWEN2 = LLAMA + ["model=qwen2-tiny"]
GPT2 = ["recipe=gpt-dp", "model.config.n_layer=2"]

# name: (model overrides, seq_len, layout overrides, processes)
LAYOUTS = {
    "llama-ulysses-sp2": (LLAMA, 512, ["parallel.sp=2", "parallel.sp_mode=ulysses"], 2),
    "llama-ring-sp2-seq2048": (LLAMA, 2048, ["parallel.sp=2", "parallel.sp_mode=ring"], 2),
    "llama-ring-sp2-tp2": (LLAMA, 512, ["parallel.sp=2", "parallel.tp=2", "parallel.sp_mode=ring"], 4),
    "llama-ring-sp4-seq2048": (LLAMA, 2048, ["parallel.sp=4", "parallel.sp_mode=ring"], 4),
    # Also saves the step-3 checkpoint that ring sp4 resumes from (test_checkpoint_resumes_under_ring_sp4).
    "llama-ulysses-sp2-dp2-fsdp": (
        LLAMA,
        512,
        [
            "parallel.sp=2",
            "parallel.dp=2",
            "parallel.zero_stage=3",
            "parallel.sp_mode=ulysses",
            "checkpoint.every_steps=3",
        ],
        4,
    ),
    "llama-ring-sp2-pp2": (LLAMA, 512, ["parallel.sp=2", "parallel.pp=2", "parallel.sp_mode=ring"], 4),
    "qwen2-ring-sp2": (QWEN2, 512, ["parallel.sp=2", "parallel.sp_mode=ring"], 2),
    "gpt2-ulysses-sp2": (GPT2, 512, ["parallel.sp=2", "parallel.sp_mode=ulysses"], 2),
}


def train(overrides: List[str], run_dir: Path, steps: int = STEPS) -> RunRecord:
    """`partrain train` like `testing.parity.run_training`, keeping the eval the overrides ask for."""
    args = [*overrides, f"train.steps={steps}", f"train.run_dir={run_dir}"]
    proc = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *args], capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"partrain train {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps_only = [r for r in records if "loss" in r]
    summary = json.loads((run_dir / "summary.json").read_text())
    return RunRecord([r["loss"] for r in steps_only], [r["grad_norm"] for r in steps_only], run_dir, summary)


def _base(model: List[str], seq: int, data_cache: Path) -> List[str]:
    return model + COMMON + [f"train.seq_len={seq}", f"data.cache_dir={data_cache}"]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def _reference_name(model: List[str], seq: int) -> str:
    return f"reference-{'qwen2' if model == QWEN2 else model[0].split('=')[1]}-{seq}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Every LAYOUTS entry and each one-process reference it needs, trained once per module through
    the worker's code; the runs of one process count share one launch (testing.in_process.train_all).
    The resume test below goes through `partrain train` itself."""
    cases, steps = {}, [f"train.steps={STEPS}"]
    for name, (model, seq, layout, procs) in LAYOUTS.items():
        cases[_reference_name(model, seq)] = reference_overrides(_base(model, seq, data_cache)) + steps
        cases[name] = _base(model, seq, data_cache) + layout + [f"cluster.devices_per_node={procs}", *steps]
    return train_all(cases, tmp_path_factory.mktemp("runs"))


def _parity(ref: RunRecord, got: RunRecord) -> dict:
    diffs = {
        "loss": max_relative_difference(ref.losses, got.losses),
        "grad_norm": max_relative_difference(ref.grad_norms, got.grad_norms),
        "eval_loss": max_relative_difference([ref.summary["eval_loss"]], [got.summary["eval_loss"]]),
    }
    assert max(diffs.values()) <= RTOL, (diffs, ref.losses, got.losses)
    return diffs


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(name, runs):
    model, seq, _, procs = LAYOUTS[name]
    assert len(runs[name].summary["ranks"]) == procs
    print(name, _parity(runs[_reference_name(model, seq)], runs[name]))


def test_checkpoint_resumes_under_ring_sp4(runs, tmp_path, data_cache):
    """Saved at step 3 under Ulysses sp2 x dp2 with FSDP, resumed under ring sp4 (DDP): steps 4-5 and the
    eval match the one-process run (sp holds no parameter shards, so the checkpoint does not depend on
    it)."""
    saved = runs["llama-ulysses-sp2-dp2-fsdp"].run_dir / "checkpoints" / "step-00000003"
    resumed = train(
        _base(LLAMA, 512, data_cache)
        + ["parallel.sp=4", "parallel.sp_mode=ring", "cluster.devices_per_node=4", f"checkpoint.resume={saved}"],
        tmp_path / "resumed",
    )
    ref = runs[_reference_name(LLAMA, 512)]
    assert len(resumed.losses) == 2 and len(resumed.summary["ranks"]) == 4
    print(
        "resume fsdp sp2 -> ring sp4",
        _parity(RunRecord(ref.losses[3:], ref.grad_norms[3:], ref.run_dir, ref.summary), resumed),
    )


SP = "recipe=llama-long-sp"  # dp2 x sp2 Ulysses; 4 heads, 2 KV heads, seq 4096

BAD = [  # (command-line arguments, the key the one error names, words of the valid choice it offers)
    pytest.param([SP, "train.seq_len=1023"], "train.seq_len", "train.seq_len=1024", id="sp-does-not-divide-seq"),
    pytest.param(
        [SP, "parallel.sp_mode=ring", "train.seq_len=1022"],
        "train.seq_len",
        "train.seq_len=1024",
        id="ring-odd-per-rank-length",
    ),
    pytest.param(
        [SP, "parallel.sp=8", "parallel.dp=1", "cluster.devices_per_node=8"],
        "parallel.sp",
        "sp in [1, 2, 4]",
        id="ulysses-heads",
    ),
    pytest.param(
        [
            SP,
            "parallel.sp=2",
            "parallel.tp=2",
            "parallel.dp=1",
            "parallel.tp_sequence_parallel=true",
            "model.config.num_key_value_heads=4",
            "train.seq_len=1022",
        ],
        "train.seq_len",
        "multiple of 4",
        id="megatron-sp-times-sp",
    ),
    pytest.param([SP, "parallel.sp_mode=zigzag"], "parallel.sp_mode", "ring", id="unknown-mode"),
    # Consistent layouts the sp attention does not do (partrain.blueprint.trainable): refused, never silently wrong.
    pytest.param(
        [SP, "model=mistral-tiny", "model.config.sliding_window=128", "train.seq_len=256"],
        "parallel.sp",
        "sliding attention window of 128",
        id="sliding-window-shorter-than-seq",
    ),
    pytest.param(
        [
            "recipe=gpt-dp",
            "parallel.sp=2",
            "parallel.dp=1",
            "parallel.sp_mode=ring",
            "model.config.attn_pdrop=0.1",
            "train.seq_len=256",
        ],
        "parallel.sp_mode",
        "attention dropout 0.1",
        id="ring-attention-dropout",
    ),
]


@pytest.mark.parametrize("args,key,fix", BAD)
def test_bad_sp_config_exits_2_before_any_process(cli, args, key, fix):
    ran = cli("train", *args)
    assert ran.code == 2, ran.stdout + ran.stderr
    assert ran.spawned == [] and ran.created() == []
    err = ran.stderr + ran.stdout
    assert f"{key}=" in err and fix in err and "Traceback" not in err, err
