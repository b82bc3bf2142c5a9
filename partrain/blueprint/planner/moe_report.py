"""The "moe" block of the estimate: expert states per rank, capacity, all-to-all bytes and the
routing assumption (the rules are in `moe.py`)."""

from __future__ import annotations

from partrain.blueprint.planner.memory import tensor_state_elements
from partrain.blueprint.planner.moe import (
    all_to_all_layer_bytes,
    dispatch_tokens,
    expert_capacity,
    expert_dp,
    expert_layer_elements,
    expert_shard,
    kept_fraction,
    receive_bound_pairs,
    routed_pairs,
)
from partrain.blueprint.planner.params import layer_tensors
from partrain.blueprint.planner.spec import PlanSpec

ROUTING_ASSUMPTION = (
    "balanced routing: every expert receives tokens*top_k/experts pairs from every rank (what the "
    "load-balancing loss aims at), so a capacity factor >= 1 drops nothing and cf < 1 keeps experts*capacity "
    "pairs; the share a trained router really drops is not known in advance (receive_bound_pairs: the most "
    "one rank can receive)"
)


def moe_report(spec: PlanSpec, tokens: float, act_bytes: int, recompute_passes: float, sparse_layers: int, dt) -> dict:
    """The "moe" block of the estimate, for the pipeline rank holding the most MoE layers
    (`sparse_layers` of them): expert states per rank, capacity, all-to-all bytes and the routing assumption.

    expert_params_per_rank: the rank's experts after TP and EP (total / ep); expert_state_bytes_per_rank:
    after ZeRO too, on the rank holding the largest shard (FSDP cuts dim 0, the expert index, of each
    local stacked tensor as torch.chunk does: ceil(local experts / expert_shard) experts on the first)."""
    f, x = spec.facts, spec.extras
    index = next((i for i in range(f.n_layers) if x.sparse_layers and x.sparse_layers[i]), 0)
    tensors = [t for t in layer_tensors(f, x, index) if t.expert]
    per_layer_total = sum(t.numel for t in tensors)
    n_exp = expert_shard(spec)
    p, o, g2, _, _ = tensor_state_elements(tensors, spec.tp, spec.ep, spec.shard, n_exp, spec.zero_stage, 0)
    if spec.zero_stage == 1:
        o = -(-g2 // n_exp) if spec.ep > 1 else g2 / spec.shard
    elif spec.zero_stage == 0:
        o = p
    t = dispatch_tokens(spec, tokens)
    layer = all_to_all_layer_bytes(spec, tokens, act_bytes, recompute_passes)
    cap = expert_capacity(spec.moe_capacity_factor, t, f.experts_per_token, f.n_experts)
    return {
        "experts": f.n_experts,
        "experts_per_rank": f.n_experts // spec.ep,
        "top_k": f.experts_per_token,
        "moe_layers_total": sum(1 for s in x.sparse_layers if s),
        "moe_layers_on_rank": sparse_layers,
        "ep": spec.ep,
        "edp": expert_dp(spec),
        "expert_shard": n_exp,
        "expert_params_total": per_layer_total * sum(1 for s in x.sparse_layers if s),
        "expert_params_per_rank": expert_layer_elements(spec) * sparse_layers,
        "expert_state_bytes_per_rank": {
            "params": p * sparse_layers * dt.param,
            "grads": p * sparse_layers * dt.grad,
            "optimizer": int(o) * sparse_layers * dt.optim,
        },
        "capacity_factor": spec.moe_capacity_factor,
        "capacity_per_expert": cap,
        "tokens_per_rank_per_microbatch": t,
        "routed_pairs_per_layer": routed_pairs(spec, t),
        "kept_fraction": kept_fraction(spec, t),
        "receive_bound_pairs": receive_bound_pairs(spec, t),
        "all_to_all_bytes_per_layer_microbatch": layer,
        "all_to_all_bytes_per_microbatch": layer["total"] * sparse_layers,
        "routing_assumption": ROUTING_ASSUMPTION,
    }
