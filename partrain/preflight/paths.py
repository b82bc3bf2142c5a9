"""Is a path usable as the folder or file a command will write? Checked before anything is written.

A path is tested where it will be written: the folder itself when it exists, else its nearest
existing ancestor (the folder a `mkdir -p` would start in). The test creates and removes one
empty temporary file there, because permission bits alone do not tell (root ignores them, and a
read-only mount reports EROFS only on a write). Nothing is left behind and no folder is created.
Free space is not predicted: a full disk is reported where the write fails.

Lengths come first (`length_problems`): a name longer than the file system's NAME_MAX (255 bytes
on Linux file systems) or a path longer than PATH_MAX (4096) makes every later stat fail with
ENAMETOOLONG, so such a path is refused on its own, naming the key and the limit.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import List, Union

from partrain.blueprint.config.path_limits import (  # noqa: F401 - re-exported for the preflight
    NAME_MAX,
    PATH_MAX,
    ROOM_BELOW,
    length_problems,
    name_limits,
    nearest_existing,
)
from partrain.blueprint.problems import os_error_problem
from partrain.errors import Problem

PathLike = Union[str, Path]


def _probe_write(key: str, value: PathLike, folder: Path) -> List[Problem]:
    """Create and delete one empty file in `folder`; the OSError, named, if that fails."""
    try:
        fd, name = tempfile.mkstemp(dir=folder, prefix=".partrain-write-test-", suffix=".tmp")
    except OSError as exc:
        exc.filename = None  # the temporary name means nothing to the user; the folder is named
        return [os_error_problem(key, value, exc, f"write in {folder}")]
    os.close(fd)
    os.unlink(name)
    return []


def folder_problems(key: str, value: PathLike) -> List[Problem]:
    """Problems that stop `value` from being (or becoming) a folder this process can write in."""
    too_long = length_problems(key, value, ROOM_BELOW)
    if too_long:
        return too_long
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        return [
            Problem(key, str(value), "is a file; a folder is expected here", "choose a folder path, or move the file")
        ]
    return _creatable(key, value, path)


def _creatable(key: str, value: PathLike, path: Path) -> List[Problem]:
    """Problems that stop the folder `path` (for `value`) from being created, or written in."""
    base = nearest_existing(path)
    if not base.is_dir():
        return [
            Problem(
                key,
                str(value),
                f"{base} is a file, so no folder can be created under it",
                "choose a path whose parents are folders",
            )
        ]
    return _probe_write(key, value, base)


def file_problems(key: str, value: PathLike) -> List[Problem]:
    """Problems that stop `value` from being written as a file (its folder is created if missing)."""
    too_long = length_problems(key, value, room_below=len(".partrain-write-test-XXXXXXXX.tmp"))
    if too_long:
        return too_long
    path = Path(value).expanduser()
    if path.is_dir():
        return [Problem(key, str(value), "is a folder; a file is expected here", f"e.g. {key} {path / 'out'}")]
    if path.exists():
        try:  # opening for writing without truncating tells whether the file can be replaced
            os.close(os.open(path, os.O_WRONLY))
        except OSError as exc:
            return [os_error_problem(key, value, exc, "write the file")]
    return _creatable(key, value, path.parent)
