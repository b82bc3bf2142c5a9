"""The generic mixture-of-experts path: a verified base's attention and norms around transformers' fused
routed experts, a router and (when the family has them) shared experts, trained without a family file.

transformers 5 builds every MoE family's experts the same way: one module holding `gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I], named by the config class's `base_model_ep_plan`, called by the
family's own MoE block with the router's top-k choice. partrain/models/generic_survey.py builds each
causal-LM MoE family of the installed transformers and records in hf_facts.json (`generic_moe_families`)
those whose tensors are, exactly, a base's (Llama, Qwen3) with the MLP of some layers replaced by such a
block: the block's own tensors in registration order, each shape written in the symbols below, where
the router and the shared experts live, and how save_pretrained lays the experts out on disk. The
survey checks what this module computes from a record against the meta-built model at two sizes, so a
family is recorded only when the planner's tensors are its tensors.

What differs between the families' configs is read through the key lists below (the first key the
config class has). The routing itself (softmax or sigmoid, group-limited, scaled, renormalised) runs
in transformers' own MoE block: partrain replaces only the experts module (parallel/expert_parallel.py),
which a test checks gives transformers' logits exactly for every recorded family.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Dict, List, Optional, Tuple

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import Family, ModelExtras, TensorSpec, Values, positive_int
from partrain.blueprint.families.generic import SNAPSHOT
from partrain.errors import ConfigError, Problem

GENERIC_MOE_KEY = "generic_moe_families"
"""hf_facts.json's map of the MoE families the survey found to their record (MoeRecord's fields)."""
NOT_GENERIC_MOE_KEY = "not_generic_moe"
"""hf_facts.json's map of the other MoE families to why the survey left them out."""

EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
"""Config keys that count the routed experts, in the order they are read."""
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk")
"""Config keys for the experts each token is routed to."""
EXPERT_FFN_KEYS = ("moe_intermediate_size", "intermediate_size")
"""Config keys for one routed expert's width (a family without the first uses its MLP width)."""
SHARED_FFN_KEYS = ("shared_expert_intermediate_size", "shared_intermediate_size")
"""Config keys for the shared experts' whole width, where a family states it."""
SHARED_COUNT_KEYS = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
"""Config keys counting shared experts of the routed experts' width (when no width key is set)."""
DENSE_FFN_KEYS = ("dense_intermediate_size", "intermediate_size")
"""Config keys for the width of the dense layers' MLP."""

GENERIC_MOE_NOTE = (
    "generic MoE path: {base}'s attention and norms, transformers' own MoE block (router, shared experts) "
    "around partrain's routed experts, transformers' tp plan; dp, ZeRO/FSDP, tp, ep, sp, LoRA{pp}"
)
"""What the dry run and docs/families.md say of a family on the generic MoE path."""

SYMBOLS = ("H", "E", "I", "2I", "S", "2S", "1")
"""What a recorded dimension may be: hidden, routed experts, expert width, twice it, the shared experts'
width, twice it (fused gate and up), one."""


def _first(values: Values, keys: Tuple[str, ...]) -> Tuple[Optional[str], Any]:
    for key in keys:
        if values.get(key) is not None:
            return key, values[key]
    return None, None


def moe_sizes(values: Values, arch: str) -> Dict[str, int]:
    """The symbols' values (but H) from a config's merged kwargs."""
    sizes = {}
    for symbol, keys in (("E", EXPERTS_KEYS), ("K", TOP_K_KEYS), ("I", EXPERT_FFN_KEYS)):
        key, _ = _first(values, keys)
        if key is None:
            raise ConfigError(
                Problem(f"model.config.{keys[0]}", None, f"{arch} needs one of {', '.join(keys)}", "set one of them")
            )
        sizes[symbol] = positive_int(values, key, arch)
    key, width = _first(values, SHARED_FFN_KEYS)
    if key is None:
        count_key, count = _first(values, SHARED_COUNT_KEYS)
        width = int(count or 0) * sizes["I"]
    sizes["S"] = int(width or 0)
    key, _ = _first(values, DENSE_FFN_KEYS)
    sizes["D"] = positive_int(values, key, arch) if key else sizes["I"]
    return sizes


def sparse_layers(values: Values, n_layers: int, n_experts: int) -> Tuple[bool, ...]:
    """Which decoder layers hold experts, by the rule the config's keys state (the first that applies):
    a list of "dense" / "sparse" per layer; the first k layers dense; Ernie's start, end and interval;
    Qwen's step and dense-only list; else every layer."""
    types = values.get("mlp_layer_types")
    if isinstance(types, list) and len(types) == n_layers:
        return tuple(t == "sparse" for t in types)
    if "first_k_dense_replace" in values:
        dense = int(values.get("first_k_dense_replace") or 0)
        return tuple(i >= dense for i in range(n_layers))
    if "moe_layer_start_index" in values:
        start, interval = int(values.get("moe_layer_start_index") or 0), int(values.get("moe_layer_interval") or 1)
        end = values.get("moe_layer_end_index")
        end = n_layers - 1 if end is None or end < 0 else int(end)
        return tuple((i + 1) % interval == 0 and start <= i <= end for i in range(n_layers))
    if "decoder_sparse_step" in values or "mlp_only_layers" in values:
        step, dense_only = int(values.get("decoder_sparse_step") or 1), set(values.get("mlp_only_layers") or [])
        return tuple(i not in dense_only and n_experts > 0 and (i + 1) % step == 0 for i in range(n_layers))
    return (True,) * n_layers


@dataclass(frozen=True)
class MoeRecord:
    """What the survey recorded of one MoE family (hf_facts.json, `generic_moe_families`)."""

    base: str
    """The verified family whose attention, norms, embeddings and dense MLP it has (llama, qwen3)."""
    block: str
    """The MoE block inside a decoder layer ("mlp", "block_sparse_moe")."""
    tensors: Tuple[Tuple[str, Tuple[str, ...], Optional[int], bool], ...]
    """The block's parameters in registration order: (name inside the block, shape in SYMBOLS, the
    dimension transformers' tp plan splits or None, whether it is a stacked expert tensor)."""
    router: str
    """The router module inside the block (its output's first element is the router logits)."""
    shared: Optional[str] = None
    """The shared experts' module inside the block, if any."""
    router_bias: bool = False
    """The router holds DeepSeek's `e_score_correction_bias` (what parallel.moe_bias_update_speed moves)."""
    legacy: Optional[Tuple[str, str, str]] = None
    """(file experts path, gate, up, down): save_pretrained writes the experts one Linear each so."""
    output_bias: bool = True
    """config.attention_bias also adds o_proj's bias (Llama), not only q/k/v's (GLM-4.5)."""
    mlp_bias: bool = False
    """config.mlp_bias adds biases to the dense MLP's projections."""
    renames: Tuple[Tuple[str, str], ...] = ()
    """(in the model, in the file): tensors save_pretrained writes under another name (ExaONE-MoE's
    router bias), which partrain's loader reads under that name."""

    @staticmethod
    def from_json(data: Dict[str, Any]) -> "MoeRecord":
        tensors = tuple((n, tuple(s), d, bool(e)) for n, s, d, e in data["tensors"])
        legacy = tuple(data["legacy"]) if data.get("legacy") else None
        renames = tuple(tuple(pair) for pair in data.get("renames") or ())
        return MoeRecord(**{**data, "tensors": tensors, "legacy": legacy, "renames": renames})

    def to_json(self) -> Dict[str, Any]:
        return {
            "base": self.base,
            "block": self.block,
            "tensors": [[n, list(s), d, e] for n, s, d, e in self.tensors],
            "router": self.router,
            "shared": self.shared,
            "router_bias": self.router_bias,
            "legacy": list(self.legacy) if self.legacy else None,
            "output_bias": self.output_bias,
            "mlp_bias": self.mlp_bias,
            "renames": [list(pair) for pair in self.renames],
        }


def moe_facts(values: Values, arch: str) -> Dict[str, Any]:
    common = llama.common_facts(values, arch)
    sizes = moe_sizes(values, arch)
    sparse = sparse_layers(values, common["n_layers"], sizes["E"])
    return dict(
        common,
        ffn=sizes["I"],
        n_experts=sizes["E"],
        experts_per_token=sizes["K"],
        shared_expert_ffn=sizes["S"],
        moe_layers=sum(sparse),
    )


def _sparse_rule(values: Values, facts: Any) -> Tuple[Tuple[bool, ...], int]:
    return sparse_layers(values, facts.n_layers, facts.n_experts), moe_sizes(values, facts.arch)["D"]


def _default_extras(facts: Any) -> ModelExtras:
    dense = facts.n_layers - facts.moe_layers
    return ModelExtras(sparse_layers=tuple(i >= dense for i in range(facts.n_layers)))


def layer_tensors(f: Any, x: ModelExtras, i: int, record: MoeRecord, base_layer) -> List[TensorSpec]:
    """The base's decoder layer i, its MLP replaced by the recorded block where layer i holds experts."""
    dense = base_layer(replace(f, n_experts=0), replace(x, sparse_layers=()), i)
    if not (x.sparse_layers[i] if x.sparse_layers else True):
        return dense
    mlp = f"model.layers.{i}.mlp."
    at = next(k for k, t in enumerate(dense) if t.name.startswith(mlp))
    rest = [t for t in dense[at:] if not t.name.startswith(mlp)]
    s = f.shared_expert_ffn
    value = {"H": f.hidden, "E": f.n_experts, "I": f.ffn, "2I": 2 * f.ffn, "S": s, "2S": 2 * s, "1": 1}
    prefix = f"model.layers.{i}.{record.block}."
    block = [
        TensorSpec(prefix + name, tuple(value[s] for s in shape), "layer", i, tp_dim, expert)
        for name, shape, tp_dim, expert in record.tensors
    ]
    return dense[:at] + block + rest


BASE_LAYERS = {
    "llama": llama.layer_tensors,
    "qwen3": partial(llama.layer_tensors, qk_norm=True),
}
"""The bases a generic MoE family may stand on, with their decoder layer's tensors."""
_BASE_FAMILIES = {"llama": llama.LLAMA, "qwen3": llama.QWEN3}


def moe_family(arch: str, record: MoeRecord) -> Family:
    """The planner family of a recorded MoE family."""
    return replace(
        _BASE_FAMILIES[record.base],
        name="generic",
        arch=arch,
        facts=moe_facts,
        extras=partial(
            llama.extras,
            attention_bias=record.output_bias,
            mlp_bias=record.mlp_bias,
            norm_topk=True,
            sparse=_sparse_rule,
        ),
        default_extras=_default_extras,
        layer_tensors=partial(layer_tensors, record=record, base_layer=BASE_LAYERS[record.base]),
        generic=True,
        window_always=True,
        shared_expert=record.shared is not None,
        router_bias=record.router_bias,
        moe_input_casts=2 if record.shared else 1,
    )


_RECORDED = json.loads(SNAPSHOT.read_text())
GENERIC_MOE_RECORDS: Dict[str, MoeRecord] = {
    arch: MoeRecord.from_json(data) for arch, data in _RECORDED.get(GENERIC_MOE_KEY, {}).items()
}
"""model_type -> its record, as the last snapshot wrote them."""
NOT_GENERIC_MOE: Dict[str, str] = dict(_RECORDED.get(NOT_GENERIC_MOE_KEY, {}))
"""The MoE families (an experts module in their ep plan) the survey left out, and why."""
GENERIC_MOE_FAMILIES: Dict[str, Family] = {arch: moe_family(arch, r) for arch, r in GENERIC_MOE_RECORDS.items()}
