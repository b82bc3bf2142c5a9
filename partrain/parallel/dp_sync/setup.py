"""Build the gradient synchronisation a rank uses for `parallel.dp_sync` (see the package docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from partrain.parallel.dp_sync.buckets import BucketedSync
from partrain.parallel.dp_sync.counter import CommCounter
from partrain.parallel.dp_sync.groups import DpGroups, dp_groups
from partrain.parallel.dp_sync.strategies import FlatAllReduce, flat_all_reduce


@dataclass(frozen=True)
class SyncSettings:
    """The `parallel.dp_sync*` keys, as the runtime needs them."""

    strategy: str = "allreduce"
    bucket_mb: float = 25.0
    ps_servers: int = 1

    @classmethod
    def of(cls, parallel) -> "SyncSettings":
        return cls(parallel.dp_sync, parallel.dp_bucket_mb, parallel.ps_servers)


@dataclass
class SyncRuntime:
    """What a rank built for its gradient sync: the byte counter the bench and tests read, and the
    bucketed hooks (overlap statistics) where backward launches the buckets."""

    counter: CommCounter = field(default_factory=CommCounter)
    bucketed: Optional[BucketedSync] = None
    flat: Optional[FlatAllReduce] = None
    server: Optional[object] = None


def rank_groups(mesh) -> DpGroups:
    return dp_groups(mesh.layout, dist.get_rank())


def p2p_group() -> dist.ProcessGroup:
    """A process group of the whole world for the strategies' own messages only: the bucket thread
    sends in it while the training thread may run other collectives (every rank must call this)."""
    return dist.new_group()


def flat_strategy(name: str, mesh, counter: CommCounter) -> FlatAllReduce:
    groups = rank_groups(mesh)
    group = mesh["dp_sp"].get_group() if name == "allreduce" else p2p_group()
    return flat_all_reduce(name, groups, group, counter)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def sync_flat(modules: Iterable[nn.Module], strategy: FlatAllReduce) -> None:
    """Average every gradient of `modules` in one flat buffer (tensor-parallel DTensor parameters,
    pipeline stages: layouts where gradients are synchronised after backward, not during it)."""
    grads: List[torch.Tensor] = []
    seen = set()
    for module in modules:
        for p in module.parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                grads.append(_local(p.grad))
    if strategy.size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    strategy.mean_(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
