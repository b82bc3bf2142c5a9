"""A synchronous parameter server (Li et al. 2014, in its simplest synchronous form).

The model's parameters, flattened group by group (weight-decayed matrices first, then the rest), are
cut into `ps_servers` contiguous shards; shard s lives on server s, which holds it as an fp32
master copy with its AdamW state. One step:

1. push (`push_gradients`, after the last backward): every worker sends shard s of its gradient
   to server s; the server sums what it received and divides by the number of workers;
2. clip (`clip`): each server's squared norm of its averaged shard, summed over the dp group (one
   scalar), gives the global norm; servers scale their shard;
3. update + pull (`step`): servers run AdamW on their master shard and send the updated values to
   every worker, which copies them into its parameters.

Servers are co-located with workers (a server also trains); only its own worker's part of a shard
stays local. The busiest rank is a server: it receives (W-1) and sends (W-1) copies of its shard,
so its traffic grows with the number of workers W while a ring's stays at 2(W-1)/W of the model.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from partrain.parallel.dp_sync.counter import CommCounter
from partrain.parallel.dp_sync.groups import DpGroups, server_indices
from partrain.parallel.grad_norm import scale_to_norm
from partrain.parallel.zero1_optimizer import tensor_state_bytes


class ParameterServer:
    """Plays the optimizer for the trainer (param_groups, zero_grad, step, state_bytes)."""

    def __init__(
        self,
        groups_spec: List[Dict],
        dp: DpGroups,
        servers: int,
        make_optimizer,
        counter: CommCounter,
        p2p_group: Optional[dist.ProcessGroup],
        scalar_group: Optional[dist.ProcessGroup],
        dedicated: bool = False,
    ) -> None:
        self.dp, self.counter, self.p2p, self.scalar_group = dp, counter, p2p_group, scalar_group
        self.params: List[nn.Parameter] = [p for g in groups_spec for p in g["params"] if p.requires_grad]
        total = sum(p.numel() for p in self.params)
        self.bounds = [
            (int(t[0]), int(t[-1]) + 1) if len(t) else (0, 0) for t in torch.arange(total).tensor_split(servers)
        ]
        self.server_ranks = [dp.members[i] for i in server_indices(len(dp.members), servers, dedicated)]
        self.rank = dp.members[dp.me]
        # Dedicated servers train on nothing: they neither push gradients nor pull parameters.
        self.workers = [r for r in dp.members if not (dedicated and r in self.server_ranks)]
        self.shard_index = self.server_ranks.index(self.rank) if self.rank in self.server_ranks else None
        self.dtype = self.params[0].dtype
        self.master: List[nn.Parameter] = []
        self._segments: List[tuple] = []
        """(lo, hi) of each master tensor in the flat parameter order."""
        inner_groups, offset = [], 0
        for spec in groups_spec:
            n = sum(p.numel() for p in spec["params"] if p.requires_grad)
            seg = self._my_part(offset, offset + n)
            if seg is not None:
                lo, hi = seg
                values = self._flat_params()[lo:hi].detach().to(torch.float32).clone()
                master = nn.Parameter(values)
                self.master.append(master)
                self._segments.append((lo, hi))
                inner_groups.append({**{k: v for k, v in spec.items() if k != "params"}, "params": [master]})
            offset += n
        self.inner = make_optimizer(inner_groups) if inner_groups else None
        self._lr_groups = [{"lr": 0.0}]

    def _my_part(self, lo: int, hi: int):
        """This server's piece of the flat range [lo, hi), or None."""
        if self.shard_index is None:
            return None
        s_lo, s_hi = self.bounds[self.shard_index]
        a, b = max(lo, s_lo), min(hi, s_hi)
        return (a, b) if a < b else None

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.params])

    def _flat_grads(self) -> torch.Tensor:
        return torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in self.params]
        )

    @property
    def param_groups(self):
        return self.inner.param_groups if self.inner is not None else self._lr_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None
        for m in self.master:
            m.grad = None

    @torch.no_grad()
    def push_gradients(self) -> None:
        """Every worker's gradient shards to their servers; servers keep the mean (in master.grad)."""
        flat = self._flat_grads()
        working = self.rank in self.workers
        sends = [(flat[lo:hi], r) for r, (lo, hi) in zip(self.server_ranks, self.bounds) if r != self.rank]
        sends = sends if working else []
        recvs, acc = [], None
        if self.shard_index is not None:
            lo, hi = self.bounds[self.shard_index]
            others = [r for r in self.workers if r != self.rank]
            recvs = [(torch.empty(hi - lo, dtype=flat.dtype), r) for r in others]
        self.counter.exchange(sends, recvs, self.p2p)
        if self.shard_index is not None:
            acc = flat[lo:hi].to(torch.float32).clone() if working else torch.zeros(hi - lo)
            for buf, _ in recvs:  # in rank order: the same sum on every run
                acc += buf
            acc /= len(self.workers)
            for m, (a, b) in zip(self.master, self._segments):
                m.grad = acc[a - lo : b - lo].clone()

    @torch.no_grad()
    def clip(self, max_norm: float) -> float:
        squares = torch.zeros(1, dtype=torch.float64)
        for m in self.master:
            squares += m.grad.double().pow(2).sum()
        if len(self.dp.members) > 1:
            self.counter.all_reduce(squares, self.scalar_group)
        total = squares.sqrt().float()[0]
        if max_norm > 0 and self.master:
            # The same clipping call as every other layout (partrain.parallel.grad_norm).
            scale_to_norm([m.grad for m in self.master], max_norm, total)
        return float(total)

    @torch.no_grad()
    def step(self) -> None:
        """Servers update their master shard; every worker pulls all shards into its parameters."""
        if self.inner is not None:
            self.inner.step()
        flat = self._flat_params()
        sends, recvs = [], []
        for r, (lo, hi) in zip(self.server_ranks, self.bounds):
            if r == self.rank:
                fresh = torch.cat([m.detach() for m in self.master]).to(self.dtype) if self.master else flat[lo:lo]
                flat[lo:hi] = fresh
                sends += [(fresh, w) for w in self.workers if w != self.rank]
            elif self.rank in self.workers:
                recvs.append((flat[lo:hi], r))
        self.counter.exchange(sends, recvs, self.p2p)
        offset = 0
        for p in self.params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def state_bytes(self) -> int:
        """Optimizer state plus the fp32 master shard this rank holds as a server."""
        total = sum(m.numel() * m.element_size() for m in self.master)
        if self.inner is not None:
            total += tensor_state_bytes(self.inner)
        return float(total)

    def state_dict(self) -> dict:
        raise NotImplementedError("parameter-server optimizer state is not checkpointed (refused by validation)")
