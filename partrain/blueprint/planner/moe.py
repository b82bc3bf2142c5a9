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

from partrain.blueprint.planner.comm import all_to_all_bytes
from partrain.blueprint.planner.params import layer_tensors
from partrain.blueprint.planner.spec import PlanSpec


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
    out = {
        "dispatch_forward": one,
        "combine_forward": one,
        "backward": 2 * one,
        "recompute": 2 * one * recompute_passes,
    }
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
    sharding (dp_shard < dp) too, as the runtime does (expert_gradients.shard_experts_fsdp)."""
    return expert_dp(spec)


def expert_dp(spec: PlanSpec) -> int:
    """edp: ranks holding the same experts (their gradients are reduced over it)."""
    return spec.dp * spec.sp // spec.ep
