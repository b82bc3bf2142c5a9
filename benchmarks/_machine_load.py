"""How busy the machine is while a benchmark runs (shared by the benchmark scripts).

Other processes on a 2-core machine make every step time noisier: `ForeignLoad` measures the cores
they used over an interval (machine busy time from /proc/stat minus this process and its children),
`settle` waits for a quiet moment before a run.
"""

from __future__ import annotations

import os
import resource
import time


def _busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all processes), from /proc/stat; nan elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and every finished child (torchrun and its workers included)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


class ForeignLoad:
    """Average cores used by processes other than this benchmark's over the `with` block (`.cores`)."""

    def __enter__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_cpu_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t0
        self.cores = max(0.0, (_busy_cpu_s() - self.busy0) - (_own_cpu_s() - self.own0)) / max(wall, 1e-9)
        return False


def settle(max_wait_s: float, threshold: float = 0.25, window_s: float = 1.0) -> float:
    """Wait (at most max_wait_s) for a window in which other processes use < threshold cores; returns the wait."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s:
        with ForeignLoad() as load:
            time.sleep(window_s)
        if not load.cores >= threshold:  # nan (no /proc/stat) counts as quiet
            break
    return time.perf_counter() - t0
