"""Mixtral for the planner: Llama's layer with routed experts in every layer (stacked [E, ...]
tensors, split by expert parallelism), router before experts, fp32 routing weights. The runtime
side is partrain/models/families/mixtral.py."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Dict, Tuple

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import Values, positive_int


def facts(values: Values, arch: str) -> Dict[str, Any]:
    common = llama.common_facts(values, arch)
    return dict(
        common,
        ffn=positive_int(values, "intermediate_size", arch),
        n_experts=positive_int(values, "num_local_experts", arch),
        experts_per_token=positive_int(values, "num_experts_per_tok", arch),
        moe_layers=common["n_layers"],
    )


def every_layer_sparse(values: Values, facts: Any) -> Tuple[Tuple[bool, ...], int]:
    return (True,) * facts.n_layers, 0


MIXTRAL = replace(
    llama.LLAMA,
    name="mixtral",
    arch="mixtral",
    facts=facts,
    extras=partial(llama.extras, sparse=every_layer_sparse),
    window_always=True,
    lora_projections=llama.ATTENTION,
)
