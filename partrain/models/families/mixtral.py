"""Mixtral at runtime: Llama's modules with routed experts (stacked 3-D parameters in transformers 5,
one Linear per expert in a saved checkpoint). The planner's side is blueprint/families/mixtral.py."""

from __future__ import annotations

from partrain.models.families.base import Adapter, LegacyExperts
from partrain.models.families.llama import LLAMA_PATHS

MIXTRAL = Adapter(
    family="mixtral",
    archs=("mixtral",),
    **LLAMA_PATHS,
    is_moe=True,
    experts_attr="mlp.experts",
    expert_param_names=("gate_up_proj", "down_proj"),
    router_attr="mlp.gate",
    legacy_experts=LegacyExperts("block_sparse_moe.experts", gate="w1", up="w3", down="w2"),
    checkpoint_renames=((".mlp.gate.", ".block_sparse_moe.gate."),),
)
