"""Load a checkpoint into any layout: check partrain.json and every file, then DCP reshards into
this rank's pieces.

Checks come before any tensor is touched: partrain.json parses and is ours; the model is the one
the run builds (arch and every size-determining config value); every file it lists exists with its
recorded size and SHA-256 (the files are dealt out to the ranks by size, so the cost is one read
of the checkpoint spread over the ranks); DCP's `.metadata` unpickles with the allow-list. Then `dcp.load`
reads each rank's pieces straight into its parameters and optimizer state, and each rank restores
its RNG state.

Every phase ends with a gather of each rank's verdict, so all ranks raise the same error or none
does: a rank that found a bad file must not raise alone while the others go on into `dcp.load`
(that hangs until the timeout). Any failure to read (torch's CheckpointException, which is a
BaseException, OSError, unpickling, torch.load's RuntimeError, EOFError, ...) becomes a
CorruptCheckpoint naming the file, which resume=auto falls back past.

Optimizer hyperparameters (lr, betas, eps, weight decay) are not taken from the checkpoint: the
run's config decides them (the schedule sets lr every step anyway); exp_avg, exp_avg_sq and step
are restored.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch.distributed.checkpoint as dcp
from torch import nn

from partrain.checkpoint import folders
from partrain.checkpoint.checksums import share
from partrain.checkpoint.dist_util import all_gather, distributed, quiet_single_process, rank_world, warn_user
from partrain.checkpoint.failures import causes, first_line, is_failure
from partrain.checkpoint.record import (
    RESUME_KEY,
    CorruptCheckpoint,
    check_files,
    check_model,
    corrupt,
    has_checksums,
    no_checksums_warning,
    read_record,
)
from partrain.checkpoint.resume_agreement import check_same_checkpoints
from partrain.checkpoint.rng import restore_rng, rng_path
from partrain.checkpoint.safe_io import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnreadableFile,
    read_metadata,
)
from partrain.checkpoint.state import MODEL, OPTIM, apply_loaded, rank_state
from partrain.errors import ConfigError, Problem

log = logging.getLogger("partrain")

_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")

Verdict = Optional[Tuple[bool, List[Problem]]]
"""None (fine) or (is it damage rather than a wrong model, the problems): what ranks exchange."""


def _verdict(action: Callable[[], Any], blame: Callable[[BaseException], ConfigError]) -> Tuple[Any, Verdict]:
    try:
        return action(), None
    except ConfigError as err:
        return None, (isinstance(err, CorruptCheckpoint), list(err.problems))
    except BaseException as exc:  # noqa: BLE001 - CheckpointException is a BaseException
        if not is_failure(exc):
            raise
        log.info("checkpoint read failed", exc_info=True)
        err = blame(exc)
        return None, (isinstance(err, CorruptCheckpoint), list(err.problems))


def _agreed(action: Callable[[], Any], blame: Callable[[BaseException], ConfigError]) -> Any:
    """Run action on every rank, then agree (collective): if it failed on any rank, every rank raises
    the union of the problems (CorruptCheckpoint when all are damage, else ConfigError)."""
    result, verdict = _verdict(action, blame)
    failed = [v for v in all_gather(verdict) if v is not None]
    if not failed:
        return result
    problems: List[Problem] = []
    for _, found in failed:
        problems += [p for p in found if p not in problems]
    raise (CorruptCheckpoint if all(damage for damage, _ in failed) else ConfigError)(problems)


def _checked_record(path: Path, expect: Optional[Dict[str, Any]], key: str) -> Dict[str, Any]:
    """partrain.json, the model check, this rank's share of the file checks, and the index."""
    rank, world = rank_world()
    record = read_record(path, key=key)
    check_model(record, expect, path / folders.RECORD_FILE)
    if not has_checksums(record) and rank == 0:
        warn_user(no_checksums_warning(path))
    check_files(path, record, key=key, files=share(record["files"], rank, world))
    try:
        read_metadata(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read the index means the same to the user
        raise corrupt(path / folders.METADATA_FILE, f"cannot be read: {first_line(exc)}", key=key) from exc
    return record


def _blame_data(path: Path, key: str) -> Callable[[BaseException], ConfigError]:
    """A dcp.load failure as a CorruptCheckpoint naming the data file DCP's text names, if any."""

    def blame(exc: BaseException) -> ConfigError:
        unreadable = next((e for e in causes(exc) if isinstance(e, UnreadableFile)), None)
        if unreadable is not None:
            return corrupt(path / unreadable.relative_path, f"cannot be read: {unreadable.reason}", key=key)
        text = str(exc)
        named = _DATA_FILE.search(text)
        where = path / named.group(0) if named else path
        missing = re.search(r"Missing key in checkpoint state_dict: ([^\s.]+\.[^\s]+)", text)
        if missing:
            return corrupt(
                where, f"lacks {missing.group(1)}, which this run needs (saved by another kind of run?)", key=key
            )
        return corrupt(where, f"cannot be loaded: {first_line(exc)}", key=key)

    return blame


def load_checkpoint(
    path: Path,
    model_parts: Sequence[nn.Module],
    optimizer: Any,
    expect: Optional[Dict[str, Any]],
    key: str = RESUME_KEY,
) -> Dict[str, Any]:
    """Load the checkpoint folder `path` into model_parts and optimizer (collective).

    expect: `run_meta(...)` of this run (at least {"model": model_record(...)}); None skips the model
    check. Returns the partrain.json record; the trainer's JSON is record["extra"]. Raises, on every
    rank alike, ConfigError naming the file (under `key`): CorruptCheckpoint for missing, truncated,
    changed (checksum) or unreadable files, plain ConfigError for a checkpoint of another model.
    """
    path = Path(path)
    rank, world = rank_world()
    record = _agreed(
        lambda: _checked_record(path, expect, key),
        lambda exc: corrupt(path, f"cannot be checked: {first_line(exc)}", key=key),
    )
    loaded = rank_state(model_parts, optimizer, for_save=False)
    # Tensors only: hyperparameters stay the run's own (see module docstring).
    request = {
        MODEL: loaded.state[MODEL],
        OPTIM: {k: v for k, v in loaded.state[OPTIM].items() if k.startswith("state.")},
    }

    def read_tensors() -> None:
        with quiet_single_process():
            dcp.load(
                request, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=not distributed()
            )
        apply_loaded(model_parts, optimizer, loaded)

    _agreed(read_tensors, _blame_data(path, key))
    _agreed(
        lambda: restore_rng(path, rank, world, int(record["world_size"])),
        lambda exc: corrupt(rng_path(path, rank), f"cannot be read: {first_line(exc)}", key=key),
    )
    log.info("loaded checkpoint %s (step %s)", path, record["step"])
    return record


def _incomplete(root: Path) -> List[Problem]:
    """resume=auto passes over step-NNNNNNNN folders that lack partrain.json or .metadata (only
    damage makes one: saves are renamed to that name when complete): warn about each, and return
    them as problems in case nothing usable is left."""
    problems = []
    for path in folders.incomplete_checkpoints(root):
        lacks = [name for name in (folders.RECORD_FILE, folders.METADATA_FILE) if not (path / name).is_file()]
        why = f"lacks {' and '.join(lacks)}, so it is not a complete checkpoint"
        warn_user(f"skipping {path}: it {why}")
        problems.append(corrupt(path, why).problems[0])
    return problems


def _one_line(err: ConfigError) -> str:
    """The problems' rules, each naming its file."""
    return "; ".join(p.rule if str(p.value) in p.rule else f"{p.value} {p.rule}" for p in err.problems)


def load_with_fallback(
    root: Path,
    model_parts: Sequence[nn.Module],
    optimizer: Any,
    expect: Optional[Dict[str, Any]],
    ranks_per_node: int = 1,
) -> Tuple[Optional[Path], Dict[str, Any]]:
    """checkpoint.resume=auto: load the newest complete checkpoint under root; if it cannot be read
    (missing, truncated or changed files, any read failure), warn in one line and try the one before,
    and so on. Returns (path, extra), or (None, {}) when there is nothing to resume. A checkpoint of
    another model is an error, not a fallback; so is having only damaged checkpoints, step folders
    without partrain.json included (starting afresh silently would lose the run): a ConfigError
    listing each one's cause. Collective: first every rank must have found the same checkpoints
    (partrain.checkpoint.resume_agreement; ranks_per_node names the nodes when they differ)."""
    found = tuple(p.name for _, p in folders.complete_checkpoints(root))
    check_same_checkpoints(root, (found, tuple(p.name for p in folders.incomplete_checkpoints(root))), ranks_per_node)
    skipped = _incomplete(root)
    candidates = [p for _, p in reversed(folders.complete_checkpoints(root))]
    if not candidates and not skipped:
        return None, {}
    failures: List[CorruptCheckpoint] = []
    for i, path in enumerate(candidates):
        try:
            record = load_checkpoint(path, model_parts, optimizer, expect)
        except CorruptCheckpoint as exc:
            then = (
                f"falling back to the previous one ({candidates[i + 1].name})"
                if i + 1 < len(candidates)
                else "no older checkpoint is left"
            )
            warn_user(f"checkpoint {path} is unusable, {then}: {_one_line(exc)}")
            failures.append(exc)
            continue
        if failures:
            warn_user(f"resumed from {path} after {len(failures)} unusable newer checkpoint(s)")
        return path, record.get("extra", {})
    problems = [p for exc in failures for p in exc.problems] + skipped
    raise ConfigError(problems)
