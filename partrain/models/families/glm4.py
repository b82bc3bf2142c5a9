"""GLM-4 at runtime: Llama's paths; four norms a layer (a "sandwich": post_self_attn_layernorm and
post_mlp_layernorm after each block); the MLP's gate and up fused into gate_up_proj, which transformers'
tp plan splits as a column whose output is gathered (`colwise_gather_output`), with down_proj a row on
its slice of the whole input (`rowwise_split_input`: partrain.parallel.tp_layers). Its partial rotary
lives in the rotary module and attention, which partrain runs as HF wrote them. The planner's side is
blueprint/families/glm4.py."""

from __future__ import annotations

from partrain.models.families.base import Adapter
from partrain.models.families.llama import LLAMA_PATHS

GLM4 = Adapter(
    family="glm4",
    archs=("glm4",),
    **LLAMA_PATHS,
    layer_norms=("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
)
