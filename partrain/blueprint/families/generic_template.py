"""The template path: a dense transformers family unlike any verified one, trained from what a survey
recorded of its tensors, module paths and plans, without a family file.

partrain/models/generic_template_survey.py builds each dense causal-LM family the base paths leave out at
two sizes and writes every parameter as a name and a shape in the symbols below (`{i}` for the layer
index). A family is recorded (hf_facts.json, `template_families`) when the same template gives the
meta-built model's tensors exactly at both sizes, every decoder layer has the same tensors, its logits are
the head applied to the base model's output (a family whose config class ships no `base_model_tp_plan`
is recorded too, and refused tensor parallelism); the
boolean config fields that change its tensors are recorded with the value the template holds for, and a
run that sets another is refused (exit 2). Tensor parallelism follows transformers' plan (the survey
records which dimension each style splits), the module paths (embeddings, final norm, rotary, the layer's
attention, MLP and norms) come from the built model. The planner's memory and FLOPs formulas are
Llama's for these families: parameters are exact, activations approximate (the report says so).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Mapping, Optional, Tuple

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import Family, ModelExtras, TensorSpec, Values, positive_int
from partrain.blueprint.families.generic import SNAPSHOT
from partrain.errors import ConfigError, Problem

TEMPLATE_KEY = "template_families"
"""hf_facts.json's map of the families the template survey found to their record (TemplateRecord)."""
NOT_TEMPLATE_KEY = "not_template"
"""hf_facts.json's map of the dense families the template survey left out, and why."""

SYMBOLS = ("H", "V", "I", "2I", "Q", "KV", "QKV", "D", "1")
"""What a recorded dimension may be: hidden, vocabulary, MLP width, twice it (fused gate and up), query
heads x head width, key/value heads x head width, both fused with the queries, head width, one."""

TEMPLATE_NOTE = (
    "template path: tensors, plans and module paths recorded from transformers' own model, transformers' forward; "
    "dp, ZeRO/FSDP{tp}, sp, LoRA{pp}; memory and FLOPs by Llama's formulas"
)
"""What the dry run and docs/families.md say of a family on the template path."""

Entry = Tuple[str, Tuple[str, ...], Optional[int]]
"""(name, shape in SYMBOLS, the dimension tensor parallelism splits or None)."""


@dataclass(frozen=True)
class TemplateRecord:
    """What the survey recorded of one family (hf_facts.json, `template_families`)."""

    embed: Tuple[Entry, ...]
    """Parameters before the decoder layers, the token embedding first."""
    layer: Tuple[Entry, ...]
    """One decoder layer's parameters in registration order, named with `{i}` for its index."""
    final: Tuple[Entry, ...]
    """Parameters after the layers but the head's weight (the planner adds it where it is not tied)."""
    fixed_flags: Mapping[str, Any]
    """Boolean config fields that change the tensors, with the value the template holds for."""
    norm: str
    """layernorm (with a bias) or rmsnorm: the planner's memory formulas."""
    gated: bool
    """The MLP has a gate projection."""
    embedding_paths: Tuple[str, ...]
    final_norm_path: str
    rotary_path: Optional[str]
    attention_attr: str
    mlp_attr: str
    layer_norms: Tuple[str, ...]
    """The norms of a decoder layer (its direct children that are norms)."""
    megatron_sp: bool
    """Its row-parallel projections are named o_proj and down_proj, where partrain's Megatron-SP hands the
    residual back as sequence shards."""
    attention_interface: bool
    """Its attention calls transformers' attention interface (sp replaces the kernel there)."""
    tensor_parallel: bool = True
    """Its config class ships a `base_model_tp_plan` (without one, parallel.tp > 1 is refused)."""

    @staticmethod
    def from_json(data: Dict[str, Any]) -> "TemplateRecord":
        entries = lambda rows: tuple((n, tuple(s), d) for n, s, d in rows)  # noqa: E731
        return TemplateRecord(
            **{
                **data,
                "embed": entries(data["embed"]),
                "layer": entries(data["layer"]),
                "final": entries(data["final"]),
                "embedding_paths": tuple(data["embedding_paths"]),
                "layer_norms": tuple(data["layer_norms"]),
            }
        )

    def to_json(self) -> Dict[str, Any]:
        rows = lambda entries: [[n, list(s), d] for n, s, d in entries]  # noqa: E731
        return {
            **self.__dict__,
            "embed": rows(self.embed),
            "layer": rows(self.layer),
            "final": rows(self.final),
            "fixed_flags": dict(self.fixed_flags),
            "embedding_paths": list(self.embedding_paths),
            "layer_norms": list(self.layer_norms),
        }


def template_facts(values: Values, arch: str, record: TemplateRecord) -> Dict[str, Any]:
    for flag, held in sorted(record.fixed_flags.items()):
        if values.get(flag, held) != held:
            raise ConfigError(
                Problem(
                    f"model.config.{flag}",
                    values.get(flag),
                    f"{arch} is on the template path, whose tensors were recorded with {flag}={held} "
                    "(the field changes them)",
                    f"remove model.config.{flag} (or use a pretrained folder with {flag}={held})",
                )
            )
    common = llama.common_facts(values, arch)
    return dict(
        common,
        ffn=positive_int(values, "intermediate_size", arch),
        norm=record.norm,
        gated_mlp=record.gated,
        qkv_bias=any(n.endswith(".bias") and "attn" in n for n, _, _ in record.layer),
    )


def symbol_values(f: Any) -> Dict[str, int]:
    q, kv = f.heads * f.head_dim, f.kv_heads * f.head_dim
    return {"H": f.hidden, "V": f.vocab, "I": f.ffn, "2I": 2 * f.ffn, "Q": q, "KV": kv, "QKV": q + 2 * kv}


def _specs(entries: Tuple[Entry, ...], f: Any, part: str, layer: int = -1) -> List[TensorSpec]:
    value = {**symbol_values(f), "D": f.head_dim, "1": 1}
    return [
        TensorSpec(name.format(i=layer), tuple(value[s] for s in shape), _part(name, part), layer, tp_dim)
        for name, shape, tp_dim in entries
    ]


def _part(name: str, part: str) -> str:
    """An lm_head tensor besides its weight (Phi's bias) is the head's, split over the vocabulary with it."""
    return "head" if name.startswith("lm_head.") else part


def template_family(arch: str, record: TemplateRecord) -> Family:
    leaves = {n.rsplit(".", 2)[-2] for n, shape, _ in record.layer if len(shape) == 2 and n.endswith(".weight")}
    return replace(
        llama.LLAMA,
        name="generic",
        arch=arch,
        facts=lambda values, a: template_facts(values, a, record),
        extras=llama.extras,
        default_extras=lambda facts: ModelExtras(),
        embed_tensors=lambda f: _specs(record.embed, f, "embed"),
        layer_tensors=lambda f, x, i: _specs(record.layer, f, "layer", i),
        final_norm_tensors=lambda f: _specs(record.final, f, "final"),
        lora_projections=tuple(sorted(leaves)),
        generic=True,
        window_always=True,
    )


_RECORDED = json.loads(SNAPSHOT.read_text())
TEMPLATE_RECORDS: Dict[str, TemplateRecord] = {
    arch: TemplateRecord.from_json(data) for arch, data in _RECORDED.get(TEMPLATE_KEY, {}).items()
}
"""model_type -> its record, as the last snapshot wrote them."""
NOT_TEMPLATE: Dict[str, str] = dict(_RECORDED.get(NOT_TEMPLATE_KEY, {}))
TEMPLATE_FAMILIES: Dict[str, Family] = {arch: template_family(arch, r) for arch, r in TEMPLATE_RECORDS.items()}
