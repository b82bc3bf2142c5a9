"""Gradient buckets launched during backward, as soon as each bucket's gradients are final.

Parameters are packed into buckets of about `bucket_mb` MiB in reverse registration order (the
order backward produces their gradients, as DDP does). A post-accumulate-grad hook counts the
parameters of a bucket whose gradient is complete; the last one copies the bucket into its flat
buffer and queues it to a communication thread, which averages it over the dp group while
backward goes on computing earlier layers' gradients. `finish()` (after the last backward of the
step) launches any bucket still waiting (parameters without a gradient count as zeros), waits for
the thread and copies the averages back into `.grad`.

Overlap is measured per step: `busy_s` is the time the thread spent synchronising, `exposed_s` the
part of it backward did not hide (what `finish()` waited); overlap = 1 - exposed / busy.
Only the last microbatch of a step launches buckets (earlier ones just accumulate, like DDP's
no_sync).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import nn

from partrain.parallel.dp_sync.strategies import FlatAllReduce


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@dataclass
class Bucket:
    params: List[nn.Parameter]
    flat: torch.Tensor
    ready: int = 0


@dataclass
class OverlapStats:
    steps: int = 0
    busy_s: float = 0.0
    exposed_s: float = 0.0
    buckets: int = 0

    @property
    def overlap(self) -> float:
        return 1.0 - self.exposed_s / self.busy_s if self.busy_s > 0 else 0.0

    def to_json(self) -> dict:
        return {**self.__dict__, "overlap": self.overlap}


def make_buckets(params: List[nn.Parameter], bucket_mb: float) -> List[Bucket]:
    limit = max(1, int(bucket_mb * 2**20))
    buckets, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += _local(p).numel() * p.element_size()
        if size >= limit:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    out = []
    for ps in buckets:
        numel = sum(_local(p).numel() for p in ps)
        out.append(Bucket(ps, torch.zeros(numel, dtype=ps[0].dtype, device=_local(ps[0]).device)))
    return out


class BucketedSync:
    """Hooks + one communication thread; `microbatch(last)` arms the hooks for the last microbatch."""

    def __init__(self, params: List[nn.Parameter], strategy: FlatAllReduce, bucket_mb: float) -> None:
        self.strategy = strategy
        self.buckets = make_buckets([p for p in params if p.requires_grad], bucket_mb)
        self.stats = OverlapStats()
        self.armed = False
        self._launched: List[Bucket] = []
        self._work: "queue.Queue[Optional[Bucket]]" = queue.Queue()
        self._done = threading.Semaphore(0)
        self._busy = 0.0
        self._error: Optional[BaseException] = None
        self._handles = []
        for b in self.buckets:
            for p in b.params:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(b)))
        self._thread = threading.Thread(target=self._serve, name="dp-sync", daemon=True)
        self._thread.start()

    def _hook(self, bucket: Bucket):
        def ready(_param) -> None:
            if self.armed:
                bucket.ready += 1
                if bucket.ready == len(bucket.params):
                    self._launch(bucket)

        return ready

    def _launch(self, bucket: Bucket) -> None:
        offset = 0
        for p in bucket.params:
            n = _local(p).numel()
            if p.grad is None:
                bucket.flat[offset : offset + n].zero_()
            else:
                bucket.flat[offset : offset + n].copy_(_local(p.grad).reshape(-1))
            offset += n
        bucket.ready = -1  # launched
        self._launched.append(bucket)
        self._work.put(bucket)

    def _serve(self) -> None:
        while True:
            bucket = self._work.get()
            if bucket is None:
                return
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    self.strategy.mean_(bucket.flat)
            except BaseException as exc:  # reported on the training thread by finish()
                self._error = exc
            self._busy += time.perf_counter() - t0
            self._done.release()

    @contextlib.contextmanager
    def microbatch(self, last: bool):
        self.armed = last
        try:
            yield
        finally:
            self.armed = False

    @torch.no_grad()
    def finish(self) -> None:
        """After the step's last backward: launch what is left, wait, write the means into .grad."""
        t0 = time.perf_counter()
        for b in self.buckets:
            if b.ready != -1:
                self._launch(b)
        for _ in self._launched:
            self._done.acquire()
        exposed = time.perf_counter() - t0
        if self._error is not None:
            raise RuntimeError("gradient synchronisation failed") from self._error
        for b in self._launched:
            offset = 0
            for p in b.params:
                local = _local(p)
                n = local.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _local(p.grad).copy_(b.flat[offset : offset + n].view_as(local))
                offset += n
            b.ready = 0
        self.stats.steps += 1
        self.stats.buckets += len(self._launched)
        self.stats.busy_s += self._busy
        self.stats.exposed_s += min(exposed, self._busy)
        self._busy = 0.0
        self._launched = []

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=10)
        for h in self._handles:
            h.remove()
