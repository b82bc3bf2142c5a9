"""Any failure of reading or writing a checkpoint, told in one line.

torch's `CheckpointException` (what DCP raises on every rank when any rank failed) derives from
`BaseException` and carries each rank's exception with its traceback in its text; an `OSError`
from a full disk ends up several wrappers deep. The helpers here find the cause and name it:
"no space left on device writing <dir>: free space or set checkpoint.dir elsewhere".
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Iterator, Optional

_NAMED_ERRNO = {
    errno.ENOSPC: ("no space left on device", "free space or set checkpoint.dir elsewhere"),
    errno.EDQUOT: ("disk quota exceeded", "free space or set checkpoint.dir elsewhere"),
    errno.EACCES: ("permission denied", "make the folder writable or set checkpoint.dir elsewhere"),
    errno.EPERM: ("operation not permitted", "make the folder writable or set checkpoint.dir elsewhere"),
    errno.EROFS: ("read-only file system", "set checkpoint.dir to a folder on a writable file system"),
}
"""errno -> (what happened, what to do), for the failures a user can fix by themselves."""


class SaveFailed(RuntimeError):
    """A checkpoint could not be written; the message is one line naming the cause and the folder."""


def is_failure(exc: BaseException) -> bool:
    """True for everything but the interpreter's own stop requests (Ctrl-C, sys.exit): torch's
    CheckpointException is a BaseException, so `except Exception` alone would let it through."""
    return not isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit))


def causes(exc: BaseException) -> Iterator[BaseException]:
    """exc, then what it wraps: DCP's per-rank failures and every __cause__ / __context__, breadth first."""
    seen, queue = set(), [exc]
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            queue += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
        queue += [e.__cause__, e.__context__]


def _is_wrapper(exc: BaseException) -> bool:
    return type(exc).__name__ == "CheckpointException" and bool(getattr(exc, "failures", None))


def first_line(exc: BaseException) -> str:
    """The first meaningful line of the innermost failure (DCP's wrapper skipped), at most 300 chars."""
    inner = next((e for e in causes(exc) if not _is_wrapper(e)), exc)
    for line in str(inner).splitlines():
        line = line.strip()
        if line and not line.startswith(("Traceback", "File ", "CheckpointException")):
            name = type(inner).__name__
            return line[:300] if name in ("ConfigError", "CorruptCheckpoint") else f"{name}: {line[:300]}"
    return type(inner).__name__


def os_error(exc: BaseException) -> Optional[OSError]:
    """The first OSError with an errno among exc and what it wraps."""
    return next((e for e in causes(exc) if isinstance(e, OSError) and e.errno), None)


LOW_SPACE_BYTES = 1 << 20
"""Free space below which a write failure that lost its errno is taken for a full disk."""


def diagnose(folder: Path) -> Optional[int]:
    """The errno a failed write most likely met, when the error itself lost it: torch's zip writer
    reports a full disk as "[enforce fail at inline_container.cc] unexpected pos N vs M". Looks at
    the file system of folder (or its nearest existing parent): read-only, not writable, or
    (almost) no free space. None when none of these holds."""
    probe = Path(folder)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        fs = os.statvfs(probe)
    except OSError:
        return None
    if fs.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if not os.access(probe, os.W_OK):
        return errno.EACCES
    if fs.f_bavail * fs.f_frsize < LOW_SPACE_BYTES:
        return errno.ENOSPC
    return None


def save_failure(exc: BaseException, folder: Path) -> str:
    """One line for a failed save of `folder`: the errno's meaning and a fix, or the first line of
    the cause. Call it before the unfinished folder is removed (that frees the space it looks at)."""
    err = os_error(exc)
    code = err.errno if err is not None else diagnose(folder)
    if code in _NAMED_ERRNO:
        what, fix = _NAMED_ERRNO[code]
        return f"{what} writing {folder}: {fix}"
    if err is not None:
        return f"cannot write {folder}: {os.strerror(err.errno)} ({err.filename or 'no file name'})"
    return f"saving {folder} failed: {first_line(exc)}"
