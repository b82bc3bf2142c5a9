"""Collect every problem of a config before reporting (one ConfigError lists them all)."""

from __future__ import annotations

import errno
import os
import re
from typing import List, Optional

from partrain.errors import Problem


class ProblemCollector:
    def __init__(self) -> None:
        self.problems: List[Problem] = []

    def add(self, key: str, value, rule: str, fix: str = "") -> None:
        self.problems.append(Problem(key, value, rule, fix))

    def check(self, ok: bool, key: str, value, rule: str, fix: str = "") -> bool:
        if not ok:
            self.add(key, value, rule, fix)
        return ok


_OS_ERROR_WORDS = {
    errno.EACCES: ("permission denied", "choose a path you can write to, or fix its permissions"),
    errno.EPERM: ("operation not permitted", "choose a path you can write to, or fix its permissions"),
    errno.EROFS: ("read-only file system", "choose a path on a writable file system"),
    errno.ENOSPC: ("no space left on device", "free some space there, or choose a path on another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free some space there, or choose a path on another disk"),
    errno.ENOTDIR: ("a part of the path is a file, not a folder", "choose a path whose parents are folders"),
    errno.EISDIR: ("is a folder, a file is expected", "name a file, not a folder"),
    errno.ENOENT: ("no such file or folder", "create the folder first, or choose an existing one"),
}


def os_error_words(exc: OSError) -> str:
    """The failure in plain words, with the path when the error names one (no errno numbers)."""
    words = _OS_ERROR_WORDS.get(exc.errno, (exc.strerror or str(exc), ""))[0]
    return f"{words}: {exc.filename}" if exc.filename else words


def os_error_problem(key: str, value, exc: OSError, doing: str, fix: str = "") -> Problem:
    """A Problem for an OSError met while `doing` something with the path `value` (EACCES, EROFS and
    ENOSPC are named as such)."""
    default_fix = _OS_ERROR_WORDS.get(exc.errno, ("", f"set {key} to a writable path"))[1]
    return Problem(key, str(value), f"cannot {doing}: {os_error_words(exc)}", fix or default_fix)


_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|os error (\d+)")


def storage_error_words(exc: BaseException) -> Optional[str]:
    """os_error_words for an OSError, also when a library wrapped it in its own exception (torch's
    CheckpointException, safetensors' SafetensorError keep only the text): None if none is found."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return os_error_words(exc)
        match = _ERRNO_IN_TEXT.search(str(exc))
        if match:
            code = int(match.group(1) or match.group(2))
            return _OS_ERROR_WORDS.get(code, (os.strerror(code).lower(), ""))[0]
        exc = exc.__cause__ or exc.__context__
    return None
