"""DeepSeek-V3 at runtime: Llama's paths; multi-head latent attention (q through a low-rank q_a_proj ->
q_a_layernorm -> q_b_proj, keys and values expanded per head from one shared latent by kv_b_proj, a
rotary part of each head shared by all heads) inside transformers' attention; the first
`first_k_dense_replace` layers dense, the others routed experts (transformers' fused [E, 2I, H] layout)
beside always-on shared experts without a gate; a sigmoid router choosing top-k inside the top groups,
with a load-balancing bias buffer (`e_score_correction_bias`) that partrain keeps as loaded.

Tensor parallelism follows transformers' plan: the dense MLPs and the shared experts are column/row
parallel, attention and the router stay whole on every tp rank (the plan splits neither), the routed
experts are replicated over tp and split by expert parallelism. The planner's side is
blueprint/families/deepseek_v3.py.
"""

from __future__ import annotations

from partrain.models.families.base import Adapter, LegacyExperts
from partrain.models.families.llama import LLAMA_PATHS

DEEPSEEK_V3 = Adapter(
    family="deepseek_v3",
    archs=("deepseek_v3",),
    **LLAMA_PATHS,
    is_moe=True,
    experts_attr="mlp.experts",
    expert_param_names=("gate_up_proj", "down_proj"),
    router_attr="mlp.gate",
    shared_expert_attr="mlp.shared_experts",
    legacy_experts=LegacyExperts("mlp.experts", gate="gate_proj", up="up_proj", down="down_proj"),
)
