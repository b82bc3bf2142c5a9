"""Mixture-of-experts terms of the estimate: expert capacity, all-to-all volume, expert model states.

Routing, per MoE layer and microbatch, on a rank holding T tokens (after sequence/context parallel),
top-k of E experts, hidden size H, activations of `c` bytes:

- Dropless (parallel.moe_capacity_factor unset): all T*k (token, expert) pairs are sent to the
  ranks owning their experts.
- Capacity factor cf: each expert takes at most C = ceil(cf * T * k / E) of this rank's pairs (the
  rank's own tokens, as config/schema.py documents); the rest are dropped before the dispatch.

Assumption (stated in the report): routing is balanced on average, every expert receiving T*k/E
pairs from every rank; that is what the load-balancing loss pushes towards, and which share a
real router drops cannot be known before training. Then cf >= 1 drops nothing and cf < 1 keeps
E*C of the T*k pairs; the expected pairs a rank sends (and receives) is min(T*k, E*C). Reported
beside it, the bound on what one rank may receive in one dispatch: with a capacity factor E*C
(each of the ep ranks sends at most C pairs to each of the rank's E/ep experts), dropless
ep*T*k (every rank routes every token to this rank's experts).

All-to-all per MoE layer per microbatch: dispatch and combine in forward, and their gradients in
backward (the combine's gradient travels like a dispatch and vice versa), each of P*H*c bytes of
which (ep-1)/ep leave the rank; a fully recomputed layer repeats the two forward ones.

Expert model states: stacked expert tensors are cut on the expert dim over ep (params.py); the
remaining data-parallel replicas of an expert, edp = dp x sp / ep ranks, hold copies that
ZeRO-1 (its own parameter group) and FSDP (`n_exp` of estimate.py) shard, and whose gradients
are reduced over edp only.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

from .comm import all_to_all_bytes
from .params import layer_tensors
from .spec import PlanSpec


def expert_capacity(cf: Optional[float], tokens: float, k: int, n_experts: int) -> Optional[int]:
    """Token slots per expert for this rank's tokens; None = dropless."""
    if cf is None:
        return None
    return math.ceil(cf * tokens * k / n_experts)


def routed_pairs(spec: PlanSpec, tokens: float) -> float:
    """Expected (token, expert) pairs one rank dispatches per MoE layer and microbatch (see module docstring)."""
    f = spec.facts
    pairs = tokens * f.experts_per_token
    cap = expert_capacity(spec.moe_capacity_factor, tokens, f.experts_per_token, f.n_experts)
    return pairs if cap is None else min(pairs, f.n_experts * cap)


def kept_fraction(spec: PlanSpec, tokens: float) -> float:
    """Share of routed pairs the experts process (1 when dropless)."""
    pairs = tokens * spec.facts.experts_per_token
    return routed_pairs(spec, tokens) / pairs if pairs else 1.0


def receive_bound_pairs(spec: PlanSpec, tokens: float) -> float:
    """Most pairs one rank can receive in one dispatch (routing at its most uneven)."""
    f = spec.facts
    cap = expert_capacity(spec.moe_capacity_factor, tokens, f.experts_per_token, f.n_experts)
    return spec.ep * tokens * f.experts_per_token if cap is None else f.n_experts * cap


def dispatch_tokens(spec: PlanSpec, tokens: float) -> float:
    """Tokens one rank feeds its MoE blocks: with Megatron sequence parallelism the TP ranks share
    them, otherwise every TP rank routes all of them (the MoE block is replicated over TP)."""
    return tokens / (spec.tp if spec.tp_sp else 1)


def all_to_all_layer_bytes(spec: PlanSpec, tokens: float, act_bytes: int, recompute_passes: float = 0.0) -> dict:
    """Bytes one rank moves over the ep group for one MoE layer and one microbatch."""
    t = dispatch_tokens(spec, tokens)
    one = all_to_all_bytes(routed_pairs(spec, t) * spec.facts.hidden * act_bytes, spec.ep)
    out = {"dispatch_forward": one, "combine_forward": one, "backward": 2 * one, "recompute": 2 * one * recompute_passes}
    out["total"] = sum(out.values())
    return out


def expert_layer_elements(spec: PlanSpec) -> int:
    """Local (after TP and EP) elements of the stacked expert tensors of one MoE layer."""
    return _expert_layer_elements(spec.facts, spec.extras, spec.tp, spec.ep)


@functools.lru_cache(maxsize=1024)
def _expert_layer_elements(f, x, tp: int, ep: int) -> int:
    if not f.is_moe:
        return 0
    index = next((i for i in range(f.n_layers) if x.sparse_layers and x.sparse_layers[i]), 0)
    return sum(math.prod(t.local_shape(tp, ep)) for t in layer_tensors(f, x, index) if t.expert)


def expert_shard(spec: PlanSpec) -> int:
    """Ranks that shard one expert's states under ZeRO/FSDP: its whole edp group, with hybrid
    sharding (dp_shard < dp) too, as the runtime does (expert_parallel.shard_experts_fsdp)."""
    return expert_dp(spec)


def expert_dp(spec: PlanSpec) -> int:
    """edp: ranks holding the same experts (their gradients are reduced over it)."""
    return spec.dp * spec.sp // spec.ep


ROUTING_ASSUMPTION = ("balanced routing: every expert receives tokens*top_k/experts pairs from every rank (what the "
                      "load-balancing loss aims at), so a capacity factor >= 1 drops nothing and cf < 1 keeps experts*capacity "
                      "pairs; the share a trained router really drops is not known in advance (receive_bound_pairs: the most "
                      "one rank can receive)")


def moe_report(spec: PlanSpec, tokens: float, act_bytes: int, recompute_passes: float, sparse_layers: int, dt) -> dict:
    """The "moe" block of the estimate, for the pipeline rank holding the most MoE layers
    (`sparse_layers` of them): expert states per rank, capacity, all-to-all bytes and the routing assumption.

    expert_params_per_rank: the rank's experts after TP and EP (total / ep); expert_state_bytes_per_rank:
    after ZeRO too, on the rank holding the largest shard (FSDP cuts dim 0, the expert index, of each
    local stacked tensor as torch.chunk does: ceil(local experts / expert_shard) experts on the first)."""
    from .memory import tensor_state_elements

    f, x = spec.facts, spec.extras
    index = next((i for i in range(f.n_layers) if x.sparse_layers and x.sparse_layers[i]), 0)
    tensors = [t for t in layer_tensors(f, x, index) if t.expert]
    per_layer_total = sum(t.numel for t in tensors)
    n_exp = expert_shard(spec)
    p, o, g2, _ = tensor_state_elements(tensors, spec.tp, spec.ep, spec.shard, n_exp, spec.zero_stage, 0)
    if spec.zero_stage == 1:
        o = -(-g2 // n_exp) if spec.ep > 1 else g2 / spec.shard
    elif spec.zero_stage == 0:
        o = p
    t = dispatch_tokens(spec, tokens)
    layer = all_to_all_layer_bytes(spec, tokens, act_bytes, recompute_passes)
    cap = expert_capacity(spec.moe_capacity_factor, t, f.experts_per_token, f.n_experts)
    return {
        "experts": f.n_experts, "experts_per_rank": f.n_experts // spec.ep, "top_k": f.experts_per_token,
        "moe_layers_total": sum(1 for s in x.sparse_layers if s), "moe_layers_on_rank": sparse_layers,
        "ep": spec.ep, "edp": expert_dp(spec), "expert_shard": n_exp,
        "expert_params_total": per_layer_total * sum(1 for s in x.sparse_layers if s),
        "expert_params_per_rank": expert_layer_elements(spec) * sparse_layers,
        "expert_state_bytes_per_rank": {"params": p * sparse_layers * dt.param, "grads": p * sparse_layers * dt.grad,
                                        "optimizer": int(o) * sparse_layers * dt.optim},
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
