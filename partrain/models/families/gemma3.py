"""Gemma 3 (text) at runtime: Llama's paths, four norms on the residual stream (a "sandwich" around
attention and the MLP), and a rotary module that takes the layer's attention type (local sliding-window
layers and global layers rotate with different bases). Its embedding scale (sqrt(hidden)) lives in the
embedding module and its per-head q_norm / k_norm in attention (transformers' tp plan replicates them),
so partrain runs both as HF wrote them. The planner's side is blueprint/families/gemma3.py."""

from __future__ import annotations

from partrain.models.families.base import Adapter
from partrain.models.families.llama import LLAMA_PATHS

GEMMA3 = Adapter(
    family="gemma3",
    archs=("gemma3_text",),
    **LLAMA_PATHS,
    layer_norms=(
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
    ),
)
