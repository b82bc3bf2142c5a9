"""DeepSeek-V3 for the planner: multi-head latent attention (ModelFacts.latent_attention: a query latent
of q_lora_rank, one key/value latent of kv_lora_rank expanded per head, a rotary key part shared by the
heads), dense MLPs in the first `first_k_dense_replace` layers (intermediate_size), routed experts of
moe_intermediate_size in the others beside `n_shared_experts` always-on shared experts (one MLP of
n_shared_experts x moe_intermediate_size, no gate), a sigmoid router picking top-k inside the top
`topk_group` of `n_group` expert groups. The runtime side is partrain/models/families/deepseek_v3.py.

Tensor parallelism follows transformers' plan: the dense MLPs and the shared experts are column/row
parallel; attention and the router stay whole on every tp rank. The planner's attention figures (memory,
FLOPs) count heads of `qk_nope_head_dim + qk_rope_head_dim` as its Llama formulas do: values are
narrower (v_head_dim) and the latents are extra, so those figures are approximate (the report says so);
parameter counts are exact.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Dict, List, Tuple

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import (
    LatentAttention,
    ModelExtras,
    TensorSpec,
    Values,
    must_divide,
    optional_int,
    positive_int,
)
from partrain.errors import ConfigError, Problem


def facts(values: Values, arch: str) -> Dict[str, Any]:
    common = llama.common_facts(values, arch)
    latent = LatentAttention(
        q_lora_rank=optional_int(values, "q_lora_rank", arch) or 0,
        kv_lora_rank=positive_int(values, "kv_lora_rank", arch),
        qk_nope_head_dim=positive_int(values, "qk_nope_head_dim", arch),
        qk_rope_head_dim=positive_int(values, "qk_rope_head_dim", arch),
        v_head_dim=positive_int(values, "v_head_dim", arch),
    )
    experts = positive_int(values, "n_routed_experts", arch)
    groups = positive_int(values, "n_group", arch)
    must_divide(
        groups, experts, "model.config.n_group", f"the router's expert groups must split n_routed_experts={experts}"
    )
    top_groups, top_k = positive_int(values, "topk_group", arch), positive_int(values, "num_experts_per_tok", arch)
    if top_groups > groups or top_k > top_groups * (experts // groups):
        raise ConfigError(
            Problem(
                "model.config.topk_group",
                top_groups,
                f"the router picks num_experts_per_tok={top_k} experts inside topk_group groups of "
                f"{experts // groups} (n_group={groups}): too few groups to pick from",
                f"set model.config.topk_group between {-(-top_k // (experts // groups))} and {groups}",
            )
        )
    dense = min(int(values.get("first_k_dense_replace") or 0), common["n_layers"])
    moe_ffn = positive_int(values, "moe_intermediate_size", arch)
    return dict(
        common,
        head_dim=latent.qk_nope_head_dim + latent.qk_rope_head_dim,
        qkv_bias=False,  # attention_bias adds biases to q_a_proj, kv_a_proj_with_mqa and o_proj only
        ffn=moe_ffn,
        n_experts=experts,
        experts_per_token=top_k,
        shared_expert_ffn=moe_ffn * int(values.get("n_shared_experts") or 0),
        moe_layers=common["n_layers"] - dense,
        latent_attention=latent,
    )


def sparse_layers(values: Values, f: Any) -> Tuple[Tuple[bool, ...], int]:
    dense = int(values.get("first_k_dense_replace") or 0)
    return tuple(i >= dense for i in range(f.n_layers)), int(values.get("intermediate_size") or 0)


def layer_tensors(f: Any, x: ModelExtras, i: int) -> List[TensorSpec]:
    """HF's registration order: attention's latents and projections, the MLP (or the experts, the router
    and the shared experts), the two norms."""
    a: LatentAttention = f.latent_attention
    h, heads = f.hidden, f.heads
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    p = f"model.layers.{i}."
    L = lambda name, shape, tp_dim=None, expert=False: TensorSpec(p + name, shape, "layer", i, tp_dim, expert)  # noqa: E731
    bias = x.out_bias  # attention_bias
    out: List[TensorSpec] = []
    if a.q_lora_rank:
        out.append(L("self_attn.q_a_proj.weight", (a.q_lora_rank, h)))
        out += [L("self_attn.q_a_proj.bias", (a.q_lora_rank,))] if bias else []
        out.append(L("self_attn.q_a_layernorm.weight", (a.q_lora_rank,)))
        out.append(L("self_attn.q_b_proj.weight", (heads * qk, a.q_lora_rank)))
    else:
        out.append(L("self_attn.q_proj.weight", (heads * qk, h)))
    out.append(L("self_attn.kv_a_proj_with_mqa.weight", (a.kv_lora_rank + a.qk_rope_head_dim, h)))
    out += [L("self_attn.kv_a_proj_with_mqa.bias", (a.kv_lora_rank + a.qk_rope_head_dim,))] if bias else []
    out.append(L("self_attn.kv_a_layernorm.weight", (a.kv_lora_rank,)))
    out.append(L("self_attn.kv_b_proj.weight", (heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank)))
    out.append(L("self_attn.o_proj.weight", (h, heads * a.v_head_dim)))
    out += [L("self_attn.o_proj.bias", (h,))] if bias else []
    if x.sparse_layers and x.sparse_layers[i]:
        e, ffn, s = f.n_experts, f.ffn, f.shared_expert_ffn
        out += [
            L("mlp.experts.gate_up_proj", (e, 2 * ffn, h), None, True),
            L("mlp.experts.down_proj", (e, h, ffn), None, True),
            L("mlp.gate.weight", (e, h)),
            L("mlp.shared_experts.gate_proj.weight", (s, h), 0),
            L("mlp.shared_experts.up_proj.weight", (s, h), 0),
            L("mlp.shared_experts.down_proj.weight", (h, s), 1),
        ]
    else:
        ffn = x.dense_ffn or f.ffn
        out += [
            L("mlp.gate_proj.weight", (ffn, h), 0),
            L("mlp.up_proj.weight", (ffn, h), 0),
            L("mlp.down_proj.weight", (h, ffn), 1),
        ]
    return out + [L("input_layernorm.weight", (h,)), L("post_attention_layernorm.weight", (h,))]


def default_extras(f: Any) -> ModelExtras:
    dense = f.n_layers - f.moe_layers
    return ModelExtras(sparse_layers=tuple(i >= dense for i in range(f.n_layers)))


DEEPSEEK_V3 = replace(
    llama.LLAMA,
    name="deepseek_v3",
    arch="deepseek_v3",
    facts=facts,
    extras=partial(llama.extras, attention_bias=True, norm_topk=True, sparse=sparse_layers),
    default_extras=default_extras,
    layer_tensors=layer_tensors,
    lora_projections=(
        "q_proj",
        "q_a_proj",
        "q_b_proj",
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "o_proj",
        *llama.DENSE_MLP,
    ),
    shared_expert=True,
    router_bias=True,
    moe_input_casts=3,  # router, experts, shared experts
)
