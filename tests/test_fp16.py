"""fp16 mixed precision with dynamic loss scaling, for real (torchrun, gloo, several processes).

Parity: fp16 layouts against the one-process fp16 run of the same model, data and seed: losses
and gradient norms within 1e-4 relative (fp16 rounds differently when the work is split; fp32
layouts are held to 1e-5 in test_data_parallel). Overflow: a loss scale that is far too large makes
the first steps overflow; those steps are skipped on every rank, the scale halves per skipped
step, training then proceeds; the scale survives a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partrain.testing.parity import check_parity, reference_overrides, run_training
from partrain.train.loss_scale import DynamicLossScale

FP16_RTOL = 1e-4
BASE = ["recipe=gpt-dp", "train.global_batch_size=16", "train.micro_batch_size=2", "train.seq_len=64",
        "data.max_bytes=1000000", "train.precision=fp16", "train.eval_every=0"]
DP2_ZERO3 = ["parallel.dp=2", "cluster.devices_per_node=2", "parallel.zero_stage=3"]


def _records(run_dir: Path) -> list:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


# ---- the scaler's rule (pure Python) --------------------------------------------------------------


def test_loss_scale_halves_on_overflow_and_doubles_after_a_clean_window():
    s = DynamicLossScale(scale=1024.0, window=3)
    assert s.update(False) is False and s.scale == 512.0 and s.skipped_steps == 1
    assert [s.update(True) for _ in range(3)] == [True, True, True]
    assert s.scale == 1024.0 and s.good_steps == 0
    s.update(True)
    assert s.update(False) is False and s.good_steps == 0 and s.scale == 512.0


def test_loss_scale_has_a_floor_and_round_trips():
    s = DynamicLossScale(scale=2.0, window=10)
    for _ in range(5):
        s.update(False)
    assert s.scale == 1.0 and s.skipped_steps == 5
    t = DynamicLossScale(scale=65536.0, window=10)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t == s


def test_only_fp16_runs_scale_the_loss():
    from partrain.config.compose import compose

    assert DynamicLossScale.for_run(compose(["train.precision=bf16"]).train) is None
    assert DynamicLossScale.for_run(compose(["train.precision=fp32"]).train) is None
    got = DynamicLossScale.for_run(compose(["train.precision=fp16", "train.loss_scale_init=1024"]).train)
    assert got.scale == 1024.0 and got.window == 1000


# ---- through the trainer ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [
    ("dp2-zero3", BASE + DP2_ZERO3),
    ("3d-dp2-tp2-pp2", ["recipe=gpt-3d", "train.precision=fp16", "train.seq_len=64", "data.max_bytes=1000000",
                        "train.eval_every=0"]),
])
def test_fp16_layouts_match_the_one_process_fp16_run(name, layout, tmp_path, data_cache):
    overrides = layout + [f"data.cache_dir={data_cache}"]
    reference = run_training(reference_overrides(overrides), tmp_path / "ref", 5)
    got = run_training(overrides, tmp_path / "run", 5)
    diffs = check_parity(reference, got, rtol=FP16_RTOL)
    print(f"{name}: {diffs}")
    records = _records(tmp_path / "run")
    assert all(r["loss_scale"] == 65536.0 and not r["skipped"] for r in records)
    assert got.losses[-1] < got.losses[0]


@pytest.mark.slow
def test_overflowing_steps_are_skipped_everywhere_and_the_scale_survives_a_checkpoint(tmp_path, data_cache):
    overrides = BASE + DP2_ZERO3 + [f"data.cache_dir={data_cache}", "train.loss_scale_init=16777216",
                                    "checkpoint.every_steps=5"]
    first = tmp_path / "first"
    run_training(overrides, first, 10)
    records = _records(first)
    skipped = [r["step"] for r in records if r["skipped"]]
    # 2**24 overflows this model's fp16 backward; each skipped step halves the scale, then it trains.
    assert skipped[:3] == [1, 2, 3] and len(skipped) < 9, skipped
    for r, nxt in zip(records, records[1:]):
        assert nxt["loss_scale"] == (r["loss_scale"] / 2 if r["skipped"] else r["loss_scale"])
    taken = [r for r in records if not r["skipped"]]
    assert taken[-1]["loss"] < taken[0]["loss"]

    resumed = tmp_path / "resumed"
    run_training(overrides + [f"checkpoint.resume={first / 'checkpoints' / 'step-00000005'}"], resumed, 10)
    again = {r["step"]: r for r in _records(resumed)}
    straight = {r["step"]: r for r in records}
    assert sorted(again) == [6, 7, 8, 9, 10]
    for step in again:
        assert again[step]["loss_scale"] == straight[step]["loss_scale"]
        assert again[step]["skipped"] == straight[step]["skipped"]
        assert abs(again[step]["loss"] - straight[step]["loss"]) <= 1e-6 * abs(straight[step]["loss"])
