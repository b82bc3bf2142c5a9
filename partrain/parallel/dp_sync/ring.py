"""Ring reduce-scatter and all-gather over point-to-point send/recv (Patarasuk and Yuan 2009).

N ranks in a ring; the buffer is cut into N chunks (sizes differ by at most one element, so any
N and any buffer length work). Reduce-scatter: N-1 steps, each rank sends one chunk to its right
neighbour and adds the chunk coming from its left; afterwards rank i holds the full sum of chunk
(i+1) mod N. All-gather: N-1 more steps passing the finished chunks around. Each rank sends
2(N-1)/N of the buffer in all: bandwidth-optimal, independent of N.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist

from partrain.parallel.dp_sync.counter import CommCounter


@dataclass
class Ring:
    """One ring: its members (global ranks, in ring order) and where this rank sits."""

    members: Sequence[int]
    me: int
    """This rank's index in members."""
    group: Optional[dist.ProcessGroup]
    """The process group the point-to-point messages travel in (holds every member)."""
    counter: CommCounter

    @property
    def size(self) -> int:
        return len(self.members)

    def owned_chunk(self) -> int:
        """The chunk this rank holds fully reduced after reduce_scatter."""
        return (self.me + 1) % self.size

    def _neighbours(self):
        n = self.size
        return self.members[(self.me + 1) % n], self.members[(self.me - 1) % n]

    def reduce_scatter(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """Sum `flat` over the ring in place, chunk-wise; returns the chunks (views of flat)."""
        n = self.size
        chunks = list(flat.tensor_split(n))
        if n == 1:
            return chunks
        right, left = self._neighbours()
        scratch = torch.empty(max(c.numel() for c in chunks), dtype=flat.dtype, device=flat.device)
        for step in range(n - 1):
            send_i, recv_i = (self.me - step) % n, (self.me - step - 1) % n
            incoming = scratch[: chunks[recv_i].numel()]
            self.counter.exchange([(chunks[send_i], right)], [(incoming, left)], self.group)
            chunks[recv_i].add_(incoming)
        return chunks

    def all_gather(self, chunks: List[torch.Tensor]) -> None:
        """Pass the reduced chunks around until every rank holds all of them (in place)."""
        n = self.size
        if n == 1:
            return
        right, left = self._neighbours()
        for step in range(n - 1):
            send_i, recv_i = (self.me + 1 - step) % n, (self.me - step) % n
            self.counter.exchange([(chunks[send_i], right)], [(chunks[recv_i], left)], self.group)

    def all_reduce(self, flat: torch.Tensor) -> None:
        """Sum over the ring, in place: reduce-scatter then all-gather."""
        self.all_gather(self.reduce_scatter(flat))
