"""LoRA (peft=lora) for real against the one-process LoRA run of the same model under every kind of
layout (DDP with full recompute, ZeRO-1, FSDP, HSDP, tp2 with and without Megatron-SP, pp2, dp2 x tp2,
pp2 x tp2, Ulysses and ring sp, compile, bf16, GPT-2's Conv1D projections, Mixtral under expert
parallelism), its first step against full fine-tuning's, PEFT and merged exports, an exact resume, and a
run starting from a full checkpoint (checkpoint.init_from); the runs of one process count share a
launch (testing.in_process.train_all)."""

from __future__ import annotations

import math

import pytest

from partrain.rehearse.runs import train_all
from partrain.testing.parity import check_parity, max_relative_difference, parity_args, reference_overrides

pytestmark = pytest.mark.slow

STEPS = 3
# A high, constant learning rate: B leaves zero at the first step, so steps 2 and 3 compare adapters
# that really change the model (A's gradient is B^T-weighted: zero while B is).
BASE = [
    "recipe=llama-fsdp-tp",
    "parallel.tp_sequence_parallel=false",
    "train.seq_len=64",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "data.max_bytes=1000000",
    "optim.lr=1e-2",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
]
LORA = BASE + ["peft=lora"]
ONE_NODE = "cluster.devices_per_node="

LAYOUTS = {
    "lora-ddp2-recompute": ["parallel.dp=2", "parallel.tp=1", "parallel.zero_stage=0", "parallel.recompute=full"],
    "lora-fsdp2": ["parallel.dp=2", "parallel.tp=1", "parallel.zero_stage=3"],
    "lora-tp2": ["parallel.dp=1", "parallel.tp=2", "parallel.zero_stage=0"],
    "lora-pp2": ["parallel.dp=1", "parallel.tp=1", "parallel.pp=2", "parallel.zero_stage=0"],
    "lora-fsdp2-tp2": ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=3"],
    "lora-pp2-tp2-interleaved": [
        "parallel.dp=1",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.zero_stage=0",
        "parallel.pp_schedule=interleaved-1f1b",
        "parallel.pp_virtual_stages=2",
    ],
    # Frozen parameters stay out of ZeRO-1's flat buffers and out of HSDP's replica all-reduce.
    "lora-zero1": ["parallel.dp=2", "parallel.tp=1", "parallel.zero_stage=1"],
    "lora-hsdp": ["parallel.dp=4", "parallel.tp=1", "parallel.dp_shard=2", "parallel.zero_stage=3"],
    # Megatron-SP: the column adapters gather only their rank-r activations (partrain.parallel.lora_sp).
    "lora-tp2-megatron-sp": [
        "parallel.dp=1",
        "parallel.tp=2",
        "parallel.zero_stage=0",
        "parallel.tp_sequence_parallel=true",
    ],
    "lora-sp2-ulysses": ["parallel.dp=1", "parallel.tp=1", "parallel.sp=2", "parallel.zero_stage=0"],
    "lora-sp2-ring": [
        "parallel.dp=1",
        "parallel.tp=1",
        "parallel.sp=2",
        "parallel.sp_mode=ring",
        "parallel.zero_stage=0",
    ],
    "lora-ddp2-compile": [
        "parallel.dp=2",
        "parallel.tp=1",
        "parallel.zero_stage=0",
        "train.compile=true",
        "train.compile_backend=aot_eager",
    ],
}
GPT2 = ["model=gpt2-tiny"]
MIXTRAL = ["model=mixtral-tiny"]
BF16 = ["train.precision=bf16", "train.param_dtype=16bit"]
OTHER_MODELS = {
    # name: (the model / precision overrides its one-process reference shares, the layout, tolerance)
    # GPT-2's fused c_attn: B is split with the base's strided (q | k | v heads) placement.
    "lora-gpt2-tp2-megatron-sp": (
        GPT2,
        ["parallel.dp=1", "parallel.tp=2", "parallel.zero_stage=0", "parallel.tp_sequence_parallel=true"],
        1e-5,
    ),
    # GPT-2's tied embedding is frozen: the pipeline's tied-gradient exchange has nothing to sum.
    "lora-gpt2-pp2-zero1": (GPT2, ["parallel.dp=2", "parallel.tp=1", "parallel.pp=2", "parallel.zero_stage=1"], 1e-5),
    # Expert parallelism re-makes the expert parameters: they must end up frozen too.
    "lora-mixtral-ep2": (MIXTRAL, ["parallel.dp=2", "parallel.tp=1", "parallel.ep=2", "parallel.zero_stage=0"], 1e-5),
    # bf16: the reference keeps 16-bit parameters (fp32 masters of the adapters only, the frozen base in
    # bf16), which is what FSDP2's bf16 compute copies and ZeRO-1's master weights compute: same numbers.
    "lora-fsdp2-bf16": (BF16, ["parallel.dp=2", "parallel.tp=1", "parallel.zero_stage=3"], 1e-5),
    "lora-zero1-bf16": (BF16, ["parallel.dp=2", "parallel.tp=1", "parallel.zero_stage=1"], 1e-5),
    # tp2 sums its partial products in another order: bf16 rounding (2^-8) separates the runs. The
    # losses stay within BF16_RTOL; the gradient norm is compared at step 1 only, since Adam turns
    # the sign of near-zero adapter gradients into full-size steps from step 2 on.
    "lora-tp2-bf16": (BF16, ["parallel.dp=1", "parallel.tp=2", "parallel.zero_stage=0"], None),
}
BF16_RTOL = 2e-3
"""lora-tp2-bf16 vs one process, every step's loss and step 1's gradient norm: tp2 sums bf16 partial
products in another order (bf16's unit roundoff 2^-8, averaged over many elements). Measured 5.6e-4
(loss) and 1.5e-4 (gradient norm): a margin of 3.6x."""


def _world(layout) -> int:
    """Processes of a layout: the product of its dp, tp, pp and sp."""
    degrees = {o.split("=")[0]: o.split("=")[1] for o in layout}
    return math.prod(int(degrees.get(f"parallel.{axis}", 1)) for axis in ("dp", "tp", "pp", "sp"))


def _reference_name(model) -> str:
    return "reference-" + "-".join(o.split("=")[-1] for o in model)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    common = [f"data.cache_dir={data_cache}"]
    cases = {
        "reference-lora": parity_args(reference_overrides(LORA + common), STEPS),
        "reference-full": parity_args(reference_overrides(BASE + common), 1),
        # Saved at step 2, and exported at its end (checkpoint.export_hf: the merged model).
        "lora-saved": parity_args(
            reference_overrides(LORA + common) + ["checkpoint.every_steps=2", "checkpoint.export_hf=true"], 2
        ),
        # A full fine-tuning run of other initial weights (seed), saved: checkpoint.init_from's source.
        "full-seed7-saved": parity_args(
            reference_overrides(BASE + common) + ["train.seed=7", "checkpoint.every_steps=1"], 1
        ),
    }
    for name, layout in LAYOUTS.items():
        overrides = LORA + layout + [f"{ONE_NODE}{_world(layout)}"] + common
        cases[name] = parity_args(overrides, STEPS)
    for name, (model, layout, _) in OTHER_MODELS.items():
        saving = ["checkpoint.every_steps=3"] if model == GPT2 else []  # for the GPT-2 PEFT export
        cases[_reference_name(model)] = parity_args(reference_overrides(LORA + model + common) + saving, STEPS)
        cases[name] = parity_args(LORA + model + layout + [f"{ONE_NODE}{_world(layout)}"] + common, STEPS)
    return train_all(cases, tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_single_process(name, runs):
    got, ref = runs[name], runs["reference-lora"]
    print(name, check_parity(ref, got))
    assert got.losses[-1] < got.losses[0]


@pytest.mark.parametrize("name", list(OTHER_MODELS))
def test_lora_other_models_and_precisions_match_single_process(name, runs):
    model, _, rtol = OTHER_MODELS[name]
    got, ref = runs[name], runs[_reference_name(model)]
    if rtol is not None:
        print(name, check_parity(ref, got, rtol=rtol))
    else:  # bf16 under another reduction order (see OTHER_MODELS)
        norm = abs(got.grad_norms[0] - ref.grad_norms[0]) / ref.grad_norms[0]
        print(f"{name}: loss {max_relative_difference(ref.losses, got.losses):.2e}, step-1 grad norm {norm:.2e}")
        for a, b in zip(got.losses, ref.losses, strict=True):
            assert math.isclose(a, b, rel_tol=BF16_RTOL), (got.losses, ref.losses)
        assert math.isclose(got.grad_norms[0], ref.grad_norms[0], rel_tol=BF16_RTOL), (got.grad_norms, ref.grad_norms)
    assert got.losses[-1] < got.losses[0]


def test_lora_first_step_is_full_fine_tuning_first_step(runs):
    """B starts at zero: the adapted model is the base, so the first loss is full fine-tuning's."""
    lora, full = runs["reference-lora"], runs["reference-full"]
    assert math.isclose(lora.losses[0], full.losses[0], rel_tol=1e-6), (lora.losses, full.losses)
    # Only the adapters train: their gradient norm is not the whole model's.
    assert lora.grad_norms[0] < full.grad_norms[0]
    assert lora.losses[1] != lora.losses[0]  # and the adapters do change the model


@pytest.mark.parametrize(
    "name, step, tensors",
    [
        ("lora-saved", 2, 2 * 7 * 4),  # Llama: A and B of 7 projections in 4 layers
        (_reference_name(GPT2), 3, 2 * 4 * 4),  # GPT-2: c_attn, attn.c_proj, c_fc, mlp.c_proj (Conv1D)
    ],
)
def test_peft_export_loads_with_peft_and_matches_merged_export(runs, tmp_path, name, step, tensors):
    """`checkpoint export --peft` loaded by peft onto the base gives the logits of `--hf`'s merged model
    (GPT-2: fan_in_fan_out, its Conv1D weights are [in, out]); for the run with checkpoint.export_hf the
    merged folder it wrote at its end is the same model."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from partrain.checkpoint.export import load_model_weights
    from partrain.checkpoint.export_peft import export_peft
    from partrain.checkpoint.hf_export import export_hf_report

    ck = runs[name].run_dir / "checkpoints" / f"step-{step:08d}"
    report = export_peft(ck, tmp_path / "adapter")
    assert report["tensors"] == tensors and report["r"] == 8
    export_hf_report(ck, tmp_path / "merged")
    base, _ = load_model_weights(ck)  # the frozen base: the checkpoint's HF keys, adapters left out
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        peft_logits = adapted(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
        at_end = runs[name].run_dir / "hf"
        end_logits = AutoModelForCausalLM.from_pretrained(at_end).eval()(ids).logits if at_end.is_dir() else None
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapters trained away from zero
    assert torch.allclose(peft_logits, merged_logits, rtol=1e-4, atol=1e-5), (peft_logits - merged_logits).abs().max()
    assert name != "lora-saved" or torch.equal(end_logits, merged_logits)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["peft.r=4"], "peft.r"),  # a LoRA key without peft=lora would be silently unused
        (LORA + ["peft.target_modules=[q_proj,wq]"], "peft.target_modules"),
        (LORA + ["model=mixtral-tiny", "peft.target_modules=[q_proj,gate_proj]"], "peft.target_modules"),  # experts
        (
            ["recipe=mixtral-ep", "model=qwen3-moe-tiny", "peft=lora", "peft.target_modules=[up_proj]"],
            "peft.target_modules",
        ),
        (LORA + ["peft.alpha=0"], "peft.alpha"),
    ],
)
def test_lora_refuses_bad_settings(overrides, key):
    """Bad LoRA settings are refused before any process starts, naming the key (float8 composes with
    LoRA: tests/test_float8.py)."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose(overrides))
    assert key in [p.key for p in err.value.problems], err.value


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=gpt2-tiny", "parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=3"],
        ["parallel.tp=2", "parallel.dp=2", "parallel.zero_stage=1", "parallel.tp_sequence_parallel=true"],
    ],
    ids=["gpt2-fsdp-tp2", "zero1-tp2-sp"],
)
def test_lora_ranks_hold_what_the_planner_counts(overrides):
    """The planner's LoRA memory (GPT-2's Conv1D projections, ZeRO-1) is what the ranks build (simulated)."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.simulate.fake_world import simulate

    v = validate(compose(["recipe=llama-fsdp-tp", "peft=lora", *overrides]))
    for rank in simulate(v).ranks:
        assert rank.simulated == rank.analytic, rank.rank
        assert 0 < rank.simulated["grads"] < rank.simulated["params"] / 4  # adapters only


@pytest.fixture(scope="module")
def second_round(runs, data_cache, tmp_path_factory):
    """Runs that start from the first round's checkpoints, in one launch of 2 processes: the LoRA run
    saved at step 2 resumed under tp2, and a LoRA run under tp2 whose base is the full run's checkpoint."""
    layout = LAYOUTS["lora-tp2"] + [f"{ONE_NODE}{_world(LAYOUTS['lora-tp2'])}"]
    common = [f"data.cache_dir={data_cache}"]
    saved = runs["lora-saved"].run_dir / "checkpoints" / "step-00000002"
    full = runs["full-seed7-saved"].run_dir / "checkpoints" / "step-00000001"
    cases = {
        "lora-resumed": parity_args(LORA + layout + common + [f"checkpoint.resume={saved}"], STEPS),
        "lora-from-full": parity_args(
            LORA + layout + common + [f"checkpoint.init_from={full}", "checkpoint.every_steps=2"], 2
        ),
    }
    return train_all(cases, tmp_path_factory.mktemp("second-round"))


def test_a_lora_checkpoint_resumes_exactly_under_another_layout(runs, second_round):
    """The one-process LoRA run saved at step 2 (base, adapters and the adapters' Adam state), resumed
    under tp2 for step 3: step 3's loss is the uninterrupted run's."""
    resumed = second_round["lora-resumed"]
    assert len(resumed.losses) == 1, resumed.losses
    assert math.isclose(resumed.losses[0], runs["reference-lora"].losses[2], rel_tol=1e-5)


def test_lora_starts_from_a_full_checkpoint(runs, second_round):
    """checkpoint.init_from: the base weights are the full run's checkpoint (saved by one process, loaded
    under tp2), bit for bit, and stay frozen; the adapters start fresh, at step 0."""
    import torch

    from partrain.checkpoint.export import load_model_weights
    from partrain.checkpoint.export_peft import load_adapters

    got = second_round["lora-from-full"]
    assert len(got.losses) == 2 and got.losses[1] < got.losses[0]
    assert got.losses[0] != runs["reference-lora"].losses[0]  # other weights than this seed's
    source, _ = load_model_weights(runs["full-seed7-saved"].run_dir / "checkpoints" / "step-00000001")
    ck = got.run_dir / "checkpoints" / "step-00000002"
    trained, _ = load_model_weights(ck)
    wanted = source.state_dict()
    for key, value in trained.state_dict().items():
        assert torch.equal(value, wanted[key]), key
    adapters = load_adapters(ck)
    assert len(adapters) == 2 * 7 * 4 and any(t.abs().max() > 0 for k, t in adapters.items() if "lora_B" in k)


def test_init_from_refuses_another_model_or_a_resume_before_any_process(runs, tmp_path):
    """A checkpoint of another model, or init_from beside a resume path: exit-2 problems, nothing started."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.preflight import init_from_problems

    full = runs["full-seed7-saved"].run_dir / "checkpoints" / "step-00000001"
    other = validate(compose(LORA + GPT2 + [f"checkpoint.init_from={full}"]))
    assert [p.key for p in init_from_problems(other)] == ["model.arch"]
    both = validate(compose(LORA + [f"checkpoint.init_from={full}", f"checkpoint.resume={full}"]))
    assert [p.key for p in init_from_problems(both)] == ["checkpoint.init_from"]
    missing = validate(compose(LORA + [f"checkpoint.init_from={tmp_path / 'nothing'}"]))
    assert [p.key for p in init_from_problems(missing)] == ["checkpoint.init_from"]
    assert init_from_problems(validate(compose(LORA + [f"checkpoint.init_from={full}"]))) == []
