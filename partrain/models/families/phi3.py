"""Phi-3 (and Phi-4-mini) at runtime: Llama's paths and norms; attention's q, k and v are one fused
qkv_proj and the MLP's gate and up one gate_up_proj, which transformers' tp plan splits as columns
whose outputs are gathered (`colwise_gather_output`: each rank cuts the parts from the whole output),
o_proj and down_proj as rows on their slice of the whole input (`rowwise_split_input`; see
partrain.parallel.tp_layers). The planner's side is blueprint/families/phi3.py."""

from __future__ import annotations

from partrain.models.families.base import Adapter
from partrain.models.families.llama import LLAMA_PATHS

PHI3 = Adapter(family="phi3", archs=("phi3",), **LLAMA_PATHS)
