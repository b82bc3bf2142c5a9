"""Save a checkpoint: every rank writes its shards with DCP, then rank 0 commits it.

Order (a crash at any point leaves no folder that looks complete):

1. rank 0 removes leftovers of interrupted saves and creates `step-NNNNNNNN.partial/`; barrier;
2. every rank writes `rng/rank-R.pt` and its DCP shards (`dcp.save`, files fsynced);
3. barrier (every rank finished); rank 0 writes `partrain.json` (atomically) and renames the
   folder to `step-NNNNNNNN`, then deletes checkpoints beyond keep_last; barrier.

With async_save=True step 2 copies the state to CPU memory, starts `dcp.async_save` on a separate
gloo process group (so its collectives never interleave with training's) and returns; rank 0
commits in a background thread once DCP reports every rank's data written (DCP's own final
gather is the barrier). `wait_pending_save()` blocks until that is done and re-raises a failure;
the next save calls it first, and the trainer must call it before tearing the process group down.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from partrain.checkpoint import folders
from partrain.checkpoint.dist_util import barrier as _barrier
from partrain.checkpoint.dist_util import distributed as _distributed
from partrain.checkpoint.dist_util import quiet_single_process
from partrain.checkpoint.dist_util import rank_world as _rank_world
from partrain.checkpoint.record import file_sizes, make_record
from partrain.checkpoint.rng import save_rng
from partrain.checkpoint.state import rank_state

log = logging.getLogger("partrain")


@dataclass
class _Pending:
    final: Path
    thread: Optional[threading.Thread] = None
    errors: List[BaseException] = field(default_factory=list)


_pending: Optional[_Pending] = None
_async_group: Any = None


def wait_pending_save() -> Optional[Path]:
    """Block until the running async save (if any) is committed; re-raise its failure. Returns its path."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return None
    if pending.thread is not None:
        pending.thread.join()
    if pending.errors:
        raise RuntimeError(f"asynchronous checkpoint save of {pending.final} failed") from pending.errors[0]
    return pending.final


def _commit(root: Path, step: int, meta: Dict[str, Any], extra: Dict[str, Any], world: int, keep_last: int) -> Path:
    """Rank 0, after every rank wrote: partrain.json, rename, prune."""
    partial, final = folders.partial_dir(root, step), folders.step_dir(root, step)
    record = make_record(meta, step, extra, world, file_sizes(partial))
    folders.write_atomic(partial / folders.RECORD_FILE, json.dumps(record, indent=1))
    folders.commit(partial, final)
    for gone in folders.prune(root, keep_last):
        log.info("deleted old checkpoint %s (keep_last=%d)", gone, keep_last)
    log.info("saved checkpoint %s", final)
    return final


def _get_async_group():
    """A gloo group of all ranks for background saves: created collectively by the first async save
    under the current default process group, reused after that."""
    global _async_group
    if not _distributed():
        return None
    world = dist.group.WORLD
    if _async_group is None or _async_group[0] is not world:
        _async_group = (world, dist.new_group(backend="gloo"))
    return _async_group[1]


def save_checkpoint(
    root: Path,
    step: int,
    model_parts: Sequence[nn.Module],
    optimizer: Any,
    extra: Dict[str, Any],
    meta: Dict[str, Any],
    keep_last: int,
    async_save: bool = False,
) -> Path:
    """Save model_parts and optimizer as `root/step-NNNNNNNN` (collective: every rank calls it).

    model_parts: this rank's modules, each with the full model's FQNs (one, or a pipeline rank's
    stages). optimizer: a torch optimizer, one per part (list), or a ShardedOptimizer (ZeRO-1).
    extra: JSON for the trainer (data position...), recorded from rank 0. meta: `run_meta(...)`.
    keep_last: complete checkpoints to keep (0 = all). Returns the final folder (with
    async_save, it exists once wait_pending_save() returned).
    """
    root = Path(root)
    wait_pending_save()
    json.dumps(extra)  # not JSON: fail now, on every rank alike, before anything is written
    rank, world = _rank_world()
    partial, final = folders.partial_dir(root, step), folders.step_dir(root, step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        folders.clear_leftovers(root)
        partial.mkdir()
    _barrier()
    save_rng(partial, rank)
    state = rank_state(model_parts, optimizer, for_save=True)
    writer = FileSystemWriter(partial, sync_files=True)
    if not async_save:
        with quiet_single_process():
            dcp.save(state.state, storage_writer=writer, no_dist=not _distributed())
        _barrier()
        if rank == 0:
            _commit(root, step, meta, extra, world, keep_last)
        _barrier()
        return final

    global _pending
    group = _get_async_group()
    with quiet_single_process():
        future = dcp.async_save(state.state, storage_writer=writer, process_group=group, no_dist=not _distributed())
    del state  # the staged copy is what is being written; training may change the originals now
    pending = _Pending(final=final)

    def finish() -> None:
        try:
            future.result()
            if rank == 0:
                _commit(root, step, meta, extra, world, keep_last)
        except BaseException as exc:  # noqa: BLE001 - handed to wait_pending_save
            log.error("asynchronous save of %s failed: %s", final, exc)
            pending.errors.append(exc)

    pending.thread = threading.Thread(target=finish, name=f"partrain-save-{step}", daemon=True)
    pending.thread.start()
    _pending = pending
    return final
