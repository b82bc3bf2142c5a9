"""One run per folder: an exclusive lock on FOLDER/.lock held for the run's life.

    with hold_folders([run_dir, checkpoint_dir]) as claim:   # FolderBusy if another run holds one
        ...start and follow the run...

`fcntl.flock` on `.lock` (the file holds the holder's PID, host, start time and command line, for
the message a second run prints). The kernel releases a flock when its process ends, however it
ends, so a lock file left by a dead run is simply taken over: there is no stale state to clean.
The file descriptor is not inherited by child processes (Python opens files non-inheritable).
Folders the claim created are removed again when the block fails before the run started
(`claim.created`), so a refused config leaves nothing behind. No torch import.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

LOCK_FILE = ".lock"
ERRORS_DIR = "errors"
PREVIOUS_ERRORS = "previous"


class FolderBusy(Exception):
    """Another process holds the folder's lock."""

    def __init__(self, folder: Path, holder: dict) -> None:
        self.folder = folder
        self.holder = holder
        super().__init__(f"{folder} is in use by {describe_holder(holder)}")


class FolderUnusable(Exception):
    """The folder (or its lock file) cannot be created or opened: a file in the way, no permission..."""

    def __init__(self, folder: Path, error: OSError) -> None:
        self.folder = folder
        self.error = error
        super().__init__(f"{folder}: {error.strerror or error}")


def describe_holder(holder: dict) -> str:
    """'pid 1234 on host, since 2026-11-30 23:58:01' from what a lock file holds."""
    if not holder.get("pid"):
        return "another process (its lock file names none)"
    text = f"pid {holder['pid']}"
    if holder.get("host") and holder["host"] != socket.gethostname():
        text += f" on {holder['host']}"
    if holder.get("since"):
        text += f", since {holder['since']}"
    return text


def read_holder(folder: Path) -> dict:
    """What FOLDER/.lock says about its (last) holder; {} when absent or unreadable."""
    try:
        return json.loads((Path(folder) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return {}


class FolderLock:
    """The lock of one folder, taken without waiting."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.fd: Optional[int] = None

    def acquire(self) -> None:
        """Take the lock and write this process into the lock file; FolderBusy if held elsewhere,
        FolderUnusable if the folder or its lock file cannot be made."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise FolderUnusable(self.folder, err) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise FolderBusy(self.folder, read_holder(self.folder)) from None
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor releases the flock
            self.fd = None


@dataclass
class Claim:
    locks: List[FolderLock] = field(default_factory=list)
    created: List[Path] = field(default_factory=list)
    """Folders that did not exist before the claim (deepest first)."""

    def undo_created(self) -> None:
        """Remove the lock files and the folders this claim created, if nothing else was put there."""
        for lock in self.locks:
            if lock.folder in self.created and [p.name for p in lock.folder.iterdir()] == [LOCK_FILE]:
                (lock.folder / LOCK_FILE).unlink(missing_ok=True)
        for folder in self.created:
            with contextlib.suppress(OSError):
                folder.rmdir()


def _missing(folder: Path) -> List[Path]:
    missing = []
    for p in [folder, *folder.parents]:
        if p.exists():
            break
        missing.append(p)
    return missing


@contextlib.contextmanager
def hold_folders(folders: Sequence[Path]) -> Iterator[Claim]:
    """Lock every folder (created if missing) for the block; FolderBusy (nothing held) if one is taken.

    When the block raises, folders the claim created and that stayed empty are removed again.
    """
    claim = Claim()
    try:
        for folder in dict.fromkeys(Path(f).absolute() for f in folders):
            claim.created += _missing(folder)
            lock = FolderLock(folder)
            lock.acquire()
            claim.locks.append(lock)
        yield claim
    except BaseException:
        for lock in claim.locks:
            lock.release()
        claim.undo_created()
        raise
    for lock in claim.locks:
        lock.release()


def retire_old_errors(run_dir: Path) -> Optional[Path]:
    """Move an earlier run's RUN_DIR/errors/* into errors/previous/ (replacing an older previous),
    so an old rank-K.txt is never reported as the cause of this run's failure. Returns where."""
    errors = Path(run_dir) / ERRORS_DIR
    if not errors.is_dir():
        return None
    old = [p for p in errors.iterdir() if p.name != PREVIOUS_ERRORS]
    if not old:
        return None
    previous = errors / PREVIOUS_ERRORS
    shutil.rmtree(previous, ignore_errors=True)
    previous.mkdir()
    for p in old:
        os.replace(p, previous / p.name)
    return previous
