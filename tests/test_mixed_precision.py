"""16-bit mixed precision for real (gloo, several processes, the worker's code): bf16 and fp16 under
autocast, FSDP's MixedPrecisionPolicy (16-bit all-gathers and compute, fp32 gradient reduction and
master weights), and fp16's dynamic loss scaling.

Parity: 16-bit layouts against the one-process run of the same precision, model, data and seed.
The one-process run keeps fp32 weights under autocast; FSDP computes with 16-bit parameter copies
and produces 16-bit gradients before its fp32 reduce-scatter, so the two round differently:
measured 2.5e-4 (fp16) and 3.9e-4 (bf16) relative on gradient norms; held to 1e-3 and 2e-3, about a
quarter of each format's epsilon (fp32 layouts are held to 1e-5 in test_data_parallel).
Overflow: a loss scale that is far too large makes the first steps overflow; those steps are
skipped on every rank, the scale halves per skipped step, training then proceeds; the scale
survives a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partrain.rehearse.runs import train_all
from partrain.testing.parity import check_parity, parity_args, reference_overrides, run_training
from partrain.train.loss_scale import DynamicLossScale

RTOL = {"fp16": 1e-3, "bf16": 2e-3}
"""16-bit layouts vs one process in the same precision, every step's loss and gradient norm: the
layouts round partial sums to 16 bits in another order (fp16's unit roundoff 2^-11, bf16's 2^-8,
averaged over many elements). Measured at most 2.5e-4 fp16 (4.0x) and 2.4e-4 bf16 (8.5x), FSDP dp2
gradient norm."""
BASE = [
    "recipe=gpt-dp",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "data.max_bytes=1000000",
    "train.precision=fp16",
    "train.eval_every=0",
]
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
    from partrain.blueprint.config.compose import compose

    assert DynamicLossScale.for_run(compose(["train.precision=bf16"]).train) is None
    assert DynamicLossScale.for_run(compose(["train.precision=fp32"]).train) is None
    got = DynamicLossScale.for_run(compose(["train.precision=fp16", "train.loss_scale_init=1024"]).train)
    assert got.scale == 1024.0 and got.window == 1000


# ---- through the trainer ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


LAYOUTS = [
    ("fsdp-dp2-zero3-fp16", "fp16", BASE + DP2_ZERO3),
    ("fsdp-dp2-zero3-bf16", "bf16", BASE + DP2_ZERO3 + ["train.precision=bf16"]),
    # The pipeline scales its loss inside the schedule: pp2 on 2 processes covers that path.
    (
        "pp2-1f1b-fp16",
        "fp16",
        [
            "recipe=gpt-3d",
            "parallel.dp=1",
            "parallel.tp=1",
            "parallel.pp=2",
            "cluster.devices_per_node=2",
            "train.precision=fp16",
            "train.seq_len=64",
            "data.max_bytes=1000000",
            "train.eval_every=0",
        ],
    ),
]
"""(name, precision, overrides): each against the one-process run of the same precision."""
OVERFLOW = BASE + DP2_ZERO3 + ["train.loss_scale_init=4194304", "checkpoint.every_steps=4"]
"""A loss scale of 2**22 overflows this model's fp16 backward: the first steps are skipped."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """The 16-bit layouts with their references (4 steps) and the overflowing run (8 steps), trained
    once per module through the worker's code; the runs of one process count share a launch."""
    cache = [f"data.cache_dir={data_cache}"]
    cases = {"overflow": parity_args(OVERFLOW + cache, 8)}
    for name, _, layout in LAYOUTS:
        cases[f"reference-{name}"] = parity_args(reference_overrides(layout + cache), 4)
        cases[name] = parity_args(layout + cache, 4)
    return train_all(cases, tmp_path_factory.mktemp("runs"))


@pytest.mark.slow
@pytest.mark.parametrize("name, precision, layout", LAYOUTS, ids=[name for name, _, _ in LAYOUTS])
def test_16_bit_layouts_match_the_one_process_run(name, precision, layout, runs):
    reference, got = runs[f"reference-{name}"], runs[name]
    diffs = check_parity(reference, got, rtol=RTOL[precision])
    print(f"{name}: {diffs}")
    records = _records(got.run_dir)
    if precision == "fp16":
        assert all(r["loss_scale"] == 65536.0 and not r["skipped"] for r in records)
    else:
        assert all("loss_scale" not in r for r in records)
    assert got.losses[-1] < got.losses[0]


def _fsdp_dtypes(rank: int, world: int, precision: str) -> dict:
    """Inside a rank: what dtype a FSDP layer computes with, and what it keeps."""
    import torch

    from partrain.blueprint.config.schema import OptimConfig
    from partrain.blueprint.layout import Layout
    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.loss import forward_loss
    from partrain.models.materialize import materialize
    from partrain.parallel import data_parallel
    from partrain.runtime.mesh import build_mesh
    from partrain.simulate.measure import model_config

    mesh = build_mesh(Layout(dp=2, dp_shard=2), "cpu")
    mc = model_config("gpt2-tiny")
    model = build_meta_model(mc)
    adapter = get_adapter(model)
    data_parallel.apply_fsdp(model, adapter, mesh, 3, precision)
    materialize(model, mc, seed=3, device="cpu")
    dp = data_parallel.wrap(model, mesh, 3, OptimConfig())
    seen = {}
    proj = model.transformer.h[0].attn.c_attn

    def record(module, args):
        seen.setdefault("compute", str(module.weight.dtype))

    proj.register_forward_pre_hook(record)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    forward_loss(dp.module, x, x).backward()
    p = model.transformer.h[0].attn.c_attn.weight
    return {
        "compute": seen["compute"],
        "param": str(p.dtype),
        "grad": str(p.grad.dtype),
        "grad_placements": str(p.grad.placements),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "precision, compute", [("bf16", "torch.bfloat16"), ("fp16", "torch.float16"), ("fp32", "torch.float32")]
)
def test_fsdp_computes_in_16_bits_and_keeps_fp32_shards(precision, compute, tmp_path):
    from partrain.runtime.spawn import run_spawned

    for got in run_spawned(_fsdp_dtypes, 2, tmp_path, precision):
        assert got["compute"] == compute
        assert got["param"] == "torch.float32" and got["grad"] == "torch.float32"
        assert "Shard(dim=0)" in got["grad_placements"]


@pytest.mark.slow
def test_overflowing_steps_are_skipped_everywhere_and_the_scale_survives_a_checkpoint(runs, tmp_path, data_cache):
    first = runs["overflow"].run_dir
    records = _records(first)
    skipped = [r["step"] for r in records if r["skipped"]]
    # Each skipped step halves the scale, then it trains.
    assert skipped[:3] == [1, 2, 3] and len(skipped) < 7, skipped
    for r, nxt in zip(records, records[1:]):
        assert nxt["loss_scale"] == (r["loss_scale"] / 2 if r["skipped"] else r["loss_scale"])
    taken = [r for r in records if not r["skipped"]]
    assert taken[-1]["loss"] < taken[0]["loss"]

    resumed = tmp_path / "resumed"  # through `partrain train` itself
    overrides = OVERFLOW + [f"data.cache_dir={data_cache}"]
    run_training(overrides + [f"checkpoint.resume={first / 'checkpoints' / 'step-00000004'}"], resumed, 8)
    again = {r["step"]: r for r in _records(resumed)}
    straight = {r["step"]: r for r in records}
    assert sorted(again) == [5, 6, 7, 8]
    for step in again:
        assert again[step]["loss_scale"] == straight[step]["loss_scale"]
        assert again[step]["skipped"] == straight[step]["skipped"]
        assert abs(again[step]["loss"] - straight[step]["loss"]) <= 1e-6 * abs(straight[step]["loss"])
