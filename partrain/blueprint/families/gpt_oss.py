"""gpt-oss for the planner: Llama-style attention with q/k/v/o biases (attention_bias) and one sink
logit per head, local and global layers (layer_types), routed experts in every layer stored transposed
with per-expert biases ([E, H, 2I] + [E, 2I], [E, I, H] + [E, H]), a router with a bias, top-k weights
softmaxed in the compute dtype, eager attention (transformers' SDPA path has no sinks). The runtime side
is partrain/models/families/gpt_oss.py.

Tensor parallelism follows transformers' plan, which splits no decoder-layer tensor of gpt-oss: only the
embedding and the head are vocabulary-parallel; expert parallelism splits the experts.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, List

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import ModelExtras, TensorSpec
from partrain.blueprint.families.mixtral import every_layer_sparse
from partrain.blueprint.families.mixtral import facts as mixtral_facts


def layer_tensors(f: Any, x: ModelExtras, i: int) -> List[TensorSpec]:
    """HF's registration order: the sinks (a parameter of attention itself) before its projections."""
    h, e, ffn = f.hidden, f.n_experts, f.ffn
    q, kv = f.heads * f.head_dim, f.kv_heads * f.head_dim
    p = f"model.layers.{i}."
    L = lambda name, shape, expert=False: TensorSpec(p + name, shape, "layer", i, None, expert)  # noqa: E731
    out = [L("self_attn.sinks", (f.heads,))]
    for name, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
        out.append(L(f"self_attn.{name}.weight", (rows, cols)))
        if f.qkv_bias:
            out.append(L(f"self_attn.{name}.bias", (rows,)))
    return out + [
        L("mlp.router.weight", (e, h)),
        L("mlp.router.bias", (e,)),
        L("mlp.experts.gate_up_proj", (e, h, 2 * ffn), True),
        L("mlp.experts.gate_up_proj_bias", (e, 2 * ffn), True),
        L("mlp.experts.down_proj", (e, ffn, h), True),
        L("mlp.experts.down_proj_bias", (e, h), True),
        L("input_layernorm.weight", (h,)),
        L("post_attention_layernorm.weight", (h,)),
    ]


GPT_OSS = replace(
    llama.LLAMA,
    name="gpt_oss",
    arch="gpt_oss",
    facts=mixtral_facts,  # the same keys: num_local_experts, num_experts_per_tok, intermediate_size
    extras=partial(llama.extras, attention_bias=True, sparse=every_layer_sparse),
    layer_tensors=layer_tensors,
    lora_projections=llama.ATTENTION,
    routing_weights_in_compute_dtype=True,
    attention_sinks=True,
    # HF alternates sliding-window and global layers (layer_types) whenever sliding_window is set.
    window_always=True,
)
