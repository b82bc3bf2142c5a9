"""Phi-3 (and Phi-4-mini, the same model_type) for the planner: Llama's layer with q, k and v fused
into one qkv_proj and gate / up into one gate_up_proj, no biases, and a sliding window whenever the
config sets one (as Mistral). The runtime side is partrain/models/families/phi3.py.

Tensor parallelism follows transformers' plan: qkv_proj and gate_up_proj column-parallel with their
outputs gathered (each fused output is cut into its parts whole), o_proj and down_proj row-parallel on
their slice of the whole input. Every rank then runs all heads of attention and the whole activation
of the MLP: the planner's per-rank activations (split over tp as for Llama) are a lower bound under tp.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, List

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import ModelExtras, TensorSpec


def layer_tensors(f: Any, x: ModelExtras, i: int) -> List[TensorSpec]:
    """HF's registration order: o_proj before qkv_proj (Phi3Attention builds them so), the MLP, the norms."""
    h, q, kv, ffn = f.hidden, f.heads * f.head_dim, f.kv_heads * f.head_dim, x.dense_ffn or f.ffn
    prefix = f"model.layers.{i}."
    return [
        TensorSpec(prefix + "self_attn.o_proj.weight", (h, q), "layer", i, 1),
        TensorSpec(prefix + "self_attn.qkv_proj.weight", (q + 2 * kv, h), "layer", i, 0),
        TensorSpec(prefix + "mlp.gate_up_proj.weight", (2 * ffn, h), "layer", i, 0),
        TensorSpec(prefix + "mlp.down_proj.weight", (h, ffn), "layer", i, 1),
        TensorSpec(prefix + "input_layernorm.weight", (h,), "layer", i),
        TensorSpec(prefix + "post_attention_layernorm.weight", (h,), "layer", i),
    ]


PHI3 = replace(
    llama.LLAMA,
    name="phi3",
    arch="phi3",
    facts=partial(llama.dense_facts, qkv_bias=False),
    extras=llama.extras,
    layer_tensors=layer_tensors,
    lora_projections=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    tp_plan_gathers=True,
    window_always=True,
)
