"""Gradients of the routed experts (partrain.parallel.expert_parallel): FSDP over their own mesh, or the
explicit sync without FSDP.

Dense gradients average over dp x sp; an expert's gradient already sums the contributions of its whole
ep group, so expert gradients are summed over the expert-data-parallel group (edp, ranks holding the
same experts) and divided by the dp x sp size.
"""

from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partrain.parallel.expert_parallel import RoutedExperts


def shard_experts_fsdp(model: nn.Module, mesh, zero_stage: int, precision: str) -> None:
    """FSDP for the experts on their own mesh (edp: ranks holding the same experts), before the
    layers are sharded over dp x sp (which then skips the experts' parameters).

    FSDP averages over its mesh (edp); the expert gradient already sums the ep group's tokens, so
    the right divisor is the whole dp x sp size: the missing 1/ep is applied in the experts'
    backward (FSDP's set_gradient_divide_factor needs ReduceOp.PREMUL_SUM, which gloo lacks).
    """
    from torch.distributed.fsdp import fully_shard

    from partrain.parallel.precision import mixed_precision_policy

    policy = mixed_precision_policy(precision)
    extra = {"mp_policy": policy} if policy is not None else {}
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            fully_shard(module, mesh=mesh["edp"], reshard_after_forward=zero_stage == 3, **extra)
            module.grad_factor = 1.0 / mesh.size("ep")


def expert_parameters(parts: Sequence[nn.Module]) -> List[nn.Parameter]:
    seen, out = set(), []
    for part in parts:
        for module in part.modules():
            if isinstance(module, RoutedExperts):
                for p in module.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        out.append(p)
    return out


def _local_grads(params) -> List[torch.Tensor]:
    grads = []
    for p in params:
        if p.grad is None:
            # Not expected (every local expert runs each step), but a missing gradient must not
            # shift the flat buffer between ranks.
            p.grad = torch.zeros_like(p)
        grads.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    return grads


def _sum_into(grads: List[torch.Tensor], group, divisor: int) -> None:
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None:
        with torch.profiler.record_function("partrain/ep/grad_all_reduce"):  # experts over edp, the rest over dp
            dist.all_reduce(flat, group=group)
    flat /= divisor
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_gradients(parts: Sequence[nn.Module], mesh) -> None:
    """Without FSDP: dense gradients averaged over dp x sp, expert gradients summed over edp and
    divided by the dp x sp size (see the module docstring)."""
    experts = {id(p) for p in expert_parameters(parts)}
    dense, seen = [], set()
    for part in parts:
        for p in part.parameters():
            if p.grad is not None and id(p) not in seen and id(p) not in experts:
                seen.add(id(p))
                dense.append(p)
    size = mesh.size("dp_sp")
    if size > 1:
        _sum_into(_local_grads(dense), mesh["dp_sp"].get_group(), size)
    edp = mesh["edp"].get_group() if mesh.size("edp") > 1 else None
    if size > 1:
        _sum_into(_local_grads(expert_parameters(parts)), edp, size)
