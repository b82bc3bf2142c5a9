"""Path lengths the file system allows, checked before anything looks at a path.

A name longer than the file system's NAME_MAX (255 bytes on Linux file systems) or a path longer
than PATH_MAX (4096) makes every stat fail with ENAMETOOLONG, so the run's path keys are checked
first and alone (`path_key_problems`, called by `partrain.blueprint.validate`): such a run is refused
(exit 2) naming the key and the limit, with no other check attempted on it. Pure Python (os only).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import List, Tuple, Union

from partrain.errors import Problem

PathLike = Union[str, Path]

DEFAULT_RUNS = Path("runs")
"""Where run folders go when train.run_dir is unset (see partrain.launch.default_run_dir)."""

NAME_MAX = 255
"""Bytes per file or folder name when the file system does not say (os.pathconf): Linux's limit."""
PATH_MAX = 4096
"""Bytes per whole path when the file system does not say: Linux's limit."""
ROOM_BELOW = 100
"""Bytes kept free under a folder partrain writes in, for what it writes there (checkpoints/
step-00000042.partial/__0_0.distcp, a cache entry's .train.bin.XXXXXXXX.tmp, logs/torchrun.log)."""


def nearest_existing(path: Path) -> Path:
    """`path` itself if it exists, else its closest existing ancestor (the current folder at worst)."""
    for candidate in (path, *path.parents):
        if _exists(candidate):
            return candidate
    return Path.cwd()


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # ENAMETOOLONG and the like: nothing can exist there
        return False


def name_limits(path: PathLike) -> Tuple[int, int]:
    """(NAME_MAX, PATH_MAX) of the file system `path` is (or would be) on."""
    base = str(nearest_existing(Path(os.path.abspath(Path(path).expanduser()))))
    limits = []
    for name, default in (("PC_NAME_MAX", NAME_MAX), ("PC_PATH_MAX", PATH_MAX)):
        try:
            limits.append(int(os.pathconf(base, name)) or default)
        except (AttributeError, ValueError, OSError):  # no pathconf (Windows), or the name is unknown here
            limits.append(default)
    return limits[0], limits[1]


def length_problems(key: str, value: PathLike, room_below: int = 0) -> List[Problem]:
    """A name in `value` over NAME_MAX, or the whole absolute path (plus `room_below` for what is
    written under it) over PATH_MAX: one problem each, naming the limit."""
    path = Path(value).expanduser()
    name_max, path_max = name_limits(path)
    problems = []
    too_long = [part for part in path.parts if len(os.fsencode(part)) > name_max]
    if too_long:
        size = len(os.fsencode(too_long[0]))
        problems.append(
            Problem(
                key,
                str(value),
                f"holds a name of {size} bytes ({too_long[0][:24]}...); the file system allows at most "
                f"{name_max} bytes per file or folder name (NAME_MAX)",
                f"shorten that name to {name_max} bytes or fewer",
            )
        )
    total = len(os.fsencode(os.path.abspath(path)))
    if total + room_below > path_max:
        room = f" plus {room_below} for what partrain writes inside" if room_below else ""
        problems.append(
            Problem(
                key,
                str(value),
                f"is {total} bytes long as an absolute path{room}; paths may be at most {path_max} bytes (PATH_MAX)",
                f"choose a path of at most {path_max - room_below} bytes",
            )
        )
    return problems


WRITTEN_FOLDERS = ("train.run_dir", "checkpoint.dir", "data.cache_dir")
"""Folders partrain writes in: room is kept under them for what it writes there."""
READ_PATHS = (
    "model.pretrained",
    "data.source",
    "data.tokenizer",
    "checkpoint.resume",
    "cluster.comm_profile",
    "cluster.compute_profile",
)
"""Keys that may name a local file or folder partrain reads (or a keyword / Hub id, always short)."""
RUN_ID_FORM = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"


def path_key_problems(run, default_runs: Path) -> List[Problem]:
    """Every over-long path among the run's path keys, and a train.run_id that is not one folder name."""
    problems: List[Problem] = []
    for key in WRITTEN_FOLDERS:
        value = _value(run, key)
        if value:
            problems += length_problems(key, value, ROOM_BELOW)
    for key in READ_PATHS:
        value = _value(run, key)
        if value:
            problems += length_problems(key, value)
    run_id = run.train.run_id
    if run_id and not re.fullmatch(RUN_ID_FORM, run_id):
        problems.append(
            Problem(
                "train.run_id",
                run_id,
                "must be one folder name: letters, digits and _ . - (not starting with . or -)",
                "e.g. train.run_id=20250101-120000, or train.run_dir=PATH for a folder anywhere",
            )
        )
    elif run_id and not run.train.run_dir:
        name = run.recipe or run.model.name or "default"
        problems += length_problems("train.run_id", default_runs / name / run_id, ROOM_BELOW)
    return problems


def _value(run, key: str) -> str:
    group, field = key.split(".")
    return str(getattr(getattr(run, group), field) or "")
