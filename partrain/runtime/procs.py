"""Processes on this machine as Linux shows them in /proc, and the parent-death signal.

Used by the launcher (find torchrun's workers to forward a signal to, find workers still running
in a run folder) and by the workers (die with their parent). Elsewhere than Linux the lookups
answer "nothing found" and the parent-death signal is not set (the workers' heartbeat, which
watches os.getppid(), still notices a dead parent). No torch import.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import List, Optional

_PR_SET_PDEATHSIG = 1
_PROC = Path("/proc")


def set_parent_death_signal(signum: int) -> bool:
    """Have the kernel send `signum` to this process when the thread that started it exits.

    Linux prctl(PR_SET_PDEATHSIG); kept across exec. Returns False where it is not available.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _stat_fields(pid: int) -> Optional[List[str]]:
    """/proc/PID/stat after the command name: [state, ppid, pgrp, ...], or None if gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def is_running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie has exited; its parent has not reaped it)."""
    fields = _stat_fields(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not _PROC.is_dir()  # no /proc: os.kill is all we know
    return fields[0] not in ("Z", "X")


def blocks_signal(pid: int, signum: int) -> bool:
    """Whether the main thread of pid blocks `signum` (/proc/PID/status SigBlk): a partrain worker
    whose StopWatch is running (it receives stop signals itself) rather than one still starting."""
    try:
        for line in (_PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("SigBlk:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _pids() -> List[int]:
    try:
        return [int(p.name) for p in _PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return []


def children_of(pid: int) -> List[int]:
    """Running processes whose parent is `pid`."""
    found = []
    for child in _pids():
        fields = _stat_fields(child)
        if fields is not None and fields[1] == str(pid) and fields[0] not in ("Z", "X"):
            found.append(child)
    return sorted(found)


def _cmdline(pid: int) -> List[str]:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def workers_of_run(run_dir: Path) -> List[int]:
    """Running processes started as `... -m partrain.worker RUN_DIR` for this run folder (workers and
    the torchrun that started them), the folder compared after resolving against their cwd."""
    target = Path(run_dir).resolve()
    found = []
    for pid in _pids():
        args = _cmdline(pid)
        if "partrain.worker" not in args or pid == os.getpid():
            continue
        index = args.index("partrain.worker")
        if index + 1 >= len(args):
            continue
        try:
            cwd = os.readlink(_PROC / str(pid) / "cwd")
        except OSError:
            continue
        if (Path(cwd) / args[index + 1]).resolve() == target and is_running(pid):
            found.append(pid)
    return sorted(found)
