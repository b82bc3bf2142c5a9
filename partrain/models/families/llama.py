"""Llama at runtime, and the dense families that share its modules (Qwen2, Qwen3, Mistral, SmolLM3: one
adapter; Granite: the same paths and two scalings).

Tensor parallelism follows transformers' own `base_model_tp_plan` (no plan here). The MoE families
(mixtral.py, qwen2_moe.py, qwen3_moe.py) reuse LLAMA_PATHS. The planner's side is
blueprint/families/llama.py.
"""

from __future__ import annotations

from partrain.models.families.base import Adapter

LLAMA_PATHS = dict(
    base_prefix="model",
    layer_prefix="model.layers",
    embedding_paths=("model.embed_tokens",),
    final_norm_path="model.norm",
    rotary_path="model.rotary_emb",
)
"""Where a Llama-style model keeps its parts (every family here but GPT-2)."""

LLAMA = Adapter(family="llama", archs=("llama", "qwen2", "qwen3", "mistral", "smollm3"), **LLAMA_PATHS)

GRANITE = Adapter(
    family="llama",
    archs=("granite",),
    embedding_multiplier_key="embedding_multiplier",
    logits_divisor_key="logits_scaling",
    **LLAMA_PATHS,
)
"""Granite: Llama's modules; its residual and attention multipliers live inside the decoder layer (HF's
code), the embedding multiplier and the logits' divisor in the base and causal-LM forwards, which a
pipeline stage does not run (stage.py applies them from these keys)."""
