"""The generic path: transformers' causal-LM families built exactly as a verified one, trained without a file.

partrain/models/generic_survey.py builds every causal-LM family of the installed transformers and keeps
those that hold the parameter tensors of a verified family (their base: Llama, Qwen2, Qwen3, OLMo 2),
compute their logits with a plain head and ship a tp plan; `python -m partrain.models.facts_snapshot`
records them in hf_facts.json (`generic_families`, model_type -> base), read here. Each becomes a planner
family with its base's tensors and formulas (`generic=True`). Whatever a family
changes inside its decoder layers (norm offsets, activations, window masks) runs in transformers' own
forward under dp, ZeRO/FSDP, tp (with Megatron-SP), sp (Ulysses and ring, through transformers' attention
interface; a sliding window shorter than the sequence is refused, whichever layers the family applies it
to) and LoRA, and the suite checks three of them against one process on each. Pipeline stages replace the
base model's forward with partrain's own loop over the layers: pp runs for the families whose forward that
loop reproduces exactly (GENERIC_PIPELINE), and is refused for the others (exit 2 names the key).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Dict, Tuple

from partrain.blueprint.families.base import Family
from partrain.blueprint.families.llama import LLAMA, QWEN2, QWEN3
from partrain.blueprint.families.olmo2 import OLMO2

SNAPSHOT = Path(__file__).resolve().parents[1] / "hf_facts.json"
GENERIC_KEY = "generic_families"
"""hf_facts.json's map of the families the survey found to their base."""

_RECORDED = json.loads(SNAPSHOT.read_text())
GENERIC_BASES: Dict[str, str] = dict(_RECORDED.get(GENERIC_KEY, {}))
"""model_type on the generic path -> the verified family it is built as (as recorded by the last snapshot)."""

GENERIC_ARCHS: Tuple[str, ...] = tuple(GENERIC_BASES)

NOT_GENERIC_KEY = "not_generic"
"""hf_facts.json's map of transformers' other causal-LM families to why the survey left them out."""

NOT_GENERIC: Dict[str, str] = dict(_RECORDED.get(NOT_GENERIC_KEY, {}))

_BASE_FAMILIES: Dict[str, Family] = {f.arch: f for f in (LLAMA, QWEN2, QWEN3, OLMO2)}

GENERIC_FAMILIES: Dict[str, Family] = {
    # window_always: whether a family applies config.sliding_window to some layers is its own code's rule
    # (several derive layer_types from it), so any window shorter than the sequence counts.
    arch: replace(_BASE_FAMILIES[base], name="generic", arch=arch, generic=True, window_always=True)
    for arch, base in GENERIC_BASES.items()
}

GENERIC_PIPELINE = frozenset(
    (
        "apertus",
        "apertus1p5_text",
        "arcee",
        "bitnet",
        "cwm",
        "dots1",
        "ernie4_5",
        "ernie4_5_moe",
        "exaone",
        "exaone4",
        "exaone_moe",
        "gemma",
        "glm",
        "glm4_moe",
        "helium",
        "hunyuan_v1_dense",
        "hyperclovax",
        "internlm3",
        "iquestcoder",
        "jais2",
        "mellum",
        "minimax_m3_vl_text",
        "ministral",
        "ministral3",
        "nemotron",
        "olmo",
        "olmo3",
        "persimmon",
        "phi",
        "seed_oss",
        "solar_open",
        "stablelm",
        "starcoder2",
    )
)
"""The generic families whose transformers forward partrain's pipeline stages reproduce: a tiny model split
into two PipelineStageModule chunks gives transformers' logits exactly (tests/test_families.py checks this
set against the installed transformers; olmo3's rotary takes the layer's attention type, which the stage
gives a rotary module whose forward asks for it). Today every family of the generic paths (dense, MoE and
template: families/generic_moe.py, generic_template.py); one a later
transformers adds that the stages do not reproduce is refused pp by name."""

GENERIC_REFUSED = {
    "parallel.pp": (
        "pipeline parallelism for {arch}, a family on the generic path whose forward partrain's pipeline "
        "stages do not reproduce (they run their own loop over the decoder layers),"
    ),
}
"""Degree key -> why a generic family outside GENERIC_PIPELINE cannot take it (blueprint.trainable refuses
it, exit 2: the text is followed by "is not implemented in this version of partrain")."""

GENERIC_NOTE = "generic path: {base}'s tensors, transformers' own forward and tp plan; dp, ZeRO/FSDP, tp, sp, LoRA{pp}"
"""What the dry run and docs/families.md say of a family on the generic path."""
