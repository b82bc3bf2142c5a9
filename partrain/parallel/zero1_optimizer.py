"""ZeRO stage 1: optimizer state sharded over data-parallel ranks, parameters and gradients replicated.

Each parameter group is flattened into one fp32 buffer and the model's parameters become views
of it; the buffer is cut into equal slices, one per rank of the shard group, so every rank holds
exactly 1/N of the optimizer state whatever the parameter sizes (unlike per-parameter
partitioning). The slice the inner optimizer updates is itself a view of the buffer, so no second
copy of the weights exists. A step: the inner optimizer updates this rank's slice from the
(already data-parallel averaged) gradients, then the slices are all-gathered back into the buffer.
"""

from __future__ import annotations

from typing import Dict, List

import torch
import torch.distributed as dist
from torch import nn

from partrain.parallel.local_tensors import like, local, set_data


class ShardedOptimizer:
    """Wraps an optimizer class so that its state covers only this rank's slice of each group."""

    def __init__(self, param_groups: List[Dict], optimizer_cls, group: dist.ProcessGroup, **defaults) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.groups = []
        shard_groups = []
        for spec in param_groups:
            params: List[nn.Parameter] = [p for p in spec["params"] if p.requires_grad]
            # Tensor-parallel DTensors: each rank flattens its local shards (ZeRO-1 over dp of each tp rank).
            numel = sum(local(p).numel() for p in params)
            per_rank = -(-numel // self.world)
            flat = torch.zeros(per_rank * self.world, dtype=params[0].dtype, device=params[0].device)
            offset = 0
            for p in params:
                piece = local(p.detach())
                flat[offset : offset + piece.numel()] = piece.reshape(-1)
                set_data(p, like(p, flat[offset : offset + piece.numel()].view_as(piece)))
                offset += piece.numel()
            shard = nn.Parameter(flat[self.rank * per_rank : (self.rank + 1) * per_rank])
            self.groups.append({"params": params, "numel": numel, "per_rank": per_rank, "shard": shard, "flat": flat})
            shard_groups.append({**{k: v for k, v in spec.items() if k != "params"}, "params": [shard]})
        self.inner = optimizer_cls(shard_groups, **defaults)

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            for p in g["params"]:
                p.grad = None if set_to_none else (p.grad.zero_() if p.grad is not None else None)
            g["shard"].grad = None

    @torch.no_grad()
    def step(self) -> None:
        for g in self.groups:
            lo, hi = self.rank * g["per_rank"], (self.rank + 1) * g["per_rank"]
            grad_slice = torch.zeros(g["per_rank"], dtype=g["flat"].dtype, device=g["shard"].device)
            _copy_range(g["params"], lo, min(hi, g["numel"]), grad_slice, use_grad=True)
            g["shard"].grad = grad_slice
        self.inner.step()
        for g in self.groups:
            g["shard"].grad = None
            # The input must not alias the output buffer: gather from a copy of this rank's slice.
            with torch.profiler.record_function("partrain/dp/all_gather"):  # ZeRO-1: updated shards
                dist.all_gather_into_tensor(g["flat"], g["shard"].detach().clone(), group=self.group)

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (for the memory report)."""
        return tensor_state_bytes(self.inner)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)


def tensor_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's tensor state (moments, momentum; scalar step counters left out)."""
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t) and t.dim() > 0
    )


def _copy_range(params: List[torch.Tensor], lo: int, hi: int, out: torch.Tensor, use_grad: bool) -> None:
    """Copy elements [lo, hi) of the concatenation of params (or their grads) into out[:hi-lo]."""
    offset = 0
    for p in params:
        n = local(p).numel()
        start, end = max(lo, offset), min(hi, offset + n)
        if start < end:
            src = p.grad if use_grad else p
            if src is not None:
                out[start - lo : end - lo] = local(src).reshape(-1)[start - offset : end - offset]
        offset += n
