"""Per-family runtime descriptions (one module per family) and their registry.

A family's runtime module holds its `Adapter`: where the HF model keeps its parts, and partrain's
own tensor-parallel layer plan where transformers ships none. Its planner twin, torch-free, is
partrain/blueprint/families/<family>.py. Families that share modules (Qwen2, Mistral on Llama) share
one adapter, listing every HF `model_type` it serves in `archs`.
"""

from __future__ import annotations

import difflib
from dataclasses import replace
from typing import Any, Dict

from partrain.blueprint.families.generic import GENERIC_BASES
from partrain.blueprint.families.generic_moe import GENERIC_MOE_RECORDS, MoeRecord
from partrain.blueprint.families.generic_template import TEMPLATE_RECORDS, TemplateRecord
from partrain.errors import ConfigError, Problem
from partrain.models.families.base import Adapter, LegacyExperts
from partrain.models.families.cohere2 import COHERE2
from partrain.models.families.deepseek_v3 import DEEPSEEK_V3
from partrain.models.families.gemma2 import GEMMA2
from partrain.models.families.gemma3 import GEMMA3
from partrain.models.families.glm4 import GLM4
from partrain.models.families.gpt2 import GPT2
from partrain.models.families.gpt_oss import GPT_OSS
from partrain.models.families.llama import GRANITE, LLAMA
from partrain.models.families.mixtral import MIXTRAL
from partrain.models.families.olmo2 import OLMO2
from partrain.models.families.phi3 import PHI3
from partrain.models.families.qwen2_moe import QWEN2_MOE
from partrain.models.families.qwen3_moe import QWEN3_MOE

VERIFIED_ADAPTERS: Dict[str, Adapter] = {
    arch: a
    for a in (
        GPT2,
        LLAMA,
        GRANITE,
        GEMMA2,
        GEMMA3,
        OLMO2,
        PHI3,
        GLM4,
        COHERE2,
        MIXTRAL,
        QWEN2_MOE,
        QWEN3_MOE,
        GPT_OSS,
        DEEPSEEK_V3,
    )
    for arch in a.archs
}
"""model_type -> adapter of its own family file (a new family: add its module here)."""


def moe_adapter(arch: str, record: MoeRecord) -> Adapter:
    """A generic MoE family's adapter (blueprint/families/generic_moe.py): its base's paths, and where the
    survey found its MoE block, experts, router and shared experts."""
    block = record.block
    return replace(
        VERIFIED_ADAPTERS[record.base],
        family="generic",
        archs=(arch,),
        mlp_attr=block,
        is_moe=True,
        experts_attr=f"{block}.experts",
        expert_param_names=("gate_up_proj", "down_proj"),
        router_attr=f"{block}.{record.router}",
        shared_expert_attr=f"{block}.{record.shared}" if record.shared else None,
        legacy_experts=LegacyExperts(*record.legacy) if record.legacy else None,
        checkpoint_renames=record.renames,
    )


def template_adapter(arch: str, record: TemplateRecord) -> Adapter:
    """A template family's adapter (blueprint/families/generic_template.py): the paths its survey found."""
    return Adapter(
        family="generic",
        archs=(arch,),
        base_prefix="model",
        layer_prefix="model.layers",
        embedding_paths=record.embedding_paths,
        final_norm_path=record.final_norm_path,
        rotary_path=record.rotary_path,
        attention_attr=record.attention_attr,
        mlp_attr=record.mlp_attr,
        layer_norms=record.layer_norms,
    )


ADAPTERS: Dict[str, Adapter] = {
    **VERIFIED_ADAPTERS,
    **{
        arch: replace(VERIFIED_ADAPTERS[base], family="generic", archs=(arch,))
        for arch, base in GENERIC_BASES.items()
        if arch not in VERIFIED_ADAPTERS
    },
    **{arch: moe_adapter(arch, r) for arch, r in GENERIC_MOE_RECORDS.items() if arch not in VERIFIED_ADAPTERS},
    **{arch: template_adapter(arch, r) for arch, r in TEMPLATE_RECORDS.items() if arch not in VERIFIED_ADAPTERS},
}
"""model_type -> adapter, for every supported architecture: the generic paths' families
(blueprint/families/generic.py, generic_moe.py) take their base family's module paths, the template path's
(generic_template.py) those its survey recorded."""


def get_adapter(model_or_arch: Any) -> Adapter:
    """The adapter for an arch name, an HF config, a model (its `.config`), or a partrain ModelConfig.

    Raises ConfigError (key model.arch) for an architecture partrain does not support.
    """
    arch = _arch_of(model_or_arch)
    adapter = ADAPTERS.get(arch)
    if adapter is None:
        supported = ", ".join(sorted(ADAPTERS))
        close = difflib.get_close_matches(str(arch), list(ADAPTERS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(
            Problem(
                "model.arch",
                arch,
                f"no partrain adapter for this architecture (supported: {supported})",
                f"{hint}set model.arch to a supported one",
            )
        )
    return adapter


def _arch_of(obj: Any) -> str:
    if isinstance(obj, str):
        return obj
    config = getattr(obj, "config", obj)  # a model carries its HF config
    model_type = getattr(config, "model_type", None)
    if isinstance(model_type, str) and model_type:
        return model_type
    arch = getattr(obj, "arch", None)  # partrain ModelConfig
    if isinstance(arch, str):
        return arch
    raise TypeError(f"cannot tell the architecture of {type(obj).__name__}")
