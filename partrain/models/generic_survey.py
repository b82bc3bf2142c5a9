"""Which of transformers' causal-LM families partrain can train by the generic path, found by building them.

A family qualifies when a tiny model built from its config class (transformers' defaults, small sizes):
1. holds exactly the parameter tensors, names and shapes, of one of the verified families it may stand
   on (BASES: Llama; Qwen2's q/k/v biases; Qwen3's per-head q/k norms; OLMo 2's whole-width q/k norms
   and post-norms), so that family's planner tensor list, module paths and LoRA targets are its own, and
2. computes its logits as the head applied to the base model's output, nothing after (no scale, cap or
   divisor), so partrain's chunked loss, which calls the head itself, gives transformers' loss; and
3. ships a `base_model_tp_plan`, which tensor parallelism applies as it does for Llama.

`python -m partrain.models.facts_snapshot` runs `survey()` and records the families with their base in
partrain/blueprint/hf_facts.json (`generic_families`), which the torch-free planner reads; a test re-checks
the recorded ones against the installed transformers. What the generic path runs (and refuses) is in
partrain/blueprint/families/generic.py.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Dict, Optional, Sequence, Set, Tuple

BASES = ("llama", "qwen2", "qwen3", "olmo2")
"""The verified families a generic one may stand on, in the order they are tried."""

TINY_SIZES = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    tie_word_embeddings=False,
)
"""Sizes every surveyed config gets (keys a config class does not have are kept as attributes, unused)."""


def live_class_fields(arch: str) -> dict:
    """Fields, JSON-able defaults and attribute map of the installed transformers config class."""
    import dataclasses
    import json

    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[arch]
    defaults: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            value = f.default_factory()  # type: ignore[misc]
        else:
            value = None
        try:
            json.dumps(value)
        except TypeError:
            value = repr(value)
        defaults[f.name] = value
    return {"class": cls.__name__, "defaults": defaults, "attribute_map": dict(cls.attribute_map)}


def _build(arch: str, device: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(arch, **TINY_SIZES)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


Shapes = Set[Tuple[str, Tuple[int, ...]]]


def tensor_shapes(model) -> Shapes:
    """(name with layer indices as N, shape) of every parameter."""
    return {(re.sub(r"\.\d+\.", ".N.", name), tuple(p.shape)) for name, p in model.named_parameters()}


def head_is_plain(model) -> bool:
    """Whether the causal LM's logits equal its head applied to the base model's last hidden state."""
    import torch

    ids = torch.randint(0, TINY_SIZES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(0))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        hidden = model.model(input_ids=ids).last_hidden_state
        return bool(torch.allclose(logits, model.lm_head(hidden), rtol=1e-5, atol=1e-6))


def base_of(arch: str, bases: Dict[str, Shapes]) -> Tuple[Optional[str], str]:
    """(the base of `bases` that `arch` stands on by the rules of this module's docstring, "") or (None,
    why not)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = _build(arch, "meta")
            shapes = tensor_shapes(meta)
            base = next((name for name, known in bases.items() if known == shapes), None)
            if base is None:
                return None, _closest_difference(shapes, bases)
            if not getattr(meta.config, "base_model_tp_plan", None):
                return None, "transformers ships no tensor-parallel plan for it"
            if not head_is_plain(_build(arch, "cpu")):
                return None, "its logits are not the head applied to the base model's output"
            return base, ""
    except Exception as exc:  # a family whose config or model cannot be built this way does not qualify
        return None, f"a small model of it could not be built from its config class ({type(exc).__name__})"


def _closest_difference(shapes: Shapes, bases: Dict[str, Shapes]) -> str:
    name, known = min(bases.items(), key=lambda item: len(item[1] ^ shapes))
    extra = sorted(n for n, _ in shapes - known)
    missing = sorted(n for n, _ in known - shapes)
    parts = [f"has {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}"] if extra else []
    parts += [f"lacks {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}"] if missing else []
    against = "; ".join(parts) or "differs in shapes"
    return f"its parameters are none of {', '.join(bases)}'s (against {name}'s it {against})"


def base_shapes() -> Dict[str, Shapes]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {name: tensor_shapes(_build(name, "meta")) for name in BASES}


def survey(exclude: Sequence[str]) -> Tuple[Dict[str, str], Dict[str, str]]:
    """Every causal-LM model_type of the installed transformers but those in `exclude` (the families
    partrain verifies one by one): ({the qualifying ones: their base}, {the others: why not})."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    bases = base_shapes()
    found = {a: base_of(a, bases) for a in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if a not in exclude}
    return {a: b for a, (b, _) in found.items() if b}, {a: why for a, (b, why) in found.items() if not b}
