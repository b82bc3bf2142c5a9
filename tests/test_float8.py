"""float8 training (train.float8, torchao) for real on CPU: the one-process float8 run tracks bf16
for 30 steps, FSDP and tensor parallelism (with and without Megatron-SP) under float8 track one
process under float8, MoE models (ep2) and LoRA (tp2) under float8 track their one-process runs, a float8
checkpoint resumes exactly and exports plain weights, and what float8 cannot do is refused (exit 2).
The runs of one process count share a launch
(testing.in_process.train_all)."""

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
TP2 = ["parallel.dp=1", "parallel.tp=2", "parallel.zero_stage=0", "cluster.devices_per_node=2"]
MEGATRON_SP = ["parallel.tp_sequence_parallel=true"]
ROWWISE = ["train.float8_recipe=rowwise"]
MOE = ["recipe=mixtral-ep", "train.precision=bf16", "train.seq_len=64", "data.max_bytes=1000000"]
MOE += ["optim.warmup_steps=0", "optim.schedule=constant"]
"""Tiny Mixtral (4 experts top-2) as the recipe ships it: dp2 x ep2 on 2 processes."""
LORA = ["peft=lora"]
EXTRA_STEPS = 5
"""Steps of the MoE and LoRA runs (issue 39)."""

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
        "float8-tp2": parity_args(FLOAT8 + TP2 + common, SHORT),
        "float8-tp2-megatron-sp": parity_args(FLOAT8 + TP2 + MEGATRON_SP + common, SHORT),
        "float8-rowwise-tp2-megatron-sp": parity_args(FLOAT8 + TP2 + MEGATRON_SP + ROWWISE + common, SHORT),
        "float8-fsdp2-saved": parity_args(FLOAT8 + FSDP2 + common + ["checkpoint.every_steps=2"], 2),
        "moe-bf16": parity_args(reference_overrides(MOE + common), EXTRA_STEPS),
        "float8-moe": parity_args(reference_overrides(MOE + common + ["train.float8=true"]), EXTRA_STEPS),
        "float8-moe-ep2": parity_args(MOE + common + ["train.float8=true"], EXTRA_STEPS),
        "lora": parity_args(reference_overrides(BASE + ONE + common + LORA), EXTRA_STEPS),
        "float8-lora": parity_args(reference_overrides(FLOAT8 + ONE + common + LORA), EXTRA_STEPS),
        "float8-lora-tp2": parity_args(FLOAT8 + TP2 + common + LORA, EXTRA_STEPS),
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
        (FLOAT8 + ["train.float8_recipe=delayed"], "train.float8_recipe"),
        (FLOAT8 + ["peft=lora", "train.precision=fp32"], "train.precision"),
        (MOE + ["train.precision=fp32", "train.float8=true"], "train.precision"),
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
    for fsdp, lora in ((True, False), (False, False), (True, True)):
        model = build_meta_model(run.model)
        counts = apply_float8(model, run.train, fsdp=fsdp, lora=lora)
        assert len(counts.converted) == 28 and counts.excluded == ["lm_head"]
        weight = model.model.layers[0].mlp.up_proj.weight
        # LoRA casts its frozen base itself (float8_tp): FSDP gathers that weight in bf16.
        assert isinstance(weight, WeightWithDynamicFloat8CastTensor) == (fsdp and not lora)


# ---- tensor parallelism ---------------------------------------------------------------------------------
TP_FIRST_STEP_RTOL = 1e-3
"""tp2 (with or without Megatron-SP) vs one process, both float8, the loss of step 1: measured 2.2e-4
tensorwise, 1.3e-4 rowwise."""
TP_FIRST_GRAD_NORM_RTOL = 5e-3
"""The gradient norm of step 1: measured 2.1e-4 tensorwise, 1.5e-3 rowwise (torchao's rowwise matmul
rounds each rank's partial sums to bf16). With each rank's own shard amax instead of the group's:
7.5e-3. Later steps are not compared: under float8 (either layout) the gradient norm of some batches
jumps by 10-50% for weights 1e-3 apart (FSDP dp2 vs one process: 7.8e-3 at step 1, 2.4e-2 at step 9;
tp2: 0.12 at step 9), while the clipped (grad_clip=1) updates and the losses stay within LAYOUT_RTOL."""


@pytest.mark.parametrize(
    "name, reference",
    [
        ("float8-tp2", "float8"),
        ("float8-tp2-megatron-sp", "float8"),
        ("float8-rowwise-tp2-megatron-sp", "float8-rowwise"),
    ],
)
def test_float8_tensor_parallel_tracks_one_process(name, reference, runs):
    """The TP projections cast with the whole tensors' scales (float8_tp: amax all-reduced over tp).
    Not bit-exact: the layers outside the projections (vocabulary-parallel embedding and loss,
    attention on head shards) differ from one process in the last bits, as in bf16 (tp2: 3e-5 at step
    1), and float8's casts amplify that, as FSDP's (LAYOUT_RTOL). Measured over 10 steps: 5.1e-4
    tensorwise, 3.0e-4 + Megatron-SP, 4.5e-4 rowwise + Megatron-SP (over 30: 3.7e-3, 3.1e-3, 4.9e-3;
    dp2 x tp2 under FSDP: 6.1e-4 at step 1, 7.5e-4 over 10, not run here: a 4-process launch)."""
    ref, got = runs[reference], runs[name]
    diff = max_relative_difference(ref.losses[:SHORT], got.losses)
    norm = abs(got.grad_norms[0] - ref.grad_norms[0]) / ref.grad_norms[0]
    print(f"{name} vs one process: max relative loss difference {diff:.2e}, step-1 grad norm {norm:.2e}")
    assert math.isclose(ref.losses[0], got.losses[0], rel_tol=TP_FIRST_STEP_RTOL), (ref.losses[0], got.losses[0])
    assert norm < TP_FIRST_GRAD_NORM_RTOL, (ref.grad_norms[0], got.grad_norms[0])
    assert diff < LAYOUT_RTOL
    logs = "".join(p.read_text() for p in (got.run_dir / "logs").glob("*"))
    assert "float8: 28 linear layers converted, 0 skipped" in logs, logs[-2000:]


def _float8_tp_layers(rank: int, world: int) -> dict:
    """A column-parallel then a row-parallel float8 projection (plain TP, and Megatron-SP's gathered
    column + reduce-scatter) against the same two Float8Linears in one process, with the same
    upstream gradient: {case: {tensor: max relative difference}}."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.float8 import convert_to_float8_training

    from partrain.parallel import megatron_sp
    from partrain.parallel.float8 import float8_config
    from partrain.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear

    class Block(nn.Module):
        def __init__(self, up, down):
            super().__init__()
            self.up, self.down = up, down

        def forward(self, hidden_states):
            return self.down(self.up(hidden_states))

    mesh = init_device_mesh("cpu", (world,))
    hidden, inner = 64, 128
    out: dict = {}
    for recipe in ("tensorwise", "rowwise"):
        for sp in (False, True):
            torch.manual_seed(0)
            ref = Block(nn.Linear(hidden, inner, bias=False), nn.Linear(inner, hidden, bias=False))
            convert_to_float8_training(ref, config=float8_config(recipe))
            block = copy.deepcopy(ref)
            x = torch.randn(2, 16, hidden)
            grad = torch.randn(2, 16, hidden)
            x_ref = x.clone().requires_grad_(True)
            y_ref = ref(x_ref)
            y_ref.backward(grad)
            if sp:
                megatron_sp.install_block(block, ["up"], mesh, conv=False, fused={})
                block.down = RowParallelLinear(block.down, mesh, to_sequence=True)
            else:
                block.up = ColumnParallelLinear(block.up, mesh, copies_input=True)
                block.down = RowParallelLinear(block.down, mesh, to_sequence=False)
            seq = slice(rank * 16 // world, (rank + 1) * 16 // world) if sp else slice(None)
            x_tp = x[:, seq].clone().requires_grad_(True)
            y = block(x_tp)
            y.backward(grad[:, seq])
            cols, rows = (slice(rank * n // world, (rank + 1) * n // world) for n in (inner, inner))

            def rel(a, b):
                return ((a - b).abs().max() / b.abs().max()).item()

            out[f"{recipe}{'-sp' if sp else ''}"] = {
                "output": rel(y, y_ref[:, seq]),
                "input_grad": rel(x_tp.grad, x_ref.grad[:, seq]),
                "up_weight_grad": rel(block.up.weight.grad.to_local(), ref.up.weight.grad[cols]),
                "down_weight_grad": rel(block.down.weight.grad.to_local(), ref.down.weight.grad[:, rows]),
            }
    return out


def test_float8_tp_projections_use_the_whole_tensors_scales(tmp_path):
    """Layer level, 2 processes: given the same upstream gradient, the weight gradients of a column- and
    a row-parallel float8 projection are those of one process (1e-6; measured exact), with and without
    Megatron-SP, tensorwise and rowwise: every sharded operand (weights, the row projection's input,
    the column projection's output gradient) was cast with the whole tensor's scale. Outputs and input
    gradients add partial sums: tensorwise 4e-7 (1e-5 allowed); rowwise within bf16's rounding (torchao's
    rowwise matmul returns bf16 partials: 3e-3 of the largest element)."""
    pytest.importorskip("torchao")
    from partrain.testing.multiproc import run_spawned

    for rank_result in run_spawned(_float8_tp_layers, 2, tmp_path):
        for case, diffs in rank_result.items():
            print(case, {k: f"{v:.1e}" for k, v in diffs.items()})
            assert diffs["up_weight_grad"] < 1e-6 and diffs["down_weight_grad"] < 1e-6, (case, diffs)
            bound = 1e-5 if case.startswith("tensorwise") else 2**-7
            assert diffs["output"] < bound and diffs["input_grad"] < bound, (case, diffs)


def test_float8_under_tp_converts_only_linears_whose_shards_stay_multiples_of_16():
    """tp=4 on llama-tiny: k/v (64 wide) split to 16 still convert; at tp=8 they would be 8 wide."""
    pytest.importorskip("torchao")
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from partrain.blueprint.config.compose import compose
    from partrain.models.build import build_meta_model
    from partrain.parallel.float8 import apply_float8

    run = compose(FLOAT8)
    assert len(apply_float8(build_meta_model(run.model), run.train, tp=4).converted) == 28
    model = build_meta_model(run.model)
    counts = apply_float8(model, run.train, fsdp=True, tp=8)
    assert len(counts.converted) == 20 and len(counts.skipped_dims) == 8, counts.line()
    assert "not divisible by 128" in counts.line()
    # Under tp FSDP gathers bf16: torchao's float8 all-gather wrapper is not a TP shard.
    assert not isinstance(model.model.layers[0].mlp.up_proj.weight, WeightWithDynamicFloat8CastTensor)


def test_the_planner_counts_float8_under_tensor_parallelism():
    """llama3-70b on 64 H100 (tp8 x pp4 x dp2, Megatron-SP, ZeRO-2): validates with float8 (tp is no longer
    refused), the projections' compute at the float8 peak, FSDP's bytes unchanged (no float8 all-gather
    under tp)."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner import spec_from_validated
    from partrain.blueprint.planner.estimate import estimate_spec
    from partrain.blueprint.validate import validate

    bf16 = estimate_spec(spec_from_validated(validate(compose(["recipe=llama3-70b-h100"]))))
    float8 = estimate_spec(spec_from_validated(validate(compose(["recipe=llama3-70b-h100", "train.float8=true"]))))
    compute = [e["time_breakdown_s"]["compute"] for e in (bf16, float8)]
    print(f"llama3-70b h100x64 tp8 step {bf16['step_time_s']:.2f} s bf16, {float8['step_time_s']:.2f} s float8")
    assert compute[0] / 2 < compute[1] < compute[0] * 0.75, compute
    assert float8["comm_bytes_per_step"]["dp"] == bf16["comm_bytes_per_step"]["dp"]


# ---- MoE models and LoRA (issue 39) ---------------------------------------------------------------------
def test_float8_moe_converts_attention_and_shared_experts_only():
    """Attention's projections (and Qwen2-MoE's shared expert) convert; the routed experts (fused tensors)
    and the routers stay in high precision, counted in the log line; expert parallelism, applied later,
    re-makes the experts from the untouched HF module."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from partrain.blueprint.config.compose import compose
    from partrain.models.build import build_meta_model
    from partrain.parallel.float8 import apply_float8

    for model_name, converted in (("mixtral-tiny", 8), ("qwen2-moe-tiny", 14), ("qwen3-moe-tiny", 8)):
        run = compose(MOE + ["train.float8=true", f"model={model_name}"])
        model = build_meta_model(run.model)
        counts = apply_float8(model, run.train)
        assert len(counts.converted) == converted and not counts.skipped_dims, (model_name, counts.line())
        assert "2 routed experts and 2 routers kept in high precision" in counts.line(), counts.line()
        for layer in model.model.layers:
            assert not any(isinstance(m, Float8Linear) for m in layer.mlp.experts.modules())
            assert not isinstance(layer.mlp.gate, Float8Linear)
            assert isinstance(layer.self_attn.q_proj, Float8Linear)


def test_float8_moe_tracks_bf16_and_expert_parallel_tracks_one_process(runs):
    """Mixtral-tiny float8, one process vs bf16: measured 4.3e-4 over 10 steps (BF16_TRACKING_RTOL); dp2 x ep2
    vs one process, both float8: step 1 loss and gradient norm exact (the experts are bf16 and the
    converted attention sees the same tokens), measured 7.6e-5 over 10 steps (LAYOUT_RTOL)."""
    bf16, one, ep2 = runs["moe-bf16"], runs["float8-moe"], runs["float8-moe-ep2"]
    tracking = max_relative_difference(bf16.losses, one.losses)
    layout = max_relative_difference(one.losses, ep2.losses)
    print(f"float8 MoE vs bf16 {tracking:.2e}; float8 ep2 vs one process {layout:.2e}")
    assert one.losses != bf16.losses and tracking < BF16_TRACKING_RTOL
    assert math.isclose(one.losses[0], ep2.losses[0], rel_tol=FIRST_STEP_RTOL)
    assert math.isclose(one.grad_norms[0], ep2.grad_norms[0], rel_tol=FIRST_STEP_RTOL)
    assert layout < LAYOUT_RTOL
    logs = "".join(p.read_text() for p in (ep2.run_dir / "logs").glob("*"))
    assert "float8: 8 linear layers converted" in logs and "2 routed experts and 2 routers kept" in logs


def test_float8_lora_tracks_lora_bf16_and_tp2_tracks_one_process(runs):
    """LoRA's frozen base in float8, adapters bf16: vs LoRA bf16 measured 1.7e-3 over 10 steps
    (BF16_TRACKING_RTOL); tp2 (the base's TP float8 matmuls, amax all-reduced) vs one process: 3.5e-4 over
    10 steps, step-1 gradient norm 1e-5 (LAYOUT_RTOL, TP_FIRST_GRAD_NORM_RTOL)."""
    bf16, one, tp2 = runs["lora"], runs["float8-lora"], runs["float8-lora-tp2"]
    tracking = max_relative_difference(bf16.losses, one.losses)
    layout = max_relative_difference(one.losses, tp2.losses)
    norm = abs(tp2.grad_norms[0] - one.grad_norms[0]) / one.grad_norms[0]
    print(f"float8 LoRA vs LoRA bf16 {tracking:.2e}; tp2 vs one process {layout:.2e}, grad norm {norm:.2e}")
    assert one.losses != bf16.losses and tracking < BF16_TRACKING_RTOL  # != : the base really ran in float8
    assert layout < LAYOUT_RTOL and norm < TP_FIRST_GRAD_NORM_RTOL


def test_the_planner_counts_only_converted_moe_linears():
    """An MoE layer's float8 linears are attention's projections and the shared expert, not the routed
    experts nor the router: its compute gains less than a dense layer's."""
    import dataclasses

    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner import spec_from_validated
    from partrain.blueprint.planner.estimate import estimate_spec
    from partrain.blueprint.planner.flops import attention_proj_macs
    from partrain.blueprint.planner.step_inputs import float8_linear_macs
    from partrain.blueprint.validate import validate

    cuda = ["cluster.device=cuda", "cluster.backend=nccl"]
    for model_name, shared in (("mixtral-tiny", False), ("qwen2-moe-tiny", True)):
        spec = spec_from_validated(validate(compose(MOE + cuda + [f"model={model_name}"])))
        attention = attention_proj_macs(spec.facts)
        assert (float8_linear_macs(spec, True) > attention) == shared
        bf16, float8 = (estimate_spec(dataclasses.replace(spec, float8=r)) for r in ("", "tensorwise"))
        compute = [e["time_breakdown_s"]["compute"] for e in (bf16, float8)]
        assert compute[0] / 2 < compute[1] < compute[0], (model_name, compute)
