"""Which of transformers' dense causal-LM families partrain can train by the template path, found by
building them (the path itself: partrain/blueprint/families/generic_template.py).

A family qualifies when its config class ships no expert plan (a `base_model_tp_plan` where it has one:
without, tensor parallelism is refused for it), keeps its base
model under `model` with its decoder layers at `model.layers`, its logits are the head applied to the base
model's output, and, built at two sizes, every parameter's shape is named by the template's symbols, the
same template (one decoder layer repeated) gives the model's tensors exactly at both, and each boolean
config field that changes the tensors is recorded with its default.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Dict, List, Optional, Tuple

from partrain.blueprint.families.generic_template import SYMBOLS, TemplateRecord, template_family

SIZES = (
    dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2, head_dim=24),
    dict(hidden_size=96, intermediate_size=208, num_attention_heads=6, num_key_value_heads=3, head_dim=20),
)
"""The two sizes (2 and 3 layers; vocabularies 256 and 320; head widths apart from hidden / heads where
the config class has a head_dim field, so that each dimension names one symbol)."""
LAYERS, VOCABS = (2, 3), (256, 320)
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
MAX_PARAMS = 20_000_000
"""A family whose small build holds more ignores the survey's size keys (other names): left out."""
BLOCK_OUTPUTS = ("o_proj", "down_proj")
"""Row-parallel projections where partrain's Megatron-SP ends a block (parallel/tensor_parallel.py)."""


def _build(arch: str, k: int, device: str, **flags: Any):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from partrain.models.generic_survey import live_class_fields

    fields = live_class_fields(arch)
    declared = set(fields["defaults"]) | set(fields["attribute_map"])
    wanted = dict(SIZES[k], num_hidden_layers=LAYERS[k], vocab_size=VOCABS[k], tie_word_embeddings=False)
    wanted.update({key: 0 for key in TOKEN_IDS})  # class defaults may lie outside a small vocabulary
    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **{key: v for key, v in wanted.items() if key in declared}, **flags)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def _values(config) -> Dict[str, int]:
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    ffn = config.intermediate_size
    q, kvw = heads * head_dim, kv * head_dim
    found = {"H": hidden, "V": config.vocab_size, "I": ffn, "2I": 2 * ffn, "Q": q, "KV": kvw, "QKV": q + 2 * kvw}
    return {**found, "D": head_dim, "1": 1}


def _tp_dim(plan: Dict[str, str], name: str) -> Optional[int]:
    module, _, leaf = name.rpartition(".")
    key = re.sub(r"^model\.", "", module).replace(".{i}.", ".*.")
    style = plan.get(key, "")
    if style.startswith("colwise"):
        return 0
    if style.startswith("rowwise") and leaf == "weight":
        return 1
    return None


def _entries(model) -> Tuple[Optional[Dict[str, List]], str]:
    """The model's parameters as template entries by part (embed, layer, final), or (None, why not)."""
    value = _values(model.config)
    plan = model.config.base_model_tp_plan or {}
    parts: Dict[str, List] = {"embed": [], "layer": [], "final": []}
    seen_layers = False
    layers: Dict[int, List] = {}
    for name, p in model.named_parameters():
        if name == "lm_head.weight":
            continue
        shape = []
        for dim in p.shape:
            named = [s for s in SYMBOLS if value[s] == dim]
            if not named:
                return None, f"{name} {list(p.shape)} has a dimension the template's sizes do not name"
            shape.append(named[0])
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match:
            seen_layers = True
            generic = f"model.layers.{{i}}.{name[match.end() :]}"
            layers.setdefault(int(match.group(1)), []).append((generic, tuple(shape), _tp_dim(plan, generic)))
        else:
            if name in ("model.embed_tokens.weight", "lm_head.bias"):
                tp_dim: Optional[int] = 0  # vocabulary-parallel (partrain's, as for every family)
            else:
                tp_dim = _tp_dim(plan, name)
            parts["final" if seen_layers else "embed"].append((name, tuple(shape), tp_dim))
    if len({tuple(t) for t in layers.values()}) != 1:
        return None, "its decoder layers do not all hold the same tensors"
    parts["layer"] = next(iter(layers.values()))
    return parts, ""


def _fixed_flags(arch: str, tensors) -> Dict[str, Any]:
    from partrain.models.generic_survey import live_class_fields

    flags = {}
    for name, default in live_class_fields(arch)["defaults"].items():
        if not isinstance(default, bool) or name == "tie_word_embeddings":
            continue
        try:
            flipped = _build(arch, 0, "meta", **{name: not default})
        except Exception:  # a value the class refuses: a user cannot set it either
            continue
        if [(n, tuple(p.shape)) for n, p in flipped.named_parameters()] != tensors:
            flags[name] = default
    return flags


def _paths(model) -> Dict[str, Any]:
    layer = model.model.layers[0]
    children = dict(layer.named_children())
    attention = next((n for n in children if "attn" in n or "attention" in n), None)
    norms = tuple(n for n, m in children.items() if "norm" in type(m).__name__.lower())
    import torch

    embeds = tuple(f"model.{n}" for n, m in model.model.named_children() if isinstance(m, torch.nn.Embedding))
    after = [n for n, _ in model.model.named_children()]
    final = [n for n in after[after.index("layers") + 1 :] if "norm" in type(getattr(model.model, n)).__name__.lower()]
    rotary = "model.rotary_emb" if hasattr(model.model, "rotary_emb") else None
    return dict(
        embedding_paths=embeds,
        final_norm_path=f"model.{final[0]}" if final else "",
        rotary_path=rotary,
        attention_attr=attention or "",
        mlp_attr="mlp" if "mlp" in children else "",
        layer_norms=norms,
    )


def template_record(arch: str) -> Tuple[Optional[TemplateRecord], str]:
    """(arch's record, "") when it qualifies (module docstring), else (None, why not)."""
    from partrain.models.generic_survey import head_is_plain

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers import AutoConfig

            config = AutoConfig.for_model(arch)
            if getattr(config, "base_model_ep_plan", None):
                return None, "a mixture-of-experts family unlike the generic MoE path's"
            meta = _build(arch, 0, "meta")
            if sum(p.numel() for p in meta.parameters()) > MAX_PARAMS:
                return None, "its config class does not take the survey's small sizes"
            model = _build(arch, 0, "cpu")
            if model.base_model_prefix != "model" or not hasattr(model.model, "layers"):
                return None, "its base model is not at `model` with its layers at `model.layers`"
            return _record(arch, model, head_is_plain)
    except Exception as exc:  # a family whose config or model cannot be built this way does not qualify
        return None, f"a small model of it could not be built from its config class ({type(exc).__name__})"


def _record(arch: str, model, head_is_plain) -> Tuple[Optional[TemplateRecord], str]:
    parts, why = _entries(model)
    if parts is None:
        return None, why
    paths = _paths(model)
    if not (paths["embedding_paths"] and paths["final_norm_path"] and paths["attention_attr"] and paths["mlp_attr"]):
        return None, "its embeddings, final norm, attention or MLP are not where the template path looks"
    tensors = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    plan = model.config.base_model_tp_plan or {}
    rows = {k.rsplit(".", 1)[-1] for k, style in plan.items() if style.startswith("rowwise")}
    gathers = any(style.endswith(("gather_output", "split_input")) for style in plan.values())
    record = TemplateRecord(
        embed=tuple(parts["embed"]),
        layer=tuple(parts["layer"]),
        final=tuple(parts["final"]),
        fixed_flags=_fixed_flags(arch, tensors),
        norm="layernorm" if any(".bias" in n and "norm" in n for n, _, _ in parts["layer"]) else "rmsnorm",
        gated=any("gate" in n for n, _, _ in parts["layer"]),
        megatron_sp=bool(plan) and rows <= set(BLOCK_OUTPUTS) and not gathers,
        tensor_parallel=bool(plan),
        attention_interface=bool(getattr(model, "_supports_attention_backend", False)),
        **paths,
    )
    for k, built in ((0, model), (1, _build(arch, 1, "meta"))):
        if _planner_tensors(arch, record, built) != [(n, tuple(p.shape)) for n, p in built.named_parameters()]:
            return None, f"its tensors at the survey's size {k + 1} are not its template's"
    if not head_is_plain(model):
        return None, "its logits are not the head applied to the base model's output"
    return record, ""


def _planner_tensors(arch: str, record: TemplateRecord, model) -> List[Tuple[str, tuple]]:
    from partrain.blueprint.model_facts import ModelFacts
    from partrain.blueprint.planner.params import with_head

    fam = template_family(arch, record)
    values = {k: v for k, v in model.config.to_dict().items()}
    facts = ModelFacts(arch=arch, config_class="", **fam.facts(values, arch))
    specs = fam.embed_tensors(facts)
    for i in range(facts.n_layers):
        specs += fam.layer_tensors(facts, None, i)
    specs += fam.final_norm_tensors(facts)
    return [(t.name, tuple(t.shape)) for t in with_head(specs, facts)]


def template_survey(candidates: List[str]) -> Tuple[Dict[str, TemplateRecord], Dict[str, str]]:
    """The candidates that qualify, and why each other one does not."""
    found, why_not = {}, {}
    for arch in candidates:
        record, why = template_record(arch)
        if record is not None:
            found[arch] = record
        else:
            why_not[arch] = why
    return found, why_not
