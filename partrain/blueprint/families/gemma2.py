"""Gemma 2 for the planner: Gemma 3's tensors without the per-head q/k norms (two norms around
attention and two around the MLP, head_dim from the config, GELU-tanh in the gated MLP, embeddings
tied by default), sliding-window attention on every other layer (layer_types), and scores capped
by tanh: attn_logit_softcapping in attention (50 by default, so transformers' eager attention runs,
which stores the s x s scores: model_facts.attention_implementation) and final_logit_softcapping on
the logits (30). The runtime side is partrain/models/families/gemma2.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List

from partrain.blueprint.families import gemma3, llama
from partrain.blueprint.families.base import ModelExtras, TensorSpec


def layer_tensors(f: Any, x: ModelExtras, i: int) -> List[TensorSpec]:
    """Llama's layer, then the two feed-forward norms (HF's registration order)."""
    out = llama.layer_tensors(f, x, i)
    prefix = f"model.layers.{i}."
    return out + [TensorSpec(prefix + f"{norm}.weight", (f.hidden,), "layer", i) for norm in gemma3.FEEDFORWARD_NORMS]


GEMMA2 = replace(gemma3.GEMMA3, name="gemma2", arch="gemma2", layer_tensors=layer_tensors, qk_norm=False)
