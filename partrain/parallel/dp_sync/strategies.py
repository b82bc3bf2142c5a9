"""The all-reduce of one flat gradient buffer, by strategy (`parallel.dp_sync`):

- `allreduce`: the backend's collective (gloo/NCCL pick their own algorithm);
- `ring`: partrain's ring (reduce-scatter + all-gather over send/recv) over the dp group;
- `hierarchical`: ring reduce-scatter inside each node, ring all-reduce of this rank's shard across
  nodes (between the ranks with the same position in their node), ring all-gather inside the node.
  Inter-node links carry 1/n_local of the gradient per rank; with one node it is the plain ring.

All of them leave the mean (sum / dp) in the buffer.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.distributed as dist

from partrain.parallel.dp_sync.counter import CommCounter
from partrain.parallel.dp_sync.groups import DpGroups
from partrain.parallel.dp_sync.ring import Ring


class FlatAllReduce(Protocol):
    counter: CommCounter
    size: int

    def mean_(self, flat: torch.Tensor) -> None:
        """Replace flat by its mean over the data-parallel group."""
        ...


class BackendAllReduce:
    def __init__(self, groups: DpGroups, group: Optional[dist.ProcessGroup], counter: CommCounter) -> None:
        self.group, self.counter, self.size = group, counter, len(groups.members)

    def mean_(self, flat: torch.Tensor) -> None:
        if self.size > 1:
            self.counter.all_reduce(flat, self.group)
            flat /= self.size


class RingAllReduce:
    def __init__(self, groups: DpGroups, group: Optional[dist.ProcessGroup], counter: CommCounter) -> None:
        self.ring = Ring(groups.members, groups.me, group, counter)
        self.counter, self.size = counter, len(groups.members)

    def mean_(self, flat: torch.Tensor) -> None:
        if self.size > 1:
            self.ring.all_reduce(flat)
            flat /= self.size


class HierarchicalAllReduce:
    def __init__(self, groups: DpGroups, group: Optional[dist.ProcessGroup], counter: CommCounter) -> None:
        self.local = Ring(groups.local, groups.local.index(groups.members[groups.me]), group, counter)
        self.cross = Ring(groups.cross, groups.cross.index(groups.members[groups.me]), group, counter)
        self.counter, self.size = counter, len(groups.members)

    def mean_(self, flat: torch.Tensor) -> None:
        if self.size == 1:
            return
        chunks = self.local.reduce_scatter(flat)
        # Same position in every node -> same chunk index: the cross ring sums matching shards.
        self.cross.all_reduce(chunks[self.local.owned_chunk()])
        self.local.all_gather(chunks)
        flat /= self.size


STRATEGIES = {"allreduce": BackendAllReduce, "ring": RingAllReduce, "hierarchical": HierarchicalAllReduce}


def flat_all_reduce(
    name: str, groups: DpGroups, group: Optional[dist.ProcessGroup], counter: CommCounter
) -> FlatAllReduce:
    """`group`: for allreduce the dp group itself; for the rings any group holding every member."""
    return STRATEGIES[name](groups, group, counter)
