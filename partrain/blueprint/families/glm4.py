"""GLM-4 for the planner: Llama's attention with q/k/v biases (attention_bias, on by default) and none on
o_proj; gate and up fused into one gate_up_proj; four norms a layer (post_self_attn_layernorm and
post_mlp_layernorm after each block, besides the two before); rotary on part of each head
(rope_parameters' partial_rotary_factor, inside HF's attention). The runtime side is
partrain/models/families/glm4.py.

Tensor parallelism follows transformers' plan: q, k, v column- and o_proj row-parallel as Llama's;
gate_up_proj column-parallel with its output gathered (the gate and up halves are cut from the whole
output) and down_proj row-parallel on its slice of the whole input. Every rank then holds the MLP's
whole activation: the planner's per-rank MLP activations (split over tp as for Llama) are a lower
bound under tp.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import ModelExtras, TensorSpec

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm")


def layer_tensors(f: Any, x: ModelExtras, i: int) -> List[TensorSpec]:
    """HF's registration order: attention, the fused MLP, the four norms."""
    prefix = f"model.layers.{i}."
    attention = [t for t in llama.layer_tensors(f, x, i) if t.name.startswith(prefix + "self_attn.")]
    h, ffn = f.hidden, x.dense_ffn or f.ffn
    mlp = [
        TensorSpec(prefix + "mlp.gate_up_proj.weight", (2 * ffn, h), "layer", i, 0),
        TensorSpec(prefix + "mlp.down_proj.weight", (h, ffn), "layer", i, 1),
    ]
    norms = [TensorSpec(prefix + f"{norm}.weight", (h,), "layer", i) for norm in LAYER_NORMS]
    return attention + mlp + norms


GLM4 = replace(
    llama.LLAMA,
    name="glm4",
    arch="glm4",
    extras=llama.extras,
    layer_tensors=layer_tensors,
    residual_norms=4,
    lora_projections=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
    tp_plan_gathers=True,
)
