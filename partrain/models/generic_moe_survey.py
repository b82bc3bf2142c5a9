"""Which of transformers' MoE causal-LM families partrain can train by the generic MoE path, found by
building them (the path itself: partrain/blueprint/families/generic_moe.py).

A family qualifies when, built small from its config class at two sizes:
1. its config class ships a `base_model_ep_plan` naming one experts module per MoE layer (fused
   `gate_up_proj` / `down_proj`), and a `base_model_tp_plan`;
2. every parameter is a base's (Llama, Qwen3) but those of the MoE block around the experts, and the
   planner's tensors computed from the recorded block (generic_moe.MoeRecord) are the model's exactly,
   names, shapes and order, at both sizes;
3. the router is a module of the block whose output (its first element) is the [tokens, experts] logits;
4. save_pretrained writes the experts fused or one gate / up / down Linear each (what partrain loads);
5. its logits are the head applied to the base model's output (partrain's chunked loss calls the head).
"""

from __future__ import annotations

import itertools
import re
import tempfile
import warnings
from typing import Any, Dict, List, Optional, Tuple

from partrain.blueprint.families.generic_moe import (
    EXPERTS_KEYS,
    SHARED_COUNT_KEYS,
    SHARED_FFN_KEYS,
    SYMBOLS,
    TOP_K_KEYS,
    MoeRecord,
    moe_family,
    moe_sizes,
)

SIZES = (
    dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    dict(hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2),
)
"""The two sizes a family is built at (head_dim 16, vocabulary 256, untied head, plus MOE_SIZES)."""
MOE_SIZES = (
    dict(experts=6, top_k=2, expert_ffn=40, shared_ffn=56, shared_count=3),
    dict(experts=8, top_k=2, expert_ffn=24, shared_ffn=72, shared_count=2),
)
"""Each size's MoE numbers, set under every key of generic_moe's lists the config class declares; they
differ from every other size so that each recorded dimension names one symbol."""


NO_EXPERTS = "no base_model_ep_plan naming one experts module per layer"
"""Why a dense family is not a candidate (the MoE survey does not list it)."""


def _kwargs(arch: str, k: int) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """(the config kwargs of size k, the merged values the planner reads: class defaults <- kwargs)."""
    from partrain.models.generic_survey import live_class_fields

    fields = live_class_fields(arch)
    declared = set(fields["defaults"])
    m = MOE_SIZES[k]
    wanted: Dict[str, Any] = dict(SIZES[k], head_dim=16, vocab_size=256, tie_word_embeddings=False)
    for keys, value in (
        (EXPERTS_KEYS, m["experts"]),
        (TOP_K_KEYS, m["top_k"]),
        (("moe_intermediate_size",), m["expert_ffn"]),
        (SHARED_FFN_KEYS, m["shared_ffn"]),
        (SHARED_COUNT_KEYS, m["shared_count"]),
        (("n_group", "topk_group"), 1),
        (("attention_bias", "mlp_bias"), k == 1),  # the second size has every optional bias its class reads
    ):
        wanted.update({key: value for key in keys if key in declared})
    kwargs = {key: v for key, v in wanted.items() if key in declared}
    return kwargs, {**fields["defaults"], **kwargs}


def _build(arch: str, kwargs: Dict[str, Any], device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **kwargs)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def _experts_block(config) -> Optional[str]:
    plan = getattr(config, "base_model_ep_plan", None) or {}
    found = [k for k, style in plan.items() if style == "ep_dispatch_experts"]
    if len(found) != 1 or not re.fullmatch(r"layers\.\*\.[\w.]+\.experts", found[0]):
        return None
    return found[0][len("layers.*.") : -len(".experts")]


def _symbol(dim: int, value: Dict[str, int]) -> Optional[str]:
    named = [s for s in SYMBOLS if value[s] == dim]
    return named[0] if len(named) == 1 else None


def _tp_dim(plan: Dict[str, str], block: str, name: str) -> Optional[int]:
    module, _, leaf = name.rpartition(".")
    style = plan.get(f"layers.*.{block}.{module}")
    if style == "colwise":
        return 0
    if style == "rowwise" and leaf == "weight":
        return 1
    return None


def _router(model, block_path: str, tensors, experts: int) -> Optional[str]:
    """The block's module whose forward output (first element) is [tokens, experts] router logits."""
    import torch

    block = model.get_submodule(block_path)
    owners = [n.rpartition(".")[0] for n, shape, _, _ in tensors if shape == ("E", "H") and n.count(".") >= 1]
    candidates = [o for owner in owners for o in (owner, owner.rpartition(".")[0]) if o]
    seen: Dict[str, Any] = {}
    hooks = [
        block.get_submodule(c).register_forward_hook(lambda _m, _i, out, c=c: seen.setdefault(c, out))
        for c in candidates
    ]
    with torch.no_grad():
        block(torch.randn(1, 5, model.config.hidden_size))
    for h in hooks:
        h.remove()
    for c in candidates:
        out = seen.get(c)
        out = out[0] if isinstance(out, tuple) else out
        if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[-1] == experts:
            return c
    return None


def _saved_layout(model, layer: int, block: str):
    """How save_pretrained writes layer `layer`: (loadable by partrain, (file experts path, gate, up, down)
    when the experts are one Linear each, ((in the model, in the file), ...) for the tensors it renames)."""
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        with safe_open(f"{folder}/model.safetensors", "pt") as f:
            keys = list(f.keys())
    at = f"model.layers.{layer}."
    experts: Any = f"{block}.experts."
    saved = {k[len(at) :] for k in keys if k.startswith(at)}
    held = {k[len(at) :] for k in model.state_dict() if k.startswith(at)}
    legacy = None
    if f"{experts}gate_up_proj" not in saved:
        # One Linear per expert, under the block's path or another (Mixtral's block_sparse_moe.experts).
        per_expert = [m for k in saved if (m := re.fullmatch(r"([\w.]*experts)\.0\.(\w+)\.weight", k))]
        paths, names = {m.group(1) for m in per_expert}, {m.group(2) for m in per_expert}
        forms = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
        legacy = next(((*paths, *n) for n in forms if set(n) == names and len(paths) == 1), None)
        if legacy is None:
            return False, None, ()
        experts = (legacy[0] + ".", experts)
    missing = sorted(k for k in held - saved if not k.startswith(experts))
    extra = [k for k in saved - held if not k.startswith(experts)]
    renames = []
    for name in missing:
        same_leaf = [k for k in extra if k.rpartition(".")[2] == name.rpartition(".")[2]]
        if len(same_leaf) != 1:
            return False, None, ()
        renames.append((f".{name}", f".{same_leaf[0]}"))
    return True, legacy, tuple(renames)


def _planner_tensors(arch: str, record: MoeRecord, values: Dict[str, Any]) -> List[Tuple[str, tuple]]:
    from partrain.blueprint.model_facts import ModelFacts

    fam = moe_family(arch, record)
    facts = ModelFacts(arch=arch, config_class="", **fam.facts(values, arch))
    extras = fam.extras(values, facts, "sdpa")
    specs = fam.embed_tensors(facts)
    for i in range(facts.n_layers):
        specs += fam.layer_tensors(facts, extras, i)
    specs += fam.final_norm_tensors(facts)
    out = [(t.name, tuple(t.shape)) for t in specs]
    return out + ([("lm_head.weight", (facts.vocab, facts.hidden))] if not facts.tied_embeddings else [])


def moe_record(arch: str) -> Tuple[Optional[MoeRecord], str]:
    """(arch's record, "") when it qualifies (module docstring), else (None, why not)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from transformers import AutoConfig

            if _experts_block(AutoConfig.for_model(arch)) is None:
                return None, NO_EXPERTS
            kwargs, values = _kwargs(arch, 0)
            return _record(arch, _build(arch, kwargs, "cpu"), values)
    except Exception as exc:  # a family whose config or model cannot be built this way does not qualify
        return None, f"a small model of it could not be built from its config class ({type(exc).__name__})"


def _record(arch: str, model, values: Dict[str, Any]) -> Tuple[Optional[MoeRecord], str]:
    from partrain.models.generic_survey import head_is_plain

    config = model.config
    block = _experts_block(config)
    if block is None:
        return None, NO_EXPERTS
    tp_plan = getattr(config, "base_model_tp_plan", None) or {}
    if not tp_plan:
        return None, "transformers ships no tensor-parallel plan for it"
    named = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    experts = re.compile(rf"model\.layers\.(\d+)\.{re.escape(block)}\.experts\.")
    layer = next((int(m.group(1)) for n, _ in named if (m := experts.match(n))), None)
    if layer is None:
        return None, "no layer holds experts at its config class's defaults"
    prefix = f"model.layers.{layer}.{block}."
    sizes = moe_sizes(values, arch)
    i, shared = sizes["I"], sizes["S"]
    value = {"H": config.hidden_size, "E": sizes["E"], "I": i, "2I": 2 * i, "S": shared, "2S": 2 * shared, "1": 1}
    tensors = []
    for name, shape in named:
        if not name.startswith(prefix):
            continue
        rel = name[len(prefix) :]
        symbols = tuple(_symbol(d, value) for d in shape)
        if None in symbols:
            return None, f"its MoE block's {rel} {list(shape)} has a dimension partrain's generic MoE sizes do not name"
        tensors.append((rel, symbols, _tp_dim(tp_plan, block, rel), rel.startswith("experts.")))
    router = _router(model, f"model.layers.{layer}.{block}", tensors, sizes["E"])
    if router is None:
        return None, "no module of its MoE block returns the router logits"
    shared = next((rel.split(".")[0] for rel, *_ in tensors if rel.startswith("shared_expert")), None)
    loadable, legacy, renames = _saved_layout(model, layer, block)
    if not loadable:
        return None, "save_pretrained lays its experts out in a form partrain does not load"
    router_bias = hasattr(model.get_submodule(f"{prefix}{router}"), "e_score_correction_bias")
    second = _second_size(arch)
    for base, output_bias, mlp_bias in itertools.product(("llama", "qwen3"), (True, False), (False, True)):
        record = MoeRecord(
            base, block, tuple(tensors), router, shared, router_bias, legacy, output_bias, mlp_bias, renames
        )
        if _planner_tensors(arch, record, values) == named and _planner_tensors(arch, record, second[1]) == second[0]:
            break
    else:
        return None, "its tensors outside the MoE block are neither llama's nor qwen3's (or its dense layers differ)"
    if not head_is_plain(model):
        return None, "its logits are not the head applied to the base model's output"
    return record, ""


def _second_size(arch: str):
    """(the meta-built model's tensors at the second size, the values the planner reads there)."""
    kwargs, values = _kwargs(arch, 1)
    model = _build(arch, kwargs, "meta")
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()], values


def moe_survey(candidates: List[str]) -> Tuple[Dict[str, MoeRecord], Dict[str, str]]:
    """The candidates (families the dense survey left out) that qualify, and why each other MoE one does
    not (a family without experts is not mentioned)."""
    found, why_not = {}, {}
    for arch in candidates:
        record, why = moe_record(arch)
        if record is not None:
            found[arch] = record
        elif why != NO_EXPERTS:
            why_not[arch] = why
    return found, why_not
