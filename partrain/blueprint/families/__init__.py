"""Per-family planner knowledge (one module per family) and its registry.

A family is a pair of files: this package's <family>.py (torch-free: config facts, parameter
tensors, the traits the planner's formulas branch on) and partrain/models/families/<family>.py
(runtime: module paths, TP plan). Variants that share code (Qwen2, Mistral on Llama) are entries of
the llama module, not copies. Shared planner modules ask `family(arch)` instead of testing arch.
"""

from __future__ import annotations

import difflib
from typing import Dict

from partrain.blueprint.families.base import Family
from partrain.blueprint.families.cohere2 import COHERE2
from partrain.blueprint.families.deepseek_v3 import DEEPSEEK_V3
from partrain.blueprint.families.gemma2 import GEMMA2
from partrain.blueprint.families.gemma3 import GEMMA3
from partrain.blueprint.families.generic import GENERIC_BASES, GENERIC_FAMILIES, NOT_GENERIC
from partrain.blueprint.families.generic_moe import GENERIC_MOE_FAMILIES, GENERIC_MOE_RECORDS, NOT_GENERIC_MOE
from partrain.blueprint.families.generic_template import NOT_TEMPLATE, TEMPLATE_FAMILIES
from partrain.blueprint.families.glm4 import GLM4
from partrain.blueprint.families.gpt2 import GPT2
from partrain.blueprint.families.gpt_oss import GPT_OSS
from partrain.blueprint.families.llama import GRANITE, LLAMA, MISTRAL, QWEN2, QWEN3, SMOLLM3
from partrain.blueprint.families.mixtral import MIXTRAL
from partrain.blueprint.families.olmo2 import OLMO2
from partrain.blueprint.families.phi3 import PHI3
from partrain.blueprint.families.qwen2_moe import QWEN2_MOE
from partrain.blueprint.families.qwen3_moe import QWEN3_MOE
from partrain.errors import ConfigError, Problem

DENSE = (GPT2, LLAMA, QWEN2, QWEN3, MISTRAL, SMOLLM3, GRANITE, GEMMA2, GEMMA3, OLMO2, PHI3, GLM4, COHERE2)
VERIFIED: Dict[str, Family] = {f.arch: f for f in (*DENSE, MIXTRAL, QWEN2_MOE, QWEN3_MOE, GPT_OSS, DEEPSEEK_V3)}
"""HF model_type -> the planner family of its own file, verified layout by layout."""
FAMILIES: Dict[str, Family] = {
    **VERIFIED,
    **{a: f for a, f in {**GENERIC_FAMILIES, **GENERIC_MOE_FAMILIES, **TEMPLATE_FAMILIES}.items() if a not in VERIFIED},
}
"""HF model_type -> its planner family, in the order reports list the supported architectures (the
generic paths' last)."""
GENERIC_BASE: Dict[str, str] = {**GENERIC_BASES, **{a: r.base for a, r in GENERIC_MOE_RECORDS.items()}}
"""Every family of the generic paths (dense and MoE) -> the verified family whose tensors it stands on."""
WHY_NOT_GENERIC: Dict[str, str] = {
    **{
        a: f"{why}; nor the template path's: {NOT_TEMPLATE[a]}" if a in NOT_TEMPLATE else why
        for a, why in NOT_GENERIC.items()
    },
    **NOT_GENERIC_MOE,
}
"""Why the surveys left a family of the installed transformers off every generic path: the MoE survey's
reason for an MoE family, else the base survey's and the template survey's."""


def unknown_arch(arch: str) -> Problem:
    names = tuple(FAMILIES)
    close = difflib.get_close_matches(arch, names, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    why = f"; the generic path does not take it: {WHY_NOT_GENERIC[arch]}" if arch in WHY_NOT_GENERIC else ""
    return Problem(
        "model.arch",
        arch,
        f"not a supported HF architecture family ({', '.join(names)}){why}",
        f"{hint}set model.arch to one of them",
    )


def family(arch: str) -> Family:
    """The planner family of HF model_type `arch`; ConfigError (model.arch) when partrain has none."""
    found = FAMILIES.get(arch)
    if found is None:
        raise ConfigError(unknown_arch(arch))
    return found
