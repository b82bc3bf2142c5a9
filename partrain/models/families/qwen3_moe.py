"""Qwen3-MoE at runtime: Qwen2-MoE without the shared expert; q_norm / k_norm inside attention (per
head, so tensor parallelism keeps them replicated and sums their gradients: see
parallel/tensor_parallel.py). The planner's side is blueprint/families/qwen3_moe.py."""

from __future__ import annotations

from dataclasses import replace

from partrain.models.families.qwen2_moe import QWEN2_MOE

QWEN3_MOE = replace(QWEN2_MOE, family="qwen3_moe", archs=("qwen3_moe",), shared_expert_attr=None)
