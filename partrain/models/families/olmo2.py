"""OLMo 2 at runtime: Llama's paths; its two residual-stream norms come after attention and after the
MLP (post-norm), and its q_norm / k_norm normalise the whole q and k projections inside attention, which
transformers' tp plan allows by gathering the q, k and v outputs (`colwise_gather_output`, then
`rowwise_split_input` for o_proj: partrain.parallel.tp_layers). The planner's side is
blueprint/families/olmo2.py."""

from __future__ import annotations

from partrain.models.families.base import Adapter
from partrain.models.families.llama import LLAMA_PATHS

OLMO2 = Adapter(
    family="olmo2",
    archs=("olmo2",),
    **LLAMA_PATHS,
    layer_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
)
