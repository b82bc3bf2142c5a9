"""Every model family beyond the spine's own (llama, gpt2 and the MoE families have theirs in the axis
files), trained for real under each parallel axis against one process of the same model, data and
seed: dp2 (DDP and FSDP), tp2 with and without Megatron-SP, pp2 (1F1B), sp2 (Ulysses and ring) and
LoRA under tp2, and the chunked head + loss (`train.loss_chunk_tokens`) with and without pp. A family
is one row of FAMILIES; the cases of one process count share a launch.

Qwen3 (dense): Llama's modules plus per-head q_norm / k_norm inside attention, which transformers'
tp plan marks `replicated_with_grad_allreduce` (partrain/parallel/tensor_parallel.py): whole on every
rank, their gradients summed over tp. SmolLM3: Llama's modules with rotary skipped on every 4th layer
(inside HF's attention) and tied embeddings (split over pp's first and last stages). Granite: Llama's
modules with Granite 3's four multipliers; the embedding multiplier and the logits' divisor live in
HF's base and causal-LM forwards, which a pipeline stage does not run (models/families/llama.py
GRANITE, applied in parallel/pipeline/stage.py)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest

from partrain.testing.in_process import train_with_references
from partrain.testing.parity import FP32_RTOL, check_parity

pytestmark = pytest.mark.slow

STEPS = 3
COMMON = [
    "recipe=llama-fsdp-tp",
    "train.precision=fp32",
    "train.seq_len=64",
    "train.micro_batch_size=1",
    "train.global_batch_size=4",
    "data.max_bytes=1000000",
    "parallel.dp=1",
    "parallel.tp=1",
    "parallel.zero_stage=0",
    "parallel.tp_sequence_parallel=false",
    "cluster.devices_per_node=2",
]
"""Two processes, four one-row microbatches a step, fp32 (FP32_RTOL)."""

FAMILIES = {
    "qwen3": ["model=qwen3-tiny"],
    "smollm3": ["model=smollm3-tiny"],
    "granite": ["model=granite-tiny"],
}
"""Family -> the overrides of its tiny model (conf/model/)."""

LAYOUTS = {
    "ddp2": ["parallel.dp=2"],
    "fsdp2": ["parallel.dp=2", "parallel.zero_stage=3"],
    "tp2": ["parallel.tp=2"],
    "tp2-megatron-sp": ["parallel.tp=2", "parallel.tp_sequence_parallel=true"],
    "pp2-1f1b": ["parallel.pp=2", "parallel.pp_schedule=1f1b"],
    "sp2-ulysses": ["parallel.sp=2", "parallel.sp_mode=ulysses"],
    "sp2-ring": ["parallel.sp=2", "parallel.sp_mode=ring"],
    "lora-tp2": ["parallel.tp=2", "peft=lora"],
    "ddp2-chunked-loss": ["parallel.dp=2", "train.loss_chunk_tokens=32"],
    "pp2-chunked-loss": ["parallel.pp=2", "train.loss_chunk_tokens=32"],
}
"""Layout -> overrides; each runs on 2 processes."""


def _cases() -> Tuple[Dict[str, List[str]], Dict[str, Tuple[str, List[str]]]]:
    layouts, references = {}, {}
    for family, model in FAMILIES.items():
        for layout, overrides in LAYOUTS.items():
            name = f"{family}-{layout}"
            layouts[name] = COMMON + model + overrides
            lora = ["peft=lora"] if "peft=lora" in overrides else []
            references[name] = (f"{family}-reference{'-lora' if lora else ''}", COMMON + model + lora)
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
    assert got.losses[-1] < got.losses[0]
