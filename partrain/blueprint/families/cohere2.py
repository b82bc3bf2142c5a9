"""Cohere 2 (Command R7B, Command A) for the planner: Llama's projections with optional biases on all four
attention projections (attention_bias) and none on the MLP; one LayerNorm a layer (no bias) read by
attention and the MLP side by side (a parallel block: both outputs join the residual at once);
embeddings tied by default; sliding-window attention on three layers of four (layer_types), rotary on
those layers only (inside HF's attention). The runtime side is partrain/models/families/cohere2.py."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, List

from partrain.blueprint.families import llama
from partrain.blueprint.families.base import ModelExtras, TensorSpec


def layer_tensors(f: Any, x: ModelExtras, i: int) -> List[TensorSpec]:
    """Llama's layer with its one norm (input_layernorm) instead of two."""
    return [t for t in llama.layer_tensors(f, x, i) if not t.name.endswith("post_attention_layernorm.weight")]


COHERE2 = replace(
    llama.LLAMA,
    name="cohere2",
    arch="cohere2",
    facts=partial(llama.dense_facts, qkv_bias=False),
    extras=partial(llama.extras, attention_bias=True),
    layer_tensors=layer_tensors,
    residual_norms=1,
    # HF derives layer_types from sliding_window (three sliding layers of four) whenever it is set.
    window_always=True,
)
