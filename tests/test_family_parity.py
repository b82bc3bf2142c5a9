"""Every dense model family trained for real under each parallel layout against one process of the
same model, data and seed: dp2 (DDP and FSDP), tp2 with and without Megatron-SP, pp2 (1F1B), sp2
(Ulysses and ring), LoRA under tp2, and the chunked head + loss (`train.loss_chunk_tokens`) with and
without pp. The matrix is data (partrain/blueprint/families/support.py), rendered as docs/families.md:
the page says verified for exactly the cells run here. The cases of one process count share a launch.

Qwen3 (dense): Llama's modules plus per-head q_norm / k_norm inside attention, which transformers'
tp plan marks `replicated_with_grad_allreduce` (partrain/parallel/tensor_parallel.py): whole on every
rank, their gradients summed over tp. SmolLM3: Llama's modules with rotary skipped on every 4th layer
(inside HF's attention) and tied embeddings (split over pp's first and last stages). Granite: Llama's
modules with Granite 3's four multipliers; the embedding multiplier and the logits' divisor live in
HF's base and causal-LM forwards, which a pipeline stage does not run (models/families/llama.py
GRANITE, applied in parallel/pipeline/stage.py). OLMo 2 (norms over the whole q and k) and Phi-3 (fused
qkv_proj, gate_up_proj): transformers' plans gather those column projections' outputs and slice the
next row projection's input (`colwise_gather_output` / `rowwise_split_input`: tp_layers' gather_output
and split_input, LoRA included); Megatron-SP is refused for them. Gemma 2: attention scores capped by
tanh (eager attention; partrain's Ulysses attention caps them too, ring refuses) and logits capped by
tanh, which the pipeline's last stage and the chunked loss apply after the head (models/logits.py)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

from partrain.blueprint.families.support import (
    PARITY_FAMILIES,
    PARITY_LAYOUTS,
    PARITY_REFUSED,
    PARITY_STEPS,
    RING_SINKS,
    RING_SOFTCAP,
    SP_WINDOW,
    TP_GATHERED,
    TP_TEMPLATE,
    TP_WHOLE_ATTENTION,
)
from partrain.testing.in_process import train_with_references
from partrain.testing.parity import FP32_RTOL, check_parity

pytestmark = pytest.mark.slow

STEPS = PARITY_STEPS
COMMON = [
    "recipe=llama-fsdp-tp",
    "train.precision=fp32",
    "train.seq_len=64",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",
    "data.max_bytes=1000000",
    "parallel.dp=1",
    "parallel.tp=1",
    "parallel.zero_stage=0",
    "parallel.tp_sequence_parallel=false",
    "cluster.devices_per_node=2",
    "train.loss_chunk_tokens=0",
]
"""Two processes, two one-row microbatches a step (one per rank under dp2; both through the two stages
under pp2; accumulated in the one-process reference), fp32 (FP32_RTOL). The head and its logits as HF's
causal-LM forward computes them (the chunked loss off): the reference is transformers' own function,
and the chunked layouts turn it back on."""
EXPORTED_LAYOUT = "tp2"
EXPORT = [f"checkpoint.every_steps={STEPS}", "checkpoint.export_hf=true"]
"""The tp2 run of every family also saves its last step and exports it as an HF folder from its own
ranks (the sharded weights gathered): what a user keeps of a run."""


def _cases() -> Tuple[Dict[str, List[str]], Dict[str, Tuple[str, List[str]]]]:
    layouts, references = {}, {}
    for family, model in PARITY_FAMILIES.items():
        for layout, overrides in PARITY_LAYOUTS.items():
            if (family, layout) in PARITY_REFUSED:
                continue
            name = f"{family}-{layout}"
            layouts[name] = [*COMMON, *model, *overrides, *(EXPORT if layout == EXPORTED_LAYOUT else [])]
            lora = ["peft=lora"] if "peft=lora" in overrides else []
            references[name] = (f"{family}-reference{'-lora' if lora else ''}", [*COMMON, *model, *lora])
    return layouts, references


CASES, REFERENCES = _cases()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_with_references(CASES, REFERENCES.__getitem__, STEPS, tmp_path_factory.mktemp("families"))


@pytest.mark.parametrize("name", list(CASES))
def test_family_layout_matches_one_process(name, runs):
    reference, _ = REFERENCES[name]
    got = runs[name]
    print(name, check_parity(runs[reference], got, rtol=FP32_RTOL))
    assert len(set(got.losses)) == STEPS  # it trained (a LoRA step may not lower the loss yet)


@pytest.mark.parametrize("family, layout", list(PARITY_REFUSED))
def test_refused_cells_are_refused_before_launch(family, layout):
    """What `partrain train` refuses with exit 2 before launching (and the dry run reports)."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.trainable import unsupported_features
    from partrain.blueprint.validate import validate

    missing = unsupported_features(validate(compose([*COMMON, *PARITY_FAMILIES[family], *PARITY_LAYOUTS[layout]])))
    expected = {SP_WINDOW: "sliding attention window", TP_GATHERED: "gathers column projections"}
    expected[RING_SOFTCAP] = "attention scores capped by model.config.attn_logit_softcapping"
    expected[TP_WHOLE_ATTENTION] = "keeps attention whole"
    expected[RING_SINKS] = "attention sink logits inside ring attention"
    expected[TP_TEMPLATE] = "a family on the template path"
    # Each refusal is one line; a cell may break two rules (gpt-oss' ring: its window and its sinks).
    assert any(expected[PARITY_REFUSED[family, layout]] in line for line in missing), missing


@pytest.mark.parametrize("family", list(PARITY_FAMILIES))
def test_every_family_exports_a_folder_transformers_loads_with_the_checkpoint_s_logits(family, runs):
    """The tp2 run's HF export (checkpoint.export_hf) loads with AutoModelForCausalLM and gives the
    checkpoint's logits exactly (tied embeddings, Gemma's scaled embedding, Granite's multipliers included)."""
    from partrain.testing.hf_check import logits_difference

    run_dir = runs[f"{family}-{EXPORTED_LAYOUT}"].run_dir
    assert logits_difference(run_dir / "hf", run_dir / "checkpoints" / f"step-{STEPS:08d}") == 0.0
