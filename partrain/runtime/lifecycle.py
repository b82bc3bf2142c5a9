"""The life of one rank process, written once: join the process group, work, leave cleanly.

    with joined_group(backend, rank, world_size, timeout_s, store=store):
        ...work...                 # raises -> no barrier: peers are stopped by the launcher or time out
    leave(code)                    # flush, then os._exit

Why not a plain return: gloo processes abort at interpreter exit unless every rank meets a barrier
and destroys the process group, and even then about 15% of the time (design brief, section 10), so
a rank that finished destroys the group and then ends with `os._exit`. A rank that failed skips
the barrier (it would block until the peers' timeout) and leaves at once with its error recorded.
torch is imported inside the functions: the CLI loads this module before deciding to start
workers. Used by the training worker, `partrain bench comm`, the multi-process test helper and the
benchmarks' baseline workers.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from typing import Any, Iterator, NoReturn, Optional


def finish_group() -> None:
    """Meet every peer at a barrier, then destroy the default process group (normal end of work)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@contextlib.contextmanager
def joined_group(
    backend: str,
    rank: int,
    world_size: int,
    timeout_s: float,
    store: Optional[Any] = None,
    init_method: Optional[str] = None,
) -> Iterator[None]:
    """The default process group for the block; `finish_group` when it ends without an exception."""
    import torch.distributed as dist

    dist.init_process_group(
        backend=backend,
        rank=rank,
        world_size=world_size,
        store=store,
        init_method=init_method,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    yield
    finish_group()


def leave(code: int) -> NoReturn:
    """End this process now with `code`, output flushed (never through the interpreter's exit)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader is gone (the launcher was killed): nothing to flush to
            pass
    os._exit(code)
