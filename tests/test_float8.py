"""float8 training (train.float8, torchao) for real on CPU: the one-process float8 run tracks bf16,
FSDP, ZeRO-1, sequence, pipeline and tensor parallelism (with and without Megatron-SP) under float8
track one process under float8, MoE models (ep2) and LoRA (tp2) under float8 track their one-process
runs, a float8 checkpoint resumes exactly and exports plain weights, and what float8 cannot do is
refused (exit 2). The runs of one process count share a launch (testing.in_process.train_all).

How the runs are compared, so that the checks hold on any machine:
- What can be exact is compared exactly (1e-6): the same quantized operands give the same result
  (torch.compile's trace, recompute under the same microbatches at step 1, a resume), and one TP
  layer's weight gradients from the same upstream gradient (the layer-level test below).
- Everything else is bounded by float8's own effect, measured in the same run (`float8_noise`,
  NOISE_FACTOR): a layout's float8 run and one process's differ by last bits before each cast
  (reduction order, FSDP's bf16 parameters against autocast's fp32 ones), and float8 turns a
  last-bit difference into a whole e4m3 step (3 mantissa bits: up to 6 %) for every element it
  pushes across a rounding boundary. How often that happens depends on the CPU's kernels and thread
  count, for the layout and for the noise alike: a fixed tolerance measured on one machine failed on
  another (issue 50: 9.2e-3 against 5e-3).
- Step 1's gradient norm is held to GRAD_NORM_RTOL, half an e4m3 step, which a real fault exceeds.

The model is llama-tiny at the smallest widths that still convert under tp2 (every shard a multiple of
16): torch's CPU float8 matmul (_scaled_mm) is a naive kernel, about 1,000x a bf16 one, so float8 costs
what its matmuls multiply."""

from __future__ import annotations

import math

import pytest

from partrain.rehearse.runs import train_all
from partrain.testing.parity import max_relative_difference, parity_args, reference_overrides

pytestmark = pytest.mark.slow

STEPS = 10
"""Steps of every run: float8's deviation from bf16 and a layout's from one process both grow with the
steps (the runs' weights drift apart); 10 steps show both clearly at a 64-token step."""
BASE = [
    "recipe=llama-fsdp-tp",
    "parallel.tp=1",
    "parallel.tp_sequence_parallel=false",
    "train.precision=bf16",
    "data.max_bytes=1000000",
    "optim.warmup_steps=0",
    "optim.schedule=constant",  # a run saved at step 2 resumes on the same learning rates
]
"""llama-tiny at its shipped widths: the meta-model tests below count its 28 converted linears."""
SMALL = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=2",
    "model.config.num_key_value_heads=2",
    "train.seq_len=32",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",
]
"""What the training runs use: widths 32 and 64, heads of 16 (under tp2 every shard is 16 or 32 wide and
still converts), two layers (pp2), 64 tokens a step."""
CONVERTED = "float8: 14 linear layers converted, 0 skipped"
"""7 projections in each of the 2 layers; the head excluded."""
FLOAT8 = BASE + SMALL + ["train.float8=true"]
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
MOE = ["recipe=mixtral-ep", "train.precision=bf16", "data.max_bytes=1000000"]
MOE += ["optim.warmup_steps=0", "optim.schedule=constant"]
MOE += [o for o in SMALL if "layers" not in o and "key_value" not in o]
"""Tiny Mixtral (4 experts top-2, 2 layers) at the same widths: dp2 x ep2 on 2 processes."""
LORA = ["peft=lora"]

BF16_TRACKING_RTOL = 0.03
"""Issue 39's bound: float8 loss within 3% of bf16's at every step. Measured at most 6.9e-4 over 10
steps (13 seeds, both recipes, llama, Mixtral and LoRA): a margin of 43x."""
NOISE_FACTOR = 6.0
"""A layout's float8 losses vs one process's, every step, relative to `float8_noise`. Two float8 runs
whose inputs differ in last bits round some elements to neighbouring e4m3 values: at worst their
quantization errors are independent, each the size of float8's own effect on a run, so the gap is of
that order (sqrt(2) for independent errors of one size), times chance: the noise is measured on a
few runs too, and a small draw makes the ratio large. Measured (10 steps, 10 seeds; 1 and 2 threads
gave identical runs): at most 1.47 (tensorwise FSDP), then sp2 1.08, tp2 1.01-1.12, Mixtral ep2 1.29
(its noise has one pair): a margin of 4.1x. With the noise from the two recipes alone the ratio
reached 1.63 over 16 seeds, and its largest value grew with the seeds tried (0.65 over the first 6):
hence two more pairs in the noise and a factor well above the ratios seen. ZeRO-1 with bf16
parameters is compared with one process in bf16 parameters (against fp32 parameters it is a
precision difference, not last bits): 4.6e-8, 1e-4 of the noise."""
GRAD_NORM_RTOL = 2**-4
"""A layout's step-1 gradient norm vs one process's (the same weights, both float8): half an e4m3
rounding step (3 mantissa bits). A real fault exceeds it (a missing average: 2x; a shard's own scale
instead of the whole tensor's: its elements off by whole steps); a finer one is the layer-level
test's (test_float8_tp_projections_use_the_whole_tensors_scales: exact). Not scaled by float8's own
step-1 gradient-norm error like the losses: that single number can cancel (float8 vs bf16 measured
1.5e-4 to 7.2e-3 by seed) and the ratio reached 1.6. Measured: at most 5.3e-3 (LoRA tp2; 13 seeds,
every layout), a margin of 12x."""

LAYOUTS = {
    # name: (overrides, the one-process run it is compared with)
    "float8-fsdp2": (FLOAT8 + FSDP2, "float8"),
    "float8-rowwise-fsdp2": (FLOAT8 + FSDP2 + ROWWISE, "float8-rowwise"),
    "float8-zero1-16bit": (FLOAT8 + ZERO1_16BIT, "float8-16bit"),
    "float8-sp2": (FLOAT8 + SP2, "float8"),
    "float8-pp2-recompute": (FLOAT8 + PP2_RECOMPUTE, "float8"),
    "float8-tp2": (FLOAT8 + TP2, "float8"),
    "float8-tp2-megatron-sp": (FLOAT8 + TP2 + MEGATRON_SP, "float8"),
    "float8-rowwise-tp2-megatron-sp": (FLOAT8 + TP2 + MEGATRON_SP + ROWWISE, "float8-rowwise"),
}
"""Every float8 layout compared with one process under the same recipe (and, for ZeRO-1 with bf16
parameters, one process with bf16 parameters: the layout then differs only in last bits)."""


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    pytest.importorskip("torchao")
    common = [f"data.cache_dir={data_cache}"]
    cases = {
        "bf16": reference_overrides(BASE + SMALL + ONE + common),
        "float8": reference_overrides(FLOAT8 + ONE + common),
        "float8-rowwise": reference_overrides(FLOAT8 + ONE + common + ROWWISE),
        "float8-compile": reference_overrides(FLOAT8 + ONE + common + COMPILE),
        "float8-16bit": reference_overrides(FLOAT8 + ONE + common + ["train.param_dtype=16bit"]),
        "float8-rowwise-16bit": reference_overrides(FLOAT8 + ONE + common + ROWWISE + ["train.param_dtype=16bit"]),
        "moe-bf16": reference_overrides(MOE + common),
        "float8-moe": reference_overrides(MOE + common + ["train.float8=true"]),
        "float8-moe-ep2": MOE + common + ["train.float8=true"],
        "lora": reference_overrides(BASE + SMALL + ONE + common + LORA),
        "float8-lora": reference_overrides(FLOAT8 + ONE + common + LORA),
        "float8-lora-tp2": FLOAT8 + TP2 + common + LORA,
        **{name: overrides + common for name, (overrides, _) in LAYOUTS.items()},
    }
    cases = {name: parity_args(overrides, STEPS) for name, overrides in cases.items()}
    cases["float8-fsdp2-saved"] = parity_args(FLOAT8 + FSDP2 + common + ["checkpoint.every_steps=2"], 2)
    return train_all(cases, tmp_path_factory.mktemp("runs"))


def float8_noise(runs, pairs) -> float:
    """float8's own effect on the loss in these runs: the largest relative difference, over every step
    and every (a, b) run pair in `pairs`, one process each. The pairs: bf16 vs float8 under each recipe
    (what quantization does to a run), and float8 with fp32 parameters vs float8 with bf16 ones (what a
    change below bf16's last bit becomes under float8: the phenomenon a layout shows). Several pairs,
    because one is a single draw and can be small by chance."""
    return max(max_relative_difference(runs[a].losses, runs[b].losses) for a, b in pairs)


LLAMA_NOISE = (
    ("bf16", "float8"),
    ("bf16", "float8-rowwise"),
    ("float8", "float8-16bit"),
    ("float8-rowwise", "float8-rowwise-16bit"),
)


def assert_tracks_within_noise(got, ref, noise: float, label: str) -> None:
    """`got` (a layout) vs `ref` (one process, the same float8 recipe): every step's loss within
    NOISE_FACTOR times float8's own effect, step 1's gradient norm within GRAD_NORM_RTOL, and float8
    really ran in `got`."""
    loss = max_relative_difference(ref.losses, got.losses)
    norm = abs(got.grad_norms[0] - ref.grad_norms[0]) / ref.grad_norms[0]
    print(f"{label} vs one process: loss {loss:.2e} = {loss / noise:.2f} x float8's {noise:.2e}; grad norm {norm:.2e}")
    assert loss <= NOISE_FACTOR * noise, (label, got.losses, ref.losses)
    assert norm <= GRAD_NORM_RTOL, (label, got.grad_norms, ref.grad_norms)
    logs = "".join(p.read_text() for p in (got.run_dir / "logs").glob("*"))
    assert "float8: " in logs and " linear layers converted" in logs, logs[-2000:]


@pytest.mark.parametrize("name", ["float8", "float8-rowwise"])
def test_float8_loss_tracks_bf16(name, runs):
    got, bf16 = runs[name], runs["bf16"]
    diff = max_relative_difference(bf16.losses, got.losses)
    print(name, f"max relative loss difference vs bf16 over {STEPS} steps: {diff:.2e}")
    assert diff < BF16_TRACKING_RTOL
    assert got.losses != bf16.losses  # float8 really ran
    assert got.losses[-1] < got.losses[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_float8_layout_tracks_one_process(name, runs):
    """FSDP dp2 (tensorwise with torchao's float8 all-gather, rowwise gathering bf16), ZeRO-1 with bf16
    parameters, Ulysses sp2, pp2 with full recompute, tp2 with and without Megatron-SP: within
    NOISE_FACTOR of float8's own effect (float8_noise)."""
    overrides, reference = LAYOUTS[name]
    noise = float8_noise(runs, LLAMA_NOISE)
    assert_tracks_within_noise(runs[name], runs[reference], noise, name)
    logs = "".join(p.read_text() for p in (runs[name].run_dir / "logs").glob("*"))
    # A pipeline stage converts its own layer's 7 projections.
    assert (CONVERTED if "pp2" not in name else "float8: 7 linear layers converted, 0 skipped") in logs, logs[-2000:]


def test_float8_pipeline_with_recompute_is_exact_at_step_1(runs):
    """pp2 with full recompute, step 1: the same microbatches through the same layers with the same
    float8 scales (recompute replays the forward exactly): one process's loss to 1e-6."""
    ref, got = runs["float8"].losses[0], runs["float8-pp2-recompute"].losses[0]
    assert math.isclose(ref, got, rel_tol=1e-6), (ref, got)


def test_float8_composes_with_compile(runs):
    """torch.compile (aot_eager: the trace without C++ code generation) of float8 blocks runs the same
    kernels on the same operands: the eager run's losses to 1e-6."""
    assert max_relative_difference(runs["float8"].losses, runs["float8-compile"].losses) < 1e-6


def test_float8_log_counts_converted_linears(runs):
    logs = "".join(p.read_text() for p in (runs["float8"].run_dir / "logs").glob("*"))
    assert CONVERTED in logs and "1 excluded" in logs, logs[-2000:]


def test_a_float8_fsdp_checkpoint_resumes_exactly_and_exports_plain_weights(runs, data_cache, tmp_path):
    """Saved at step 2 under FSDP dp2 (weights wrapped for torchao's float8 all-gather), resumed under
    FSDP dp2 for step 3: the uninterrupted run's loss (the same layout, the same operands: 1e-6); the
    checkpoint loads as a plain HF model."""
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

    run = compose(BASE + ["train.float8=true"])  # llama-tiny at its shipped widths
    for fsdp, lora in ((True, False), (False, False), (True, True)):
        model = build_meta_model(run.model)
        counts = apply_float8(model, run.train, fsdp=fsdp, lora=lora)
        assert len(counts.converted) == 28 and counts.excluded == ["lm_head"]
        weight = model.model.layers[0].mlp.up_proj.weight
        # LoRA casts its frozen base itself (float8_tp): FSDP gathers that weight in bf16.
        assert isinstance(weight, WeightWithDynamicFloat8CastTensor) == (fsdp and not lora)


# ---- tensor parallelism ---------------------------------------------------------------------------------
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


ROWWISE_PARTIALS_RTOL = 2**-6
"""Rowwise TP outputs and input gradients vs one process, relative to the largest element: torchao's
rowwise matmul returns bf16, so each rank's partial sum is rounded to bf16 before the TP sum, and one
process rounds its whole product once. Four roundings of at most bf16's unit roundoff u = 2^-8 (two
partials, their sum, the reference): 4u. Measured at most 4.7e-3 (1.2u; seeds 0-3, 1-2 threads):
a margin of 3.3x. (It was 2^-7, a margin of 1.7x.)"""


def test_float8_tp_projections_use_the_whole_tensors_scales(tmp_path):
    """Layer level, 2 processes: given the same upstream gradient, the weight gradients of a column- and
    a row-parallel float8 projection are those of one process (1e-6; measured exact), with and without
    Megatron-SP, tensorwise and rowwise: every sharded operand (weights, the row projection's input,
    the column projection's output gradient) was cast with the whole tensor's scale. Outputs and input
    gradients add partial sums: tensorwise in fp32 (1e-5 allowed; measured 4.2e-7 at most, seeds 0-3,
    1-2 threads: 24x); rowwise within ROWWISE_PARTIALS_RTOL."""
    pytest.importorskip("torchao")
    from partrain.runtime.spawn import run_spawned

    for rank_result in run_spawned(_float8_tp_layers, 2, tmp_path):
        for case, diffs in rank_result.items():
            print(case, {k: f"{v:.1e}" for k, v in diffs.items()})
            assert diffs["up_weight_grad"] < 1e-6 and diffs["down_weight_grad"] < 1e-6, (case, diffs)
            bound = 1e-5 if case.startswith("tensorwise") else ROWWISE_PARTIALS_RTOL
            assert diffs["output"] < bound and diffs["input_grad"] < bound, (case, diffs)


def test_float8_under_tp_converts_only_linears_whose_shards_stay_multiples_of_16():
    """tp=4 on llama-tiny: k/v (64 wide) split to 16 still convert; at tp=8 they would be 8 wide."""
    pytest.importorskip("torchao")
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from partrain.blueprint.config.compose import compose
    from partrain.models.build import build_meta_model
    from partrain.parallel.float8 import apply_float8

    run = compose(BASE + ["train.float8=true"])  # llama-tiny at its shipped widths
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
    """Mixtral-tiny float8, one process vs bf16 (BF16_TRACKING_RTOL); dp2 x ep2 vs one process, both float8,
    within NOISE_FACTOR of float8's own effect on this model (the experts stay bf16; the converted
    attention sees the same tokens)."""
    bf16, one, ep2 = runs["moe-bf16"], runs["float8-moe"], runs["float8-moe-ep2"]
    tracking = max_relative_difference(bf16.losses, one.losses)
    print(f"float8 MoE vs bf16 {tracking:.2e}")
    assert one.losses != bf16.losses and tracking < BF16_TRACKING_RTOL
    assert_tracks_within_noise(ep2, one, float8_noise(runs, [("moe-bf16", "float8-moe")]), "float8-moe-ep2")
    logs = "".join(p.read_text() for p in (ep2.run_dir / "logs").glob("*"))
    assert "float8: 8 linear layers converted" in logs and "2 routed experts and 2 routers kept" in logs, logs[-2000:]


def test_float8_lora_tracks_lora_bf16_and_tp2_tracks_one_process(runs):
    """LoRA's frozen base in float8, adapters bf16, vs LoRA bf16 (BF16_TRACKING_RTOL); tp2 (the base's TP
    float8 matmuls, amax all-reduced) vs one process within NOISE_FACTOR of float8's own effect on LoRA."""
    bf16, one, tp2 = runs["lora"], runs["float8-lora"], runs["float8-lora-tp2"]
    tracking = max_relative_difference(bf16.losses, one.losses)
    print(f"float8 LoRA vs LoRA bf16 {tracking:.2e}")
    assert one.losses != bf16.losses and tracking < BF16_TRACKING_RTOL  # != : the base really ran in float8
    assert_tracks_within_noise(tp2, one, float8_noise(runs, [("lora", "float8-lora")]), "float8-lora-tp2")


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
