"""Checkpoint folders on disk: names, what counts as complete, resume lookup, pruning.

    <root>/step-00000010.partial/   being written (or left by a crash): never resumed from
    <root>/step-00000010/           complete: renamed from .partial after every rank finished
        partrain.json               what was saved (step, layout, model, extra, file sizes and SHA-256)
        .metadata                   DCP's index
        __0_0.distcp ...            DCP's tensor data, one file per writing rank (and thread)
        rng/rank-0.pt ...           per-rank RNG state

A folder is complete when its name is exactly `step-<8+ digits>` and it holds both `partrain.json`
and `.metadata`. The rename is the commit point, so a crash at any moment leaves either a complete
checkpoint or a folder that no lookup treats as one. Pure Python (no torch).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import List, Optional, Tuple

from partrain.blueprint.config import saving
from partrain.data.atomic import fsync_dir  # one implementation of durable renames
from partrain.errors import ConfigError, Problem

RECORD_FILE = "partrain.json"
METADATA_FILE = ".metadata"
PARTIAL_SUFFIX = ".partial"
_STEP_NAME = re.compile(r"^step-(\d{8,})$")


def step_name(step: int) -> str:
    return saving.step_name(step)


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / step_name(step)


def partial_dir(root: Path, step: int) -> Path:
    return Path(root) / (step_name(step) + PARTIAL_SUFFIX)


def step_of(path: Path) -> Optional[int]:
    """The step in a complete checkpoint's folder name, or None for any other name."""
    match = _STEP_NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (
        step_of(path) is not None
        and path.is_dir()
        and (path / RECORD_FILE).is_file()
        and (path / METADATA_FILE).is_file()
    )


def complete_checkpoints(root: Path) -> List[Tuple[int, Path]]:
    """(step, folder) of every complete checkpoint under root, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(step_of(p), p) for p in root.iterdir() if is_complete(p)]
    return sorted((s, p) for s, p in found if s is not None)


def incomplete_checkpoints(root: Path) -> List[Path]:
    """Folders under root named like a checkpoint (step-NNNNNNNN) that are not complete ones."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if step_of(p) is not None and p.is_dir() and not is_complete(p))


def _resume_problem(value: str, rule: str, fix: str) -> ConfigError:
    return ConfigError(Problem("checkpoint.resume", value, rule, fix))


def find_resume(root: Path, resume: str) -> Optional[Path]:
    """What `checkpoint.resume` points at: None ('none', or 'auto' with nothing saved yet), the
    newest complete checkpoint under root ('auto'), or the given checkpoint folder (a path).

    A path that is not a complete checkpoint is a ConfigError (key checkpoint.resume) saying why.
    """
    if resume == "none":
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        return found[-1][1] if found else None
    if not resume:
        raise _resume_problem(resume, "must be none, auto or the path of a checkpoint folder", "checkpoint.resume=auto")
    path = Path(resume).expanduser()
    newest = complete_checkpoints(path.parent if path.name.endswith(PARTIAL_SUFFIX) else path)
    hint = f"checkpoint.resume={newest[-1][1]}" if newest else "checkpoint.resume=auto, or none to start afresh"
    if not path.exists():
        raise _resume_problem(
            resume, "no such folder", "checkpoint.resume=auto (the newest checkpoint in checkpoint.dir)"
        )
    if path.name.endswith(PARTIAL_SUFFIX):
        raise _resume_problem(
            resume, "this is an unfinished save (the run stopped while writing it), not a checkpoint", hint
        )
    if not path.is_dir():
        raise _resume_problem(resume, "is a file; a checkpoint is a folder named step-NNNNNNNN", hint)
    if step_of(path) is None and newest:
        raise _resume_problem(resume, f"is a folder of checkpoints ({len(newest)} complete), not one checkpoint", hint)
    if not (path / RECORD_FILE).is_file():
        raise _resume_problem(resume, f"{path / RECORD_FILE} is missing: not a complete partrain checkpoint", hint)
    if not (path / METADATA_FILE).is_file():
        raise _resume_problem(
            resume, f"{path / METADATA_FILE} (DCP's index) is missing: not a complete checkpoint", hint
        )
    if step_of(path) is None:
        raise _resume_problem(
            resume, "a checkpoint folder is named step-NNNNNNNN (renamed copies are not resumed)", hint
        )
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write text to path via a temporary file, fsync, rename: readers see all of it or nothing."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def remove_quietly(path: Path) -> None:
    """Delete a checkpoint folder so that it never looks complete half-way: rename it out of the
    step-NNNNNNNN pattern first, then remove the tree."""
    path = Path(path)
    if not path.exists():
        return
    doomed = path.with_name(path.name + ".deleting")
    if step_of(path) is not None:
        if doomed.exists():
            shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        fsync_dir(path.parent)
        path = doomed
    shutil.rmtree(path, ignore_errors=True)


def commit(partial: Path, final: Path) -> None:
    """Rename a finished .partial folder to its final name (replacing an older save of that step)."""
    fsync_dir(partial)
    if final.exists():
        remove_quietly(final)
    os.replace(partial, final)
    fsync_dir(final.parent)


def clear_leftovers(root: Path) -> None:
    """Remove folders of interrupted saves and deletions (*.partial, *.deleting)."""
    root = Path(root)
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (p.name.endswith(PARTIAL_SUFFIX) or p.name.endswith(".deleting")):
                shutil.rmtree(p, ignore_errors=True)


def prune(root: Path, keep_last: int) -> List[Path]:
    """Delete all but the newest keep_last complete checkpoints (0 keeps all); returns what went."""
    if keep_last <= 0:
        return []
    found = complete_checkpoints(root)
    doomed = [p for _, p in found[:-keep_last]]
    for p in doomed:
        remove_quietly(p)
    return doomed
