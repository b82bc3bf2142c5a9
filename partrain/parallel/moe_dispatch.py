"""Token exchange for expert parallelism: which routed token copies go to which rank, and back.

One MoE layer on one rank sees T local tokens, each routed to top_k experts: T*k token copies
("slots", token-major: token 0's k choices, then token 1's, ...). A slot is

1. possibly dropped (capacity), decided here from the local slots alone, so a layout with
   ep = 1 and the same capacity drops exactly the same slots;
2. sent to the rank owning its expert (`all_to_all_single`, uneven splits, counts exchanged first);
3. run through its expert there, sent back with the reverse all-to-all, weighted by its routing
   weight and summed into its token's output.

The all-to-all is an autograd Function whose backward is the reverse all-to-all, so gradients of
the expert weights land on the owning rank and gradients of the hidden states return home.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from partrain.parallel.compile import eager


class AllToAll(torch.autograd.Function):
    """`all_to_all_single` with uneven splits; backward is the same exchange reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: List[int], in_splits: List[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        y = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        with record_function("partrain/ep/all_to_all"):
            dist.all_to_all_single(y, x.contiguous(), out_splits, in_splits, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        gx = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        # contiguous(): gloo scatters by offsets and would misread permuted strides.
        with record_function("partrain/ep/all_to_all"):
            dist.all_to_all_single(gx, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return gx, None, None, None


def capacity(capacity_factor: Optional[float], tokens: int, top_k: int, num_experts: int) -> Optional[int]:
    """Slots each expert accepts per layer and microbatch; None = dropless."""
    if capacity_factor is None:
        return None
    return int(math.ceil(capacity_factor * tokens * top_k / num_experts))


@dataclass
class Routing:
    """The kept slots of one layer on one rank, sorted by expert (stable: token order inside)."""

    slot: torch.Tensor
    """Indices into the flattened [T*k] slots, sorted by expert."""
    token: torch.Tensor
    """Token of each kept slot."""
    counts: torch.Tensor
    """Routed slots per expert before dropping [E] (int64)."""
    kept: torch.Tensor
    """Kept slots per expert [E] (int64)."""


def route(top_k_index: torch.Tensor, num_experts: int, cap: Optional[int]) -> Routing:
    """Sort the slots by expert and drop those past an expert's capacity (first come, first kept)."""
    k = top_k_index.shape[1]
    experts = top_k_index.reshape(-1)
    counts = torch.bincount(experts, minlength=num_experts)
    order = torch.sort(experts, stable=True).indices
    if cap is not None:
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(order.numel(), device=order.device) - starts[experts[order]]
        order = order[position < cap]
        kept = torch.clamp(counts, max=cap)
    else:
        kept = counts
    return Routing(slot=order, token=torch.div(order, k, rounding_mode="floor"), counts=counts, kept=kept)


def exchange_counts(kept: torch.Tensor, group, ep: int) -> torch.Tensor:
    """Kept slots this rank receives: [ep sources, local experts], from each peer's [E] counts."""
    received = torch.empty_like(kept)
    with record_function("partrain/ep/all_to_all_counts"):
        dist.all_to_all_single(received, kept, group=group)
    return received.view(ep, -1)


def dispatch(x: torch.Tensor, kept: torch.Tensor, group, ep: int):
    """Send slot rows (sorted by expert) to their experts' ranks.

    Returns (rows received, grouped by source rank then local expert; rows per local expert per
    source [ep, E/ep]; the split sizes to send the results back with)."""
    send = kept.view(ep, -1).sum(1).tolist()
    recv_counts = exchange_counts(kept, group, ep)
    recv = recv_counts.sum(1).tolist()
    return _AllToAll_eager(x, recv, send, group), recv_counts, (send, recv)


def combine(y: torch.Tensor, splits, group) -> torch.Tensor:
    """Return expert outputs to the ranks their tokens came from (inverse of `dispatch`)."""
    send, recv = splits
    return _AllToAll_eager(y, send, recv, group)


def by_local_expert(recv_counts: torch.Tensor) -> torch.Tensor:
    """Permutation that groups received rows (source-major) by local expert (source order kept)."""
    ep, local = recv_counts.shape
    experts = torch.arange(local, device=recv_counts.device).repeat(ep)
    expert_of_row = torch.repeat_interleave(experts, recv_counts.reshape(-1))
    return torch.sort(expert_of_row, stable=True).indices


# Run eagerly inside compiled blocks (partrain.parallel.compile.eager: collectives, Python state).
_AllToAll_eager = eager(AllToAll.apply)
