"""Load a checkpoint into any layout: check partrain.json, then DCP reshards into this rank's pieces.

Checks come before any tensor is touched, and read only shared files, so every rank reaches the
same verdict: partrain.json parses and is ours; the model is the one the run builds (arch and
every size-determining config value); every file it lists exists with its recorded size; DCP's
`.metadata` unpickles with the allow-list. Then `dcp.load` reads each rank's pieces straight into
its parameters and optimizer state (a failure there is gathered by DCP and raised on every rank).

Optimizer hyperparameters (lr, betas, eps, weight decay) are not taken from the checkpoint: the
run's config decides them (the schedule sets lr every step anyway); exp_avg, exp_avg_sq and step
are restored.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import torch.distributed.checkpoint as dcp
from torch import nn

from partrain.checkpoint import folders
from partrain.checkpoint.dist_util import distributed, quiet_single_process, rank_world
from partrain.checkpoint.record import (
    CorruptCheckpoint,
    check_files,
    check_model,
    corrupt,
    read_record,
)
from partrain.checkpoint.rng import restore_rng, rng_path
from partrain.checkpoint.safe_io import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    read_metadata,
)
from partrain.checkpoint.state import MODEL, OPTIM, apply_loaded, rank_state
from partrain.errors import ConfigError

log = logging.getLogger("partrain")

_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "CheckpointException")):
            return line[:300]
    return type(exc).__name__


def load_checkpoint(
    path: Path, model_parts: Sequence[nn.Module], optimizer: Any, expect: Optional[Dict[str, Any]]
) -> Dict[str, Any]:
    """Load the checkpoint folder `path` into model_parts and optimizer (collective).

    expect: `run_meta(...)` of this run (at least {"model": model_record(...)}); None skips the model
    check. Returns the partrain.json record; the trainer's JSON is record["extra"]. Raises
    ConfigError naming the file: CorruptCheckpoint for missing/truncated/unreadable files, plain
    ConfigError for a checkpoint of another model.
    """
    path = Path(path)
    record = read_record(path)
    check_model(record, expect, path / folders.RECORD_FILE)
    check_files(path, record)
    try:
        read_metadata(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read the index means the same to the user
        raise corrupt(path / folders.METADATA_FILE, f"cannot be read: {_first_line(exc)}") from exc

    loaded = rank_state(model_parts, optimizer, for_save=False)
    # Tensors only: hyperparameters stay the run's own (see module docstring).
    request = {
        MODEL: loaded.state[MODEL],
        OPTIM: {k: v for k, v in loaded.state[OPTIM].items() if k.startswith("state.")},
    }
    try:
        with quiet_single_process():
            dcp.load(
                request, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=not distributed()
            )
    except Exception as exc:  # noqa: BLE001 - DCP wraps every rank's failure in CheckpointException
        text = str(exc)
        named = _DATA_FILE.search(text)
        where = path / named.group(0) if named else path
        missing = re.search(r"Missing key in checkpoint state_dict: ([^\s.]+\.[^\s]+)", text)
        if missing:
            raise corrupt(
                where, f"lacks {missing.group(1)}, which this run needs (saved by another kind of run?)"
            ) from exc
        raise corrupt(where, f"cannot be loaded: {_first_line(exc)}") from exc
    apply_loaded(model_parts, optimizer, loaded)

    rank, world = rank_world()
    try:
        restore_rng(path, rank, world, int(record["world_size"]))
    except Exception as exc:  # noqa: BLE001
        raise corrupt(rng_path(path, rank), f"cannot be read: {_first_line(exc)}") from exc
    log.info("loaded checkpoint %s (step %s)", path, record["step"])
    return record


def load_with_fallback(
    root: Path, model_parts: Sequence[nn.Module], optimizer: Any, expect: Optional[Dict[str, Any]]
) -> Tuple[Optional[Path], Dict[str, Any]]:
    """checkpoint.resume=auto: load the newest complete checkpoint under root; if its files are
    damaged, warn and try the one before, and so on. Returns (path, extra), or (None, {}) when
    there is nothing to resume. A checkpoint of another model is an error, not a fallback; so is
    having only damaged checkpoints (starting afresh silently would lose the run)."""
    candidates = [p for _, p in reversed(folders.complete_checkpoints(root))]
    if not candidates:
        return None, {}
    failures = []
    for path in candidates:
        try:
            record = load_checkpoint(path, model_parts, optimizer, expect)
        except CorruptCheckpoint as exc:
            log.warning("checkpoint %s is unusable, falling back to the previous one: %s", path, exc)
            failures.append(exc)
            continue
        if failures:
            log.warning("resumed from %s after %d unusable newer checkpoint(s)", path, len(failures))
        return path, record.get("extra", {})
    problems = [p for exc in failures for p in exc.problems]
    raise ConfigError(problems)
