"""Bytes each rank really hands to the network during gradient synchronisation.

Every send, receive and collective of the `dp_sync` strategies goes through a `CommCounter`, so
the bench reports what was sent, not what a formula says. For the backend's own all-reduce the
count is what partrain handed to it (the bytes gloo/NCCL put on the wire inside are not visible).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class CommCounter:
    """Running totals of one rank's gradient-sync traffic."""

    sent_bytes: int = 0
    recv_bytes: int = 0
    messages: int = 0
    """Point-to-point messages sent (or collective calls made)."""
    seconds: float = 0.0
    """Wall time spent inside the counted calls (waiting included)."""
    to_peer: Dict[int, int] = field(default_factory=dict)
    """Bytes sent point-to-point to each global rank (which links they crossed; collectives excluded)."""

    def exchange(
        self,
        sends: Sequence[Tuple[torch.Tensor, int]],
        recvs: Sequence[Tuple[torch.Tensor, int]],
        group: Optional[dist.ProcessGroup],
    ) -> None:
        """Post every receive and send (peers are global ranks), then wait for all of them.
        Empty tensors are skipped on both sides: both compute the same sizes."""
        t0 = time.perf_counter()
        with torch.profiler.record_function("partrain/dp/send_recv"):
            self._post_and_wait(sends, recvs, group)
        self.seconds += time.perf_counter() - t0

    def _post_and_wait(self, sends, recvs, group) -> None:
        works: List = []
        for buf, src in recvs:
            if buf.numel():
                works.append(dist.irecv(buf, src=src, group=group))
                self.recv_bytes += nbytes(buf)
        for buf, dst in sends:
            if buf.numel():
                works.append(dist.isend(buf.contiguous(), dst=dst, group=group))
                self.sent_bytes += nbytes(buf)
                self.to_peer[dst] = self.to_peer.get(dst, 0) + nbytes(buf)
                self.messages += 1
        for w in works:
            w.wait()

    def all_reduce(self, t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
        """The backend's sum all-reduce; counted as the bytes handed to it, each way."""
        t0 = time.perf_counter()
        with torch.profiler.record_function("partrain/dp/all_reduce"):
            dist.all_reduce(t, group=group)
        self.sent_bytes += nbytes(t)
        self.recv_bytes += nbytes(t)
        self.messages += 1
        self.seconds += time.perf_counter() - t0

    def reset(self) -> None:
        self.sent_bytes = self.recv_bytes = self.messages = 0
        self.seconds = 0.0
        self.to_peer = {}

    def to_json(self) -> dict:
        return asdict(self)
