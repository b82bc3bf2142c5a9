"""This process's resident memory, as Linux reports it (what the OS charges and an OOM kill counts)."""

from __future__ import annotations

import os
import resource
from typing import Dict, Tuple


def current_rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; elsewhere the peak, the best there is)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: VmHWM, the high-water mark of its own address space.

    Not getrusage's ru_maxrss: Linux folds the pre-exec address space into it, so a process
    started by fork + exec from a big parent (torchrun's agent) reports the parent's size as its own peak."""
    return _status_bytes("VmHWM").get("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes() -> Tuple[int, int]:
    """(anonymous, file-backed incl. shared memory) resident bytes now; (0, 0) where /proc does not say."""
    found = _status_bytes("RssAnon", "RssFile", "RssShmem")
    return found.get("RssAnon", 0), found.get("RssFile", 0) + found.get("RssShmem", 0)


def _status_bytes(*keys: str) -> Dict[str, int]:
    """The named kB fields of /proc/self/status, in bytes ({} where it cannot be read)."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in keys:
                    found[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return found
