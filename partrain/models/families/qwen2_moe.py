"""Qwen2-MoE at runtime: routed experts plus an always-on shared expert. The planner's side is
blueprint/families/qwen2_moe.py."""

from __future__ import annotations

from partrain.models.families.base import Adapter, LegacyExperts
from partrain.models.families.llama import LLAMA_PATHS

QWEN2_MOE = Adapter(
    family="qwen2_moe",
    archs=("qwen2_moe",),
    **LLAMA_PATHS,
    is_moe=True,
    experts_attr="mlp.experts",
    expert_param_names=("gate_up_proj", "down_proj"),
    router_attr="mlp.gate",
    shared_expert_attr="mlp.shared_expert",
    legacy_experts=LegacyExperts("mlp.experts", gate="gate_proj", up="up_proj", down="down_proj"),
)
