"""The few torch.distributed facts checkpointing needs, valid with or without a process group."""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from typing import Any, Iterator, List, Tuple

import torch.distributed as dist

log = logging.getLogger("partrain")


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> Tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if distributed() else (0, 1)


def barrier() -> None:
    if distributed():
        dist.barrier()


def all_gather(obj: Any) -> List[Any]:
    """Every rank's obj in rank order (collective; [obj] without a process group). Used to agree on
    a verdict: a rank that failed must not raise alone while the others go on into a collective."""
    if not distributed():
        return [obj]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def from_rank0(obj: Any) -> Any:
    """Rank 0's obj on every rank (collective; obj itself without a process group)."""
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def warn_user(message: str) -> None:
    """A warning the user must see. In a training run: into this rank's log and, from rank 0, on its
    stdout too, which the launcher shows on the terminal (the logs are files nobody watches). In one
    process without logging set up (the CLI): one `warning: ...` line on stderr."""
    if log.hasHandlers():
        log.warning("%s", message)
    if distributed():
        if dist.get_rank() == 0:
            print(f"warning: {message}", file=sys.stdout, flush=True)
    elif not log.hasHandlers():
        print(f"warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without a process group DCP warns on every call that it assumes one process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
