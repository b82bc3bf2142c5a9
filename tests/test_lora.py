"""LoRA (peft=lora) for real against the one-process LoRA run under every layout it is built for (DDP
with full recompute, FSDP, tp2, pp2, dp2 x tp2 with FSDP, pp2 x tp2), and its first step against full
fine-tuning's; the runs of one process count share a launch (testing.in_process.train_all)."""

from __future__ import annotations

import math

import pytest

from partrain.testing.in_process import train_all
from partrain.testing.parity import check_parity, parity_args, reference_overrides

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
}


def _world(layout) -> int:
    """Processes of a layout: the product of its dp, tp and pp."""
    degrees = {o.split("=")[0]: o.split("=")[1] for o in layout}
    return math.prod(int(degrees.get(f"parallel.{axis}", 1)) for axis in ("dp", "tp", "pp"))


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    common = [f"data.cache_dir={data_cache}"]
    cases = {
        "reference-lora": parity_args(reference_overrides(LORA + common), STEPS),
        "reference-full": parity_args(reference_overrides(BASE + common), 1),
        "lora-saved": parity_args(reference_overrides(LORA + common) + ["checkpoint.every_steps=2"], 2),
    }
    for name, layout in LAYOUTS.items():
        overrides = LORA + layout + [f"{ONE_NODE}{_world(layout)}"] + common
        cases[name] = parity_args(overrides, STEPS)
    return train_all(cases, tmp_path_factory.mktemp("runs"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lora_layout_matches_single_process(name, runs):
    got, ref = runs[name], runs["reference-lora"]
    print(name, check_parity(ref, got, rtol=1e-5))
    assert got.losses[-1] < got.losses[0]


def test_lora_first_step_is_full_fine_tuning_first_step(runs):
    """B starts at zero: the adapted model is the base, so the first loss is full fine-tuning's."""
    lora, full = runs["reference-lora"], runs["reference-full"]
    assert math.isclose(lora.losses[0], full.losses[0], rel_tol=1e-6), (lora.losses, full.losses)
    # Only the adapters train: their gradient norm is not the whole model's.
    assert lora.grad_norms[0] < full.grad_norms[0]
    assert lora.losses[1] != lora.losses[0]  # and the adapters do change the model


def test_peft_export_loads_with_peft_and_matches_merged_export(runs, tmp_path):
    """`checkpoint export --peft` loaded by peft onto the base gives the logits of `--hf`'s merged model."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import AutoModelForCausalLM

    from partrain.checkpoint.export import load_model_weights
    from partrain.checkpoint.export_peft import export_peft
    from partrain.checkpoint.hf_export import export_hf_report

    ck = runs["lora-saved"].run_dir / "checkpoints" / "step-00000002"
    report = export_peft(ck, tmp_path / "adapter")
    assert report["tensors"] == 2 * 7 * 4 and report["r"] == 8  # A and B of 7 projections in 4 layers
    export_hf_report(ck, tmp_path / "merged")
    base, _ = load_model_weights(ck)  # the frozen base: the checkpoint's HF keys, adapters left out
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        peft_logits = adapted(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(ids).logits
    assert (peft_logits - base_logits).abs().max() > 1e-3  # the adapters trained away from zero
    assert torch.allclose(peft_logits, merged_logits, rtol=1e-4, atol=1e-5), (peft_logits - merged_logits).abs().max()


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["peft=lora"], "peft.method"),  # gpt2: fused Conv1D QKV, not built
        (["peft.r=4"], "peft.r"),  # a LoRA key without peft=lora would be silently unused
        (LORA + ["peft.target_modules=[q_proj,wq]"], "peft.target_modules"),
        (LORA + ["parallel.tp_sequence_parallel=true"], "parallel.tp_sequence_parallel"),
        (LORA + ["train.compile=true"], "train.compile"),
        (LORA + ["parallel.zero_stage=1"], "parallel.zero_stage"),
        (LORA + ["parallel.tp=1", "parallel.dp=4", "parallel.dp_shard=2"], "parallel.dp_shard"),
        (LORA + ["parallel.recompute=selective"], "parallel.recompute"),
        (LORA + ["train.precision=bf16"], "train.precision"),
        (LORA + ["checkpoint.export_hf=true"], "checkpoint.export_hf"),
    ],
)
def test_lora_refuses_what_it_does_not_do(overrides, key):
    """What LoRA is not built or tested for is refused before any process starts, naming the key."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose(overrides))
    assert key in [p.key for p in err.value.problems], err.value


def test_a_lora_checkpoint_resumes_exactly_under_another_layout(runs, data_cache, tmp_path):
    """The one-process LoRA run saved at step 2 (base, adapters and the adapters' Adam state), resumed
    under tp2 for step 3: step 3's loss is the uninterrupted run's."""
    saved = runs["lora-saved"].run_dir / "checkpoints" / "step-00000002"
    layout = LAYOUTS["lora-tp2"] + [f"{ONE_NODE}{_world(LAYOUTS['lora-tp2'])}"]
    common = [f"data.cache_dir={data_cache}"]
    resumed = train_all(
        {"lora-resumed": parity_args(LORA + layout + common + [f"checkpoint.resume={saved}"], STEPS)}, tmp_path
    )["lora-resumed"]
    assert len(resumed.losses) == 1, resumed.losses
    assert math.isclose(resumed.losses[0], runs["reference-lora"].losses[2], rel_tol=1e-5)
