"""Gemma 3 (text) for the planner: Llama's tensors with per-head q_norm / k_norm, two more norms per
layer (pre/post_feedforward_layernorm), embeddings tied by default, head_dim from the config (256 by
default, not hidden / heads), GELU-tanh in the gated MLP, and sliding-window attention on five layers
of six whenever sliding_window is set (layer_types). The runtime side is
partrain/models/families/gemma3.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import ModelExtras, TensorSpec, Values

FEEDFORWARD_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def extras(values: Values, facts: Any, attn_impl: str) -> ModelExtras:
    """Llama's extras; the MLP's activation is config.hidden_activation (Gemma's key, not hidden_act)."""
    base = llama.extras(values, facts, attn_impl, attention_bias=True)
    return replace(base, activation=str(values.get("hidden_activation") or "gelu_pytorch_tanh"))


def layer_tensors(f: Any, x: ModelExtras, i: int) -> List[TensorSpec]:
    """Llama's layer with q/k norms, then the two feed-forward norms (HF's registration order)."""
    out = llama.layer_tensors(f, x, i, qk_norm=True)
    prefix = f"model.layers.{i}."
    return out + [TensorSpec(prefix + f"{norm}.weight", (f.hidden,), "layer", i) for norm in FEEDFORWARD_NORMS]


GEMMA3 = replace(
    llama.LLAMA,
    name="gemma3",
    arch="gemma3_text",
    extras=extras,
    layer_tensors=layer_tensors,
    qk_norm=True,
    residual_norms=4,
    window_always=True,
)
