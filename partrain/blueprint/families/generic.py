"""The generic path: transformers' causal-LM families built exactly as Llama, trained without a family file.

partrain/models/generic_survey.py builds every causal-LM family of the installed transformers and keeps
those that hold Llama's parameter tensors, compute their logits with a plain head and ship a tp plan;
`python -m partrain.models.facts_snapshot` records them in hf_facts.json (`generic_llama`), read here.
Each becomes a planner family with Llama's tensors and formulas (`generic=True`). Whatever a family
changes inside its decoder layers (norm offsets, activations, window masks) runs in transformers' own
forward under dp, ZeRO/FSDP, tp (with Megatron-SP) and LoRA, and the suite checks one of them against one
process on each. Pipeline stages and sequence parallelism replace parts of that forward with partrain's
own (the layer loop, the attention call) and stay with the verified families: exit 2 names the key.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Dict, Tuple

from partrain.blueprint.families.base import Family
from partrain.blueprint.families.llama import LLAMA

SNAPSHOT = Path(__file__).resolve().parents[1] / "hf_facts.json"
GENERIC_KEY = "generic_llama"
"""hf_facts.json's list of the families the survey found."""


def _recorded() -> Tuple[str, ...]:
    return tuple(json.loads(SNAPSHOT.read_text()).get(GENERIC_KEY, ()))


GENERIC_ARCHS: Tuple[str, ...] = _recorded()
"""model_types on the generic path (as recorded by the last snapshot)."""

GENERIC_FAMILIES: Dict[str, Family] = {
    arch: replace(LLAMA, name="generic", arch=arch, generic=True) for arch in GENERIC_ARCHS
}

GENERIC_REFUSED = {
    "parallel.pp": (
        "pipeline parallelism for {arch}, a family on the generic path: pipeline stages run partrain's own "
        "loop over the decoder layers, verified family by family,"
    ),
    "parallel.sp": (
        "sequence parallelism for {arch}, a family on the generic path: it replaces the attention call, "
        "verified family by family,"
    ),
}
"""Degree key -> why a generic family cannot take it (blueprint.trainable refuses it, exit 2: the text is
followed by "is not implemented in this version of partrain")."""

GENERIC_NOTE = "generic path: Llama's tensors, transformers' own forward and tp plan; dp, ZeRO/FSDP, tp, LoRA"
"""What the dry run and docs/families.md say of a family on the generic path."""
