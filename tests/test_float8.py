"""float8 training (train.float8, torchao) for real on CPU: the one-process float8 run tracks bf16
for 30 steps, FSDP under float8 tracks one process under float8, a float8 checkpoint resumes
exactly and exports plain weights, and what float8 cannot do is refused (exit 2). The runs of one
process count share a launch (testing.in_process.train_all)."""

from __future__ import annotations

import math

import pytest

from partrain.testing.in_process import train_all
from partrain.testing.parity import max_relative_difference, parity_args, reference_overrides

pytestmark = pytest.mark.slow

STEPS = 30
SHORT = 10
"""Steps of the runs that check a composition (pp, recompute, compile, ZeRO-1, sp) against the first
SHORT steps of the one-process float8 run."""
BASE = [
    "recipe=llama-fsdp-tp",
    "parallel.tp=1",
    "parallel.tp_sequence_parallel=false",
    "train.precision=bf16",
    "train.seq_len=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=4",
    "data.max_bytes=1000000",
    "optim.warmup_steps=0",
    "optim.schedule=constant",  # a run saved at step 2 resumes on the same learning rates
]
FLOAT8 = BASE + ["train.float8=true"]
ONE = ["parallel.dp=1", "parallel.zero_stage=0", "cluster.devices_per_node=1"]
FSDP2 = ["parallel.dp=2", "parallel.zero_stage=3", "cluster.devices_per_node=2"]
PP2_RECOMPUTE = ["parallel.dp=1", "parallel.pp=2", "parallel.zero_stage=0", "parallel.recompute=full"]
PP2_RECOMPUTE += ["cluster.devices_per_node=2"]
ZERO1_16BIT = ["parallel.dp=2", "parallel.zero_stage=1", "train.param_dtype=16bit", "cluster.devices_per_node=2"]
SP2 = ["parallel.dp=1", "parallel.sp=2", "parallel.zero_stage=0", "cluster.devices_per_node=2"]
COMPILE = ["train.compile=true", "train.compile_backend=aot_eager"]

BF16_TRACKING_RTOL = 0.03
"""The issue's bound: float8 loss within 3% of bf16's at every one of the 30 steps."""
LAYOUT_RTOL = 5e-3
"""A layout vs one process, both float8, every step. Not bit-exact: FSDP computes norms and residuals
with its bf16 parameters where one process autocasts fp32 ones (bf16 alone, the same two layouts:
2e-5 at step 1, 8.5e-4 over 30 steps), and float8 turns such small differences into whole e4m3 steps
(3 mantissa bits: 6%) for the elements they push across a rounding boundary. Measured (FSDP dp2, with
torchao's float8 all-gather): 3.4e-4 at step 1, at most 1.9e-3 over 30 steps."""
FIRST_STEP_RTOL = 1e-3
"""Step 1, before the runs' weights diverge (measured 3.4e-4)."""


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    pytest.importorskip("torchao")
    common = [f"data.cache_dir={data_cache}"]
    cases = {
        "bf16": parity_args(reference_overrides(BASE + ONE + common), STEPS),
        "float8": parity_args(reference_overrides(FLOAT8 + ONE + common), STEPS),
        "float8-rowwise": parity_args(
            reference_overrides(FLOAT8 + ONE + common + ["train.float8_recipe=rowwise"]), STEPS
        ),
        "float8-fsdp2": parity_args(FLOAT8 + FSDP2 + common, STEPS),
        "float8-pp2-recompute": parity_args(FLOAT8 + PP2_RECOMPUTE + common, SHORT),
        "float8-compile": parity_args(reference_overrides(FLOAT8 + ONE + common + COMPILE), SHORT),
        "float8-zero1-16bit": parity_args(FLOAT8 + ZERO1_16BIT + common, SHORT),
        "float8-sp2": parity_args(FLOAT8 + SP2 + common, SHORT),
        "float8-fsdp2-saved": parity_args(FLOAT8 + FSDP2 + common + ["checkpoint.every_steps=2"], 2),
    }
    return train_all(cases, tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("name", ["float8", "float8-rowwise"])
def test_float8_loss_tracks_bf16(name, runs):
    got, bf16 = runs[name], runs["bf16"]
    diff = max_relative_difference(bf16.losses, got.losses)
    print(name, f"max relative loss difference vs bf16 over {STEPS} steps: {diff:.2e}")
    assert diff < BF16_TRACKING_RTOL
    assert got.losses != bf16.losses  # float8 really ran
    assert got.losses[-1] < got.losses[0]


def test_float8_fsdp_tracks_one_process(runs):
    diff = max_relative_difference(runs["float8"].losses, runs["float8-fsdp2"].losses)
    print(f"float8 FSDP dp2 vs one process: max relative loss difference {diff:.2e}")
    first = runs["float8"].losses[0], runs["float8-fsdp2"].losses[0]
    assert math.isclose(*first, rel_tol=FIRST_STEP_RTOL), first
    assert diff < LAYOUT_RTOL


def test_float8_composes_with_pipeline_and_recompute(runs):
    """pp2 with full recompute: step 1 exact (the same microbatches, the same float8 scales; recompute
    alone is bit-exact, measured), later steps within LAYOUT_RTOL (measured 6.9e-5 over 10 steps,
    1.5e-3 over 30; bf16, the same layouts: 1.6e-4 over 30, which float8's coarser rounding amplifies)."""
    ref, got = runs["float8"].losses[:SHORT], runs["float8-pp2-recompute"].losses
    diff = max_relative_difference(ref, got)
    print(f"float8 pp2 + recompute vs one process: max relative loss difference {diff:.2e}")
    assert math.isclose(ref[0], got[0], rel_tol=1e-6), (ref[0], got[0])
    assert diff < LAYOUT_RTOL


@pytest.mark.parametrize("name", ["float8-zero1-16bit", "float8-sp2"])
def test_float8_composes_with_zero1_16bit_parameters_and_sequence_parallel(name, runs):
    """ZeRO-1 with bf16 parameters (param_dtype=16bit) and Ulysses sp2: measured 8.3e-4 and 1.2e-3 over
    10 steps (3.5e-3 and 8.3e-3 over 30)."""
    diff = max_relative_difference(runs["float8"].losses[:SHORT], runs[name].losses)
    print(f"{name} vs one process float8: max relative loss difference {diff:.2e}")
    assert diff < LAYOUT_RTOL


def test_float8_composes_with_compile(runs):
    """torch.compile (aot_eager: the trace without C++ code generation) of float8 blocks: measured bit-exact."""
    assert max_relative_difference(runs["float8"].losses[:SHORT], runs["float8-compile"].losses) < 1e-6


def test_float8_log_counts_converted_linears(runs):
    """7 projections in each of the 4 layers converted; the head excluded."""
    logs = "".join(p.read_text() for p in (runs["float8"].run_dir / "logs").glob("*"))
    assert "float8: 28 linear layers converted, 0 skipped" in logs and "1 excluded" in logs, logs[-2000:]


def test_a_float8_fsdp_checkpoint_resumes_exactly_and_exports_plain_weights(runs, data_cache, tmp_path):
    """Saved at step 2 under FSDP dp2 (weights wrapped for torchao's float8 all-gather), resumed under
    FSDP dp2 for step 3: the uninterrupted run's loss; the checkpoint loads as a plain HF model."""
    import torch

    from partrain.checkpoint.export import load_model_weights

    saved = runs["float8-fsdp2-saved"].run_dir / "checkpoints" / "step-00000002"
    common = [f"data.cache_dir={data_cache}"]
    args = parity_args(FLOAT8 + FSDP2 + common + [f"checkpoint.resume={saved}"], 3)
    resumed = train_all({"float8-resumed": args}, tmp_path)["float8-resumed"]
    assert len(resumed.losses) == 1, resumed.losses
    assert math.isclose(resumed.losses[0], runs["float8-fsdp2"].losses[2], rel_tol=1e-6)
    model, _ = load_model_weights(saved)
    assert {p.dtype for p in model.parameters()} <= {torch.float32, torch.bfloat16}
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear


@pytest.mark.parametrize(
    "overrides, key",
    [
        (FLOAT8 + ["train.precision=fp32"], "train.precision"),
        (FLOAT8 + ["train.precision=fp16"], "train.precision"),
        (FLOAT8 + ["parallel.tp=2", "parallel.dp=2"], "parallel.tp"),
        (FLOAT8 + ["train.float8_recipe=delayed"], "train.float8_recipe"),
        (FLOAT8 + ["peft=lora", "train.precision=fp32"], "peft.method"),
        (["recipe=mixtral-ep", "train.precision=bf16", "train.float8=true"], "model.arch"),
    ],
)
def test_float8_refuses_what_it_does_not_do(overrides, key):
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose(overrides))
    assert key in [p.key for p in err.value.problems], err.value


def test_the_launch_refuses_float8_without_torchao_or_below_sm89():
    from partrain.blueprint.config.compose import compose
    from partrain.preflight.float8 import float8_problems

    cuda = compose(FLOAT8 + ["cluster.device=cuda", "cluster.backend=nccl"])
    assert [p.key for p in float8_problems(cuda, installed=False, capability=lambda: (9, 0))] == ["train.float8"]
    a100 = float8_problems(cuda, installed=True, capability=lambda: (8, 0))
    assert len(a100) == 1 and "sm80" in a100[0].rule, a100
    assert float8_problems(cuda, installed=True, capability=lambda: (8, 9)) == []
    assert float8_problems(compose(BASE), installed=False) == []  # float8 off: nothing asked


def test_the_planner_times_float8_linears_at_twice_the_bf16_peak():
    """llama3-8b on 8 x H100: float8 shortens compute (the projections at 2x peak, attention's core and
    the head not) and leaves memory as it was (torchao keeps the weights in bf16/fp32)."""
    import dataclasses

    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner import spec_from_validated
    from partrain.blueprint.planner.estimate import estimate_spec
    from partrain.blueprint.validate import validate

    bf16_spec = spec_from_validated(validate(compose(["recipe=llama3-8b-h100"])))
    rowwise, tensorwise = (dataclasses.replace(bf16_spec, float8=r) for r in ("rowwise", "tensorwise"))
    bf16, float8 = estimate_spec(bf16_spec), estimate_spec(rowwise)
    compute = [e["time_breakdown_s"]["compute"] for e in (bf16, float8)]
    print(f"llama3-8b h100x8 step {bf16['step_time_s']:.2f} s bf16, {float8['step_time_s']:.2f} s float8")
    assert compute[0] / 2 < compute[1] < compute[0] * 0.75, compute
    assert float8["memory_bytes"] == bf16["memory_bytes"]  # rowwise: FSDP gathers bf16
    # tensorwise under FSDP: the layers' linear weights all-gathered in float8, half the bytes.
    gathered = estimate_spec(tensorwise)
    ratio = gathered["comm_bytes_per_step"]["dp"] / bf16["comm_bytes_per_step"]["dp"]
    print(f"dp bytes per step, tensorwise float8 all-gather / bf16: {ratio:.3f}")
    assert ratio < 1.0
    spec = spec_from_validated(validate(compose(["recipe=llama3-8b-h100", "train.float8=true"])))
    assert spec.float8 == "tensorwise"


def test_fsdp_weights_are_all_gathered_in_float8():
    """Under FSDP (tensorwise) torchao's float8 all-gather wraps each converted weight; without FSDP not."""
    pytest.importorskip("torchao")
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from partrain.blueprint.config.compose import compose
    from partrain.models.build import build_meta_model
    from partrain.parallel.float8 import apply_float8

    run = compose(FLOAT8)
    for fsdp in (True, False):
        model = build_meta_model(run.model)
        counts = apply_float8(model, run.train, fsdp=fsdp)
        assert len(counts.converted) == 28 and counts.excluded == ["lm_head"]
        weight = model.model.layers[0].mlp.up_proj.weight
        assert isinstance(weight, WeightWithDynamicFloat8CastTensor) == fsdp
