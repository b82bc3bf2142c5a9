"""Cohere 2 at runtime: Llama's paths; one norm a layer, whose output attention and the MLP both read (a
parallel block: under Megatron-SP each block gathers the normalised sequence shard itself); the
causal-LM forward multiplies the logits by config.logit_scale, which a pipeline's last stage applies
(stage.py, logits_multiplier_key). The planner's side is blueprint/families/cohere2.py."""

from __future__ import annotations

from partrain.models.families.base import Adapter
from partrain.models.families.llama import LLAMA_PATHS

COHERE2 = Adapter(
    family="cohere2",
    archs=("cohere2",),
    **LLAMA_PATHS,
    layer_norms=("input_layernorm",),
    logits_multiplier_key="logit_scale",
)
