"""Reading a JSON file the planner depends on (measured profiles): one error per way it can be
wrong, and the parsed, checked content cached until the file changes."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable, Type


def load_checked_json(path: Path | str, error: Type[Exception], check: Callable[[object], dict]) -> dict:
    """`check(json.load(path))`; `error(reason)` if the file is missing, not a file, unreadable or not JSON."""
    p = Path(path).expanduser()
    try:
        stat = p.stat()
    except OSError:
        raise error("no such file") from None
    if not p.is_file():
        raise error("is not a file")
    return _load(str(p.resolve()), stat.st_mtime_ns, stat.st_size, error, check)


@functools.lru_cache(maxsize=32)
def _load(path: str, mtime_ns: int, size: int, error: Type[Exception], check: Callable[[object], dict]) -> dict:
    # Keyed by mtime and size: re-read when the file changes, not on every planner call.
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot be read ({exc.__class__.__name__})") from None
    except json.JSONDecodeError as exc:
        raise error(f"is not JSON ({exc.msg} at line {exc.lineno})") from None
    return check(data)
