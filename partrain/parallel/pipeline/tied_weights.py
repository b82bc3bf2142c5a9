"""The tied embedding/head weight across pipeline chunks: gradient sync between its two copies, and
gradient clipping that counts it once."""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from partrain.parallel.pipeline.stage import unwrap_ddp


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def tied_weight_sync(
    stage_modules: Sequence[nn.Module], pp_group: Optional[dist.ProcessGroup], first_owner: int, last_owner: int
) -> bool:
    """Make both copies of the tied embedding/head weight hold grad(first) + grad(last).

    Call on every pp rank after the pipeline backward (after DDP/FSDP have reduced the gradients
    over dp), before clipping. first_owner / last_owner are the pp-group ranks owning chunk 0 and
    the last chunk. Ranks owning neither return at once; the two owners exchange their (local
    shard of the) gradient point-to-point and both add in the same order (first + last), so the
    copies stay bit-identical. Returns whether this rank held a tied copy.
    """
    mods = [unwrap_ddp(m) for m in stage_modules]
    first = next((m.tied_weight() for m in mods if m.is_first and m.tied_weight() is not None), None)
    last = next((m.tied_weight() for m in mods if m.is_last and m.tied_weight() is not None), None)
    if first is None and last is None:
        return False
    if not (first if first is not None else last).requires_grad:  # frozen (peft=lora): nothing to sum
        return True
    for p in (first, last):
        # A tensor-parallel embedding's gradient can come back Partial/Replicate: bring it to the
        # parameter's own sharding so both copies exchange equal-sized local shards.
        if p is not None and p.grad is not None and hasattr(p.grad, "placements") and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    if first is not None and last is not None:
        if first is last:  # one chunk holds both: the module itself ties them
            return True
        total = _local(first.grad) + _local(last.grad)
        _local(first.grad).copy_(total)
        _local(last.grad).copy_(total)
        return True
    mine = first if first is not None else last
    if mine.grad is None:
        raise RuntimeError("tied weight has no gradient: call tied_weight_sync after backward")
    grad = _local(mine.grad)
    peer = last_owner if first is not None else first_owner
    send, recv = grad.contiguous().clone(), torch.empty_like(grad, memory_format=torch.contiguous_format)
    ops = [
        dist.P2POp(dist.isend, send, group=pp_group, group_peer=peer),
        dist.P2POp(dist.irecv, recv, group=pp_group, group_peer=peer),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    grad.copy_(send + recv if first is not None else recv + send)  # always first + last
    return True


def all_reduce_grads(modules: Sequence[nn.Module], group: Optional[dist.ProcessGroup]) -> None:
    """Average every gradient of `modules` over `group` (see data_parallel.allreduce_gradients_of)."""
    from partrain.parallel.data_parallel import allreduce_gradients_of

    allreduce_gradients_of(modules, group, dist.get_world_size(group) if group is not None else 1)


@torch.no_grad()
def clip_grad_norm_(
    stage_modules: Sequence[nn.Module], max_norm: float, pp_group: Optional[dist.ProcessGroup] = None
) -> float:
    """Global gradient norm of the whole pipelined model; clips to max_norm when > 0.

    Each rank takes the norm of its stages' gradients (plain, and DTensor shards of FSDP/TP combined
    over their own meshes), the last chunk's tied-weight copy left out (it equals the first chunk's),
    then the squares are summed over the pp group. Every pp rank gets the same norm.
    """
    from partrain.parallel.grad_norm import clip_gradients

    params = {id(p): p for m in stage_modules for p in m.parameters()}.values()
    return clip_gradients(params, max_norm, not_counted=second_tied_copies(stage_modules), sum_group=pp_group)


def second_tied_copies(stage_modules: Sequence[nn.Module]) -> List[nn.Parameter]:
    """The last chunk's copy of a tied embedding/head weight (its gradient equals the first chunk's)."""
    copies = []
    for m in stage_modules:
        inner = unwrap_ddp(m)
        if inner.is_last and not inner.is_first and inner.tied_weight() is not None:
            copies.append(inner.tied_weight())
    return copies
