"""Crash-safe file writes: write to a private temporary file, flush it to disk, then rename.

``os.replace`` is atomic on POSIX and Windows, so a reader sees either the old file or the
complete new one, never a half-written file. Temporary names are unique per writer, so two
processes filling the same cache entry at once do not write into each other's files.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def temp_path(final: Path) -> Path:
    """A new, empty, uniquely named hidden file next to ``final`` (same filesystem, so rename works)."""
    fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".tmp")
    os.close(fd)
    return Path(name)


def fsync_file(path: Path) -> None:
    """Force the file's data to disk, so a rename after a power loss never points at lost data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path) -> None:
    """Flush ``tmp`` and atomically move it to ``final``."""
    fsync_file(tmp)
    os.replace(tmp, final)


def write_json(final: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``final`` atomically."""
    tmp = temp_path(final)
    try:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        commit(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def fsync_dir(folder: Path) -> None:
    """Make the renames inside ``folder`` durable (best effort: not every OS can open a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
