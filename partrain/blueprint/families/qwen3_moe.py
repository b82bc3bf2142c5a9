"""Qwen3-MoE for the planner: Qwen2-MoE's routed experts and sparse-layer rule without the shared
expert, per-head q_norm / k_norm in attention, the experts registered before the router, and an
optional attention_bias on every attention projection. The runtime side is
partrain/models/families/qwen3_moe.py."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

from partrain.blueprint.families import llama
from partrain.blueprint.families.qwen2_moe import QWEN2_MOE, moe_facts, sparse_layers

QWEN3_MOE = replace(
    QWEN2_MOE,
    name="qwen3_moe",
    arch="qwen3_moe",
    facts=partial(moe_facts, shared_expert=False, qkv_bias=False),
    extras=partial(llama.extras, attention_bias=True, norm_topk=True, sparse=sparse_layers),
    layer_tensors=partial(llama.layer_tensors, qk_norm=True, experts_first=True),
    qk_norm=True,
    shared_expert=False,
    moe_input_casts=1,
    # Its attention takes head_dim from the config when set (Qwen3-30B-A3B: 128, not hidden / heads).
    undeclared_fields={"head_dim": None},
)
