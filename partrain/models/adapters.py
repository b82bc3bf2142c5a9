"""Where things live inside each supported Hugging Face causal-LM family.

Parallel code (pipeline split, tensor parallel, FSDP wrapping, recompute, expert parallel) asks an
adapter for module paths instead of special-casing architectures. An adapter is plain data plus a
few lookups; it never changes a model. Each family's adapter lives in its own module under
partrain/models/families/ (with `Adapter` itself in families/base.py); this module is the one
place the rest of partrain imports them from. Nothing here imports torch or transformers.
"""

from __future__ import annotations

from partrain.models.families import ADAPTERS, get_adapter
from partrain.models.families.base import Adapter, Conv1DBlock, Conv1DLayerPlan, LegacyExperts
from partrain.models.families.gpt2 import GPT2
from partrain.models.families.llama import LLAMA
from partrain.models.families.mixtral import MIXTRAL
from partrain.models.families.qwen2_moe import QWEN2_MOE
from partrain.models.families.qwen3_moe import QWEN3_MOE

__all__ = [
    "ADAPTERS",
    "GPT2",
    "LLAMA",
    "MIXTRAL",
    "QWEN2_MOE",
    "QWEN3_MOE",
    "Adapter",
    "Conv1DBlock",
    "Conv1DLayerPlan",
    "LegacyExperts",
    "get_adapter",
]
