"""Save a checkpoint: every rank writes and hashes its shards with DCP, then rank 0 commits it.

Order (a crash at any point leaves no folder that looks complete; a failure on any rank stops
every rank alike, never one alone while the others wait in a collective):

1. rank 0 removes leftovers of interrupted saves and creates `step-NNNNNNNN.partial/`; every rank
   learns whether that worked (a gather of each rank's failure, which is also the barrier);
2. every rank writes `rng/rank-R.pt` (gather), then its DCP shards (`dcp.save`, files fsynced;
   DCP raises on every rank when any rank failed);
3. every rank hashes (SHA-256, streamed) the files it wrote itself (`checksums.owned_files`) and
   the hashes are gathered: the gather is the barrier saying every rank finished writing, and no
   rank re-reads the whole checkpoint on the training path;
4. rank 0 writes `partrain.json` (sizes and hashes; atomically) and renames the folder to
   `step-NNNNNNNN`, then deletes checkpoints beyond keep_last; its outcome is broadcast;
5. every rank looks for `step-NNNNNNNN` itself and the findings are gathered: a rank on a node that
   does not see it (a node-local checkpoint.dir: its shards went into its own `.partial` folder,
   which nobody commits) fails the save on every rank, naming the ranks and hosts; no rank reports
   a checkpoint saved that some rank cannot see.

A failure in any step removes the `.partial` folder and raises `SaveFailed` on every rank, one line
naming the cause and the folder ("no space left on device writing <dir>: free space or set
checkpoint.dir elsewhere").

With async_save=True step 2 copies the state to CPU memory, starts `dcp.async_save` on a separate
gloo process group (so its collectives never interleave with training's) and returns; rank 0
commits in a background thread once DCP reports every rank's data written (DCP's own final
gather is the barrier) and hashes every file itself there: it is off the training path, and
a gather of per-rank hashes from those threads would be one more collective racing DCP's on the
save group. `wait_pending_save()` (collective) blocks until that is done on every rank and raises
a failure of any rank on all (step 5 included); the next save calls it first, and the trainer must
call it before tearing the process group down.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

from partrain.checkpoint import folders
from partrain.checkpoint.checksums import checkpoint_files, digests, owned_files
from partrain.checkpoint.dist_util import all_gather, barrier, from_rank0, quiet_single_process
from partrain.checkpoint.dist_util import distributed as _distributed
from partrain.checkpoint.dist_util import rank_world as _rank_world
from partrain.checkpoint.failures import SaveFailed, is_failure, save_failure
from partrain.checkpoint.record import make_record
from partrain.checkpoint.rng import save_rng
from partrain.checkpoint.state import rank_state

log = logging.getLogger("partrain")

Digests = Dict[str, Tuple[int, str]]


@dataclass
class _Pending:
    final: Path
    thread: Optional[threading.Thread] = None
    errors: List[BaseException] = field(default_factory=list)


_pending: Optional[_Pending] = None
_async_group: Any = None


def wait_pending_save() -> Optional[Path]:
    """Block until the running async save (if any) is committed; raise its failure. Returns its path.

    Collective when a save is pending (every rank calls it at the same points: the next save and
    the trainer's end): the ranks gather each one's outcome, so no rank goes on before rank 0's
    commit (partrain.json, rename) is done and every rank raises if it failed on any."""
    global _pending
    pending, _pending = _pending, None
    if pending is None:
        return None
    if pending.thread is not None:
        pending.thread.join()
    failed = [f for f in all_gather(str(pending.errors[0]) if pending.errors else None) if f]
    if failed:
        raise SaveFailed(failed[0])
    _settle_visible(pending.final, pending.final.with_name(pending.final.name + folders.PARTIAL_SUFFIX))
    return pending.final


VISIBLE_WAIT_S = 10.0
"""How long a rank looks for the committed folder before calling it unseen: a shared file system
(NFS's attribute cache) may show another host's rename a few seconds late."""


def _sees(final: Path) -> bool:
    deadline = time.monotonic() + VISIBLE_WAIT_S
    while not (final / folders.RECORD_FILE).is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _settle_visible(final: Path, partial: Path) -> None:
    """Step 5 (collective, after rank 0 committed `final`): every rank must see it. Otherwise the
    checkpoint is unusable (its shards are split between folders): it and the unseen `.partial`
    copies are removed and every rank raises SaveFailed naming the ranks that do not see it."""
    rank, _ = _rank_world()
    seen = all_gather(None if _sees(final) else (rank, socket.gethostname()))
    blind = [who for who in seen if who is not None]
    if not blind:
        return
    if rank in [r for r, _ in blind]:  # its shards, which no rank will commit
        shutil.rmtree(partial, ignore_errors=True)
    elif rank == 0:  # names shards it does not hold: verify and resume would refuse it anyway
        shutil.rmtree(final, ignore_errors=True)
    barrier()
    ranks = ", ".join(f"rank {r} on {host}" for r, host in blind)
    raise SaveFailed(
        f"checkpoint.dir is not one folder every node sees: {ranks} cannot see {final}, which rank 0 "
        f"committed (each node wrote its shards into its own copy of {partial.name}); set checkpoint.dir "
        "to a folder on a file system every node mounts"
    )


def _attempt(action: Callable[[], Any], folder: Path) -> Optional[str]:
    """Run action; None when it worked, else one line naming the cause (never Ctrl-C / exit)."""
    try:
        action()
        return None
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if not is_failure(exc):
            raise
        log.error("checkpoint save failed in %s", folder, exc_info=True)
        return save_failure(exc, folder)


def _settle(failures: Sequence[Optional[str]], partial: Path, rank: int) -> None:
    """After every rank's outcome is known (same list everywhere): on any failure rank 0 removes the
    unfinished folder and every rank raises the first failure."""
    failed = [f for f in failures if f]
    if failed:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        barrier()  # every rank sees the folder gone once SaveFailed is raised
        raise SaveFailed(failed[0])


def _prepare(root: Path, partial: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    folders.clear_leftovers(root)
    partial.mkdir()


def _commit(
    root: Path, step: int, meta: Dict[str, Any], extra: Dict[str, Any], world: int, keep_last: int, hashed: Digests
) -> Path:
    """Rank 0, after every rank wrote: hash what no rank hashed, partrain.json, rename, prune."""
    partial, final = folders.partial_dir(root, step), folders.step_dir(root, step)
    files = checkpoint_files(partial)
    unclaimed = [rel for rel in files if rel not in hashed]
    if unclaimed:  # async saves (all files), or a file no rank claimed as its own
        started = time.perf_counter()
        hashed = {**hashed, **digests(partial, unclaimed)}
        log.info("rank 0 hashed %d file(s) in %.3f s", len(unclaimed), time.perf_counter() - started)
    sizes = {rel: hashed[rel][0] for rel in files}
    record = make_record(meta, step, extra, world, sizes, {rel: hashed[rel][1] for rel in files})
    folders.write_atomic(partial / folders.RECORD_FILE, json.dumps(record, indent=1))
    folders.commit(partial, final)
    try:
        for gone in folders.prune(root, keep_last):
            log.info("deleted old checkpoint %s (keep_last=%d)", gone, keep_last)
    except OSError as exc:  # the new checkpoint is committed: an old one left behind is no failure
        log.warning("could not delete old checkpoints in %s: %s", root, exc)
    log.info("saved checkpoint %s (%d files, %.1f MiB)", final, len(files), sum(sizes.values()) / 2**20)
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


def _write_and_hash(state: Dict[str, Any], partial: Path, rank: int, into: Digests) -> None:
    with quiet_single_process():
        dcp.save(state, storage_writer=FileSystemWriter(partial, sync_files=True), no_dist=not _distributed())
    started = time.perf_counter()
    into.update(digests(partial, owned_files(checkpoint_files(partial), rank)))
    seconds = time.perf_counter() - started
    mib = sum(size for size, _ in into.values()) / 2**20
    rate = mib / max(seconds, 1e-9)
    log.info("hashed %d own file(s), %.2f MiB, in %.3f s (%.0f MiB/s)", len(into), mib, seconds, rate)


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
    async_save, it exists once wait_pending_save() returned). Raises SaveFailed on every rank
    when any rank could not write (the `.partial` folder is removed).
    """
    root = Path(root)
    wait_pending_save()
    json.dumps(extra)  # not JSON: fail now, on every rank alike, before anything is written
    rank, world = _rank_world()
    partial, final = folders.partial_dir(root, step), folders.step_dir(root, step)
    _settle(all_gather(_attempt(lambda: _prepare(root, partial) if rank == 0 else None, root)), partial, rank)
    _settle(all_gather(_attempt(lambda: save_rng(partial, rank), partial)), partial, rank)
    state = rank_state(model_parts, optimizer, for_save=True)
    if async_save:
        return _save_async(state.state, root, step, meta, extra, world, keep_last)

    hashed: Digests = {}
    gathered = all_gather((_attempt(lambda: _write_and_hash(state.state, partial, rank, hashed), partial), hashed))
    _settle([failure for failure, _ in gathered], partial, rank)
    failure = None
    if rank == 0:
        merged = {rel: digest for _, part in gathered for rel, digest in part.items()}
        failure = _attempt(lambda: _commit(root, step, meta, extra, world, keep_last, merged), partial)
    _settle([from_rank0(failure)], partial, rank)
    _settle_visible(final, partial)  # only now may any rank say the checkpoint is saved
    return final


def _save_async(
    state: Dict[str, Any],
    root: Path,
    step: int,
    meta: Dict[str, Any],
    extra: Dict[str, Any],
    world: int,
    keep_last: int,
) -> Path:
    """Start writing in the background; rank 0's thread hashes every file and commits (see module docstring)."""
    global _pending
    rank, _ = _rank_world()
    partial, final = folders.partial_dir(root, step), folders.step_dir(root, step)
    group = _get_async_group()
    started: List[Any] = []
    writer = FileSystemWriter(partial, sync_files=True)

    def start() -> None:
        with quiet_single_process():
            no_dist = not _distributed()
            started.append(dcp.async_save(state, storage_writer=writer, process_group=group, no_dist=no_dist))

    _settle(all_gather(_attempt(start, partial)), partial, rank)
    future = started[0]  # the staged copy is what is being written: training may change the originals now
    pending = _Pending(final=final)

    def finish() -> None:
        try:
            future.result()
            if rank == 0:
                _commit(root, step, meta, extra, world, keep_last, {})
        except BaseException as exc:  # noqa: BLE001 - handed to wait_pending_save
            message = save_failure(exc, partial)
            log.error("asynchronous save of %s failed: %s", final, message, exc_info=True)
            if rank == 0:  # DCP's final gather failed: every rank stopped writing
                shutil.rmtree(partial, ignore_errors=True)
            pending.errors.append(SaveFailed(message))

    pending.thread = threading.Thread(target=finish, name=f"partrain-save-{step}", daemon=True)
    pending.thread.start()
    _pending = pending
    return final
