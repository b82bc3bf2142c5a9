"""The global gradient norm of a model spread over ranks, and clipping to it."""

from __future__ import annotations

import torch


def clip_gradients(parameters, max_norm: float, not_counted=(), sum_group=None) -> float:
    """Global gradient norm over every rank's shards; clip to max_norm when > 0.

    Each rank squares the norm of its local pieces, grouped by the mesh dimensions a piece is sharded
    over: a plain tensor, or a DTensor replicated on every dimension, is whole on the rank and counted
    once; a DTensor sharded over some dimensions has its squares summed over those dimensions' groups
    (one all-reduce per group of tensors, not one per tensor or per placement). DTensors with a Partial
    placement (a sum still pending) go through DTensor's own norm. `not_counted`: parameters whose
    gradient is clipped but left out of the norm (a second copy of a tied weight on another pipeline
    stage). `sum_group`: add the squares over this group too (pipeline stages hold disjoint parameters).

    Why not DTensor's norm for everything: it dispatches every op through DTensor's sharding logic and
    redistributes (and, on a GPU, synchronises with the host) once per placement group; for gpt-3d on
    a CPU that was 14 ms of a rank's 130 ms step.
    """
    skip = {id(p) for p in not_counted}
    grads, by_dims, pending = [], {}, {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        grads.append(g)
        if id(p) in skip:
            continue
        if not hasattr(g, "device_mesh"):
            by_dims.setdefault(None, []).append(g)
        elif any(pl.is_partial() for pl in g.placements):
            pending.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
        else:
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            by_dims.setdefault((g.device_mesh, dims), []).append(g.to_local())
    squares = torch.zeros(1, dtype=torch.float64)
    for key, tensors in by_dims.items():
        sq = torch.nn.utils.get_total_norm(tensors, norm_type=2.0).double().reshape(1) ** 2
        if key is not None:
            mesh, dims = key
            for dim in dims:
                torch.distributed.all_reduce(sq, group=mesh.get_group(dim))
        squares += sq.cpu()
    for tensors in pending.values():
        squares += torch.nn.utils.get_total_norm(tensors, norm_type=2.0).full_tensor().double().cpu() ** 2
    if sum_group is not None and torch.distributed.get_world_size(sum_group) > 1:
        torch.distributed.all_reduce(squares, group=sum_group)
    total = squares.sqrt().float()[0]
    if max_norm > 0:
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
    # A DTensor's local shard is its storage: scaling the shards scales it, without DTensor's dispatch.
    torch._foreach_mul_([g.to_local() if hasattr(g, "device_mesh") else g for g in grads], coefficient)
