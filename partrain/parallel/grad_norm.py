"""The global gradient norm of a model spread over ranks, and clipping to it."""

from __future__ import annotations

import torch


def clip_gradients(parameters, max_norm: float, not_counted=(), sum_group=None) -> float:
    """Global gradient norm over every rank's shards; clip to max_norm when > 0.

    Gradients are grouped by kind: plain tensors (replicated, counted once) and DTensors per mesh
    and placement set (their norms are Partial over shard dims: full_tensor() sums the squares).
    `not_counted`: parameters whose gradient is clipped but left out of the norm (a second copy of
    a tied weight on another pipeline stage). `sum_group`: add the squares over this group too
    (pipeline stages hold disjoint parameters).
    """
    skip = {id(p) for p in not_counted}
    groups, clipped = {}, {}
    for p in parameters:
        if p.grad is None:
            continue
        key = (p.grad.device_mesh, tuple(p.grad.placements)) if hasattr(p.grad, "device_mesh") else None
        clipped.setdefault(key, []).append(p.grad)
        if id(p) not in skip:
            groups.setdefault(key, []).append(p.grad)
    squares = torch.zeros(1, dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        squares += norm.double().cpu() ** 2
    if sum_group is not None and torch.distributed.get_world_size(sum_group) > 1:
        torch.distributed.all_reduce(squares, group=sum_group)
    total = squares.sqrt().float()[0]
    if max_norm > 0:
        for grads in clipped.values():
            scale_to_norm(grads, max_norm, total)
    return float(total)


def scale_to_norm(grads, max_norm: float, total: torch.Tensor) -> None:
    """Scale gradient tensors in place so that their global norm `total` is at most max_norm: the
    coefficient max_norm / (total + 1e-6), clamped at 1, as torch's clip_grads_with_norm_ uses (shared
    with the parameter server's shards). That function takes parameters and reads their .grad: given
    the gradients themselves it scaled nothing, so until this was found no run was clipped."""
    coefficient = max_norm / (float(total) + 1e-6)
    if coefficient >= 1.0:
        return
    if any(hasattr(g, "device_mesh") for g in grads):
        for g in grads:  # DTensor gradients: their local shards scale alike
            g.mul_(coefficient)
    else:
        torch._foreach_mul_(list(grads), coefficient)
