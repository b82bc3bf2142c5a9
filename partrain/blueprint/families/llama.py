"""Llama for the planner, and what every Llama-style family reuses: config facts, extras and the
parameter tensors of a decoder layer (dense MLP or MoE block). Qwen2 and Mistral are variants of
LLAMA (below), not copies; the MoE families (mixtral.py, qwen2_moe.py, qwen3_moe.py) pass their
differences to the functions here. The runtime side is partrain/models/families/llama.py.

Tensor parallelism (partrain/parallel/tensor_parallel.py, from HF's base_model_tp_plan): q/k/v/gate/up
weights and q/k/v biases column-parallel (dim 0 of the [out, in] weight), o/down row-parallel (dim 1;
their biases replicated), token embedding and lm_head vocabulary-parallel (dim 0). Routed experts,
routers and shared experts stay replicated over TP (expert parallelism splits dim 0 of the stacked
experts), and so do per-head q_norm / k_norm (their gradients summed over TP).
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Tuple

from partrain.blueprint.families.base import (
    Family,
    ModelExtras,
    TensorSpec,
    Values,
    layer_count,
    must_divide,
    optional_int,
    positive_int,
)

SparseRule = Callable[[Values, Any], Tuple[Tuple[bool, ...], int]]
"""(values, facts) -> (whether each layer holds experts, width of the dense layers' MLP; 0 = facts.ffn)."""


def common_facts(values: Values, arch: str, qkv_bias: bool = False) -> Dict[str, Any]:
    """Facts every Llama-style family reads the same way; `qkv_bias`: q/k/v biases by default (Qwen)."""
    hidden, heads = positive_int(values, "hidden_size", arch), positive_int(values, "num_attention_heads", arch)
    kv_heads = optional_int(values, "num_key_value_heads", arch) or heads
    must_divide(
        kv_heads,
        heads,
        "model.config.num_key_value_heads",
        f"must divide the attention heads num_attention_heads={heads} (each KV head serves a group of query heads)",
    )
    return dict(
        n_layers=layer_count(values, "num_hidden_layers", arch),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=optional_int(values, "head_dim", arch) or hidden // heads,
        vocab=positive_int(values, "vocab_size", arch),
        max_positions=positive_int(values, "max_position_embeddings", arch),
        tied_embeddings=bool(values.get("tie_word_embeddings", False)),
        norm="rmsnorm",
        gated_mlp=True,
        qkv_bias=bool(values.get("attention_bias") or values.get("qkv_bias") or qkv_bias),
    )


def dense_facts(values: Values, arch: str, qkv_bias: bool = False) -> Dict[str, Any]:
    return dict(common_facts(values, arch, qkv_bias), ffn=positive_int(values, "intermediate_size", arch))


def extras(
    values: Values,
    facts: Any,
    attn_impl: str,
    attention_bias: bool = False,
    mlp_bias: bool = False,
    norm_topk: bool = False,
    sparse: Optional[SparseRule] = None,
) -> ModelExtras:
    """ModelExtras of a Llama-style model. attention_bias / mlp_bias / norm_topk: whether the HF class
    reads that config key (others ignore it); `sparse`: the family's rule for which layers hold experts."""
    layers, dense_ffn = sparse(values, facts) if sparse else ((), 0)
    return ModelExtras(
        activation=str(values.get("hidden_act") or "silu"),
        attn_dropout=float(values.get("attention_dropout") or 0) > 0,
        attn_impl=attn_impl,
        out_bias=bool(values.get("attention_bias")) if attention_bias else False,
        mlp_bias=bool(values.get("mlp_bias")) if mlp_bias else False,
        dense_ffn=dense_ffn,
        sparse_layers=layers,
        norm_topk_prob=bool(values.get("norm_topk_prob", True)) if norm_topk else True,
    )


def default_extras(facts: Any, norm_topk_prob: bool = True) -> ModelExtras:
    sparse = (True,) * facts.n_layers if facts.is_moe else ()
    return ModelExtras(sparse_layers=sparse, norm_topk_prob=norm_topk_prob)


def embed_tensors(f: Any) -> List[TensorSpec]:
    return [TensorSpec("model.embed_tokens.weight", (f.vocab, f.hidden), "embed", tp_dim=0)]


def final_norm_tensors(f: Any) -> List[TensorSpec]:
    return [TensorSpec("model.norm.weight", (f.hidden,), "final")]


def layer_tensors(
    f: Any, x: ModelExtras, i: int, qk_norm: bool = False, experts_first: bool = False, shared_expert: bool = False
) -> List[TensorSpec]:
    """Decoder layer i. qk_norm: per-head q/k norms; experts_first: HF registers the experts before the
    router (Qwen3-MoE); shared_expert: Qwen2-MoE's shared expert and its gate."""
    h = f.hidden
    q, kv = f.heads * f.head_dim, f.kv_heads * f.head_dim
    p = f"model.layers.{i}."
    L = lambda name, shape, tp_dim=None, expert=False: TensorSpec(p + name, shape, "layer", i, tp_dim, expert)  # noqa: E731
    out = [L("self_attn.q_proj.weight", (q, h), 0)]
    if f.qkv_bias:
        out.append(L("self_attn.q_proj.bias", (q,), 0))
    out.append(L("self_attn.k_proj.weight", (kv, h), 0))
    if f.qkv_bias:
        out.append(L("self_attn.k_proj.bias", (kv,), 0))
    out.append(L("self_attn.v_proj.weight", (kv, h), 0))
    if f.qkv_bias:
        out.append(L("self_attn.v_proj.bias", (kv,), 0))
    out.append(L("self_attn.o_proj.weight", (h, q), 1))
    if x.out_bias:
        out.append(L("self_attn.o_proj.bias", (h,)))
    if qk_norm:  # per-head RMSNorm of q and k: replicated over TP (HF: replicated_with_grad_allreduce)
        out += [L("self_attn.q_norm.weight", (f.head_dim,)), L("self_attn.k_norm.weight", (f.head_dim,))]
    if f.is_moe and (x.sparse_layers[i] if x.sparse_layers else True):
        e, ffn = f.n_experts, f.ffn
        router = [L("mlp.gate.weight", (e, h))]
        experts = [
            L("mlp.experts.gate_up_proj", (e, 2 * ffn, h), None, True),
            L("mlp.experts.down_proj", (e, h, ffn), None, True),
        ]
        out += experts + router if experts_first else router + experts  # HF's registration order
        if shared_expert:
            s = f.shared_expert_ffn
            out += [
                L("mlp.shared_expert.gate_proj.weight", (s, h)),
                L("mlp.shared_expert.up_proj.weight", (s, h)),
                L("mlp.shared_expert.down_proj.weight", (h, s)),
                L("mlp.shared_expert_gate.weight", (1, h)),
            ]
        return out + [L("input_layernorm.weight", (h,)), L("post_attention_layernorm.weight", (h,))]
    ffn = x.dense_ffn or f.ffn
    out.append(L("mlp.gate_proj.weight", (ffn, h), 0))
    if x.mlp_bias:
        out.append(L("mlp.gate_proj.bias", (ffn,), 0))
    out.append(L("mlp.up_proj.weight", (ffn, h), 0))
    if x.mlp_bias:
        out.append(L("mlp.up_proj.bias", (ffn,), 0))
    out.append(L("mlp.down_proj.weight", (h, ffn), 1))
    if x.mlp_bias:
        out.append(L("mlp.down_proj.bias", (h,)))
    return out + [L("input_layernorm.weight", (h,)), L("post_attention_layernorm.weight", (h,))]


ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
LLAMA_PROJECTIONS = ATTENTION + DENSE_MLP
"""LoRA's projections of a Llama-style model. Mixture-of-experts families: attention, plus the dense MLPs
that are nn.Linear modules (Qwen2-MoE's shared expert, Qwen3-MoE's mlp_only_layers); the routed experts
are stacked 3-D parameters (one tensor for all experts), which get no adapters: they stay frozen, as
does the router. Mixtral has no dense MLP: attention only."""

CONFIG_KEYS = dict(
    hidden="hidden_size",
    ffn="intermediate_size",
    layers="num_hidden_layers",
    heads="num_attention_heads",
    kv_heads="num_key_value_heads",
    vocab="vocab_size",
    positions="max_position_embeddings",
)

LLAMA = Family(
    name="llama",
    arch="llama",
    facts=dense_facts,
    extras=partial(extras, attention_bias=True, mlp_bias=True),
    default_extras=default_extras,
    embed_tensors=embed_tensors,
    layer_tensors=layer_tensors,
    final_norm_tensors=final_norm_tensors,
    config_keys=CONFIG_KEYS,
    lora_projections=LLAMA_PROJECTIONS,
)

# Qwen2: q/k/v biases by default; its HF class reads neither attention_bias nor mlp_bias for o/MLP.
QWEN2 = replace(LLAMA, arch="qwen2", facts=partial(dense_facts, qkv_bias=True), extras=extras)

# Mistral: Llama's tensors without the optional o/MLP biases; a sliding window whenever one is set.
MISTRAL = replace(LLAMA, arch="mistral", extras=extras, window_always=True)

# Qwen3 (dense): per-head q_norm / k_norm in attention (replicated over TP, gradients summed), an
# optional attention_bias on all four attention projections and none on the MLP; head_dim is a
# declared config field (Qwen3-8B: 128, not hidden / heads).
QWEN3 = replace(
    LLAMA,
    arch="qwen3",
    extras=partial(extras, attention_bias=True),
    layer_tensors=partial(layer_tensors, qk_norm=True),
    qk_norm=True,
)

# SmolLM3: Llama's tensors (optional attention and MLP biases, read by its HF class); rotary skipped on
# the layers `no_rope_layers` marks 0 (inside HF's attention: nothing for partrain to do); embeddings
# tied by default.
SMOLLM3 = replace(LLAMA, arch="smollm3")

# Granite: Llama's tensors and biases; its four multipliers scale activations, not parameters or FLOPs.
GRANITE = replace(LLAMA, arch="granite")
