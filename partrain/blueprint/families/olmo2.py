"""OLMo 2 for the planner: Llama's projections (optional biases on all four attention projections,
none on the MLP); q_norm / k_norm over the whole q and k projections (RMSNorms of width
heads x head_dim and kv_heads x head_dim, not per head); and its two residual-stream norms after
attention and after the MLP, not before (no input_layernorm). The runtime side is
partrain/models/families/olmo2.py.

Tensor parallelism follows transformers' plan: q, k and v column-parallel with their outputs
gathered (a norm over the whole width needs every head), o_proj row-parallel on its slice of the
whole input, the MLP as Llama's. Every rank then runs all heads of attention: the planner's
per-rank attention activations (split over tp as for Llama) are a lower bound under tp.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, List

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import ModelExtras, TensorSpec

POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")


def layer_tensors(f: Any, x: ModelExtras, i: int) -> List[TensorSpec]:
    """HF's registration order: attention (q, k, v, o, then q_norm and k_norm), the MLP, the two
    post-norms."""
    base = [t for t in llama.layer_tensors(f, x, i) if not t.name.endswith("layernorm.weight")]
    prefix = f"model.layers.{i}."
    attention = [t for t in base if t.name.startswith(prefix + "self_attn.")]
    mlp = [t for t in base if t.name.startswith(prefix + "mlp.")]
    norms = [
        TensorSpec(prefix + "self_attn.q_norm.weight", (f.heads * f.head_dim,), "layer", i),
        TensorSpec(prefix + "self_attn.k_norm.weight", (f.kv_heads * f.head_dim,), "layer", i),
    ]
    post = [TensorSpec(prefix + f"{norm}.weight", (f.hidden,), "layer", i) for norm in POST_NORMS]
    return attention + norms + mlp + post


OLMO2 = replace(
    llama.LLAMA,
    name="olmo2",
    arch="olmo2",
    extras=partial(llama.extras, attention_bias=True),
    layer_tensors=layer_tensors,
    qk_norm=True,
    tp_plan_gathers=True,
)
