"""gpt-oss at runtime: Llama's paths; attention with q/k/v/o biases and one learned sink logit per head
(`sinks`, a softmax column every query sees and no value, inside transformers' eager attention), local
(sliding-window) and global layers alternating; routed experts in every layer, stored transposed
([E, H, 2I] and [E, I, H]) with per-expert biases and interleaved gate/up columns, combined by a clamped
SwiGLU (partrain.parallel.expert_parallel computes them from the module's own layout flags and gate).
The router is a Linear with a bias whose top-k logits are softmaxed.

Tensor parallelism follows transformers' plan, which splits no decoder-layer projection for gpt-oss:
attention and the router stay whole on every tp rank (as the routed experts do for every family), only
the embedding and the head are vocabulary-parallel. The planner's side is blueprint/families/gpt_oss.py.
"""

from __future__ import annotations

from partrain.models.families.base import Adapter
from partrain.models.families.llama import LLAMA_PATHS

GPT_OSS = Adapter(
    family="gpt_oss",
    archs=("gpt_oss",),
    **LLAMA_PATHS,
    is_moe=True,
    experts_attr="mlp.experts",
    expert_param_names=("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
    router_attr="mlp.router",
)
