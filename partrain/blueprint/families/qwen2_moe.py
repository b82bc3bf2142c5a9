"""Qwen2-MoE for the planner: routed experts in every `decoder_sparse_step`-th layer but those in
`mlp_only_layers` (dense ones use `intermediate_size`), an always-on shared expert with a sigmoid
gate, top-k weights not renormalised by default, routing weights in the compute dtype. Qwen3-MoE
reuses the expert rules here. The runtime side is partrain/models/families/qwen2_moe.py."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Dict, Tuple

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import Values, optional_int, positive_int
from partrain.errors import ConfigError, Problem


def moe_facts(values: Values, arch: str, shared_expert: bool, qkv_bias: bool) -> Dict[str, Any]:
    common = llama.common_facts(values, arch, qkv_bias)
    n_layers = common["n_layers"]
    step = optional_int(values, "decoder_sparse_step", arch) or 1
    dense_only = values.get("mlp_only_layers") or []
    if not isinstance(dense_only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense_only):
        raise ConfigError(
            Problem("model.config.mlp_only_layers", dense_only, "must be a list of layer indices", "e.g. [0, 1], or []")
        )
    moe_layers = n_layers // step - sum(1 for i in set(dense_only) if 0 <= i < n_layers and (i + 1) % step == 0)
    return dict(
        common,
        ffn=positive_int(values, "moe_intermediate_size", arch),
        n_experts=positive_int(values, "num_experts", arch),
        experts_per_token=positive_int(values, "num_experts_per_tok", arch),
        shared_expert_ffn=(optional_int(values, "shared_expert_intermediate_size", arch) or 0) if shared_expert else 0,
        moe_layers=moe_layers,
    )


def sparse_layers(values: Values, facts: Any) -> Tuple[Tuple[bool, ...], int]:
    step = int(values.get("decoder_sparse_step") or 1)
    dense_only = set(values.get("mlp_only_layers") or [])
    layers = tuple((i not in dense_only) and facts.n_experts > 0 and (i + 1) % step == 0 for i in range(facts.n_layers))
    return layers, int(values.get("intermediate_size") or 0)


QWEN2_MOE = replace(
    llama.LLAMA,
    name="qwen2_moe",
    arch="qwen2_moe",
    facts=partial(moe_facts, shared_expert=True, qkv_bias=True),
    extras=partial(llama.extras, norm_topk=True, sparse=sparse_layers),
    default_extras=partial(llama.default_extras, norm_topk_prob=False),
    layer_tensors=partial(llama.layer_tensors, shared_expert=True),
    shared_expert=True,
    moe_input_casts=4,  # router, experts, shared expert, shared-expert gate
    routing_weights_in_compute_dtype=True,
)
