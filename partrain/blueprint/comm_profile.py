"""The cluster communication profile: a JSON file `partrain bench comm` writes and the planner reads.

Pure Python (no torch): the planner and the config validator load profiles, and `partrain plan`
must stay fast and torch-free.

Format (version 1; bandwidths in GB/s = 10**9 bytes/s, as the cluster config states link speeds)::

    {
      "format": "partrain-comm-profile", "version": 1,
      "cluster": {"name", "nodes", "devices_per_node", "backend", "device"},
      "torch": "2.13.0+cpu", "hostname": "...", "date": "2025-01-01T12:00:00+00:00",
      "settings": {"dtype": "float32", "sizes": [bytes, ...], "iters": 20, "warmup": 5},
      "links": {                              # one entry per link class measured
        "intra": {                            # the ranks of one node (every node at once)
          "group_size": 2, "groups": [[0, 1]],
          "ops": {
            "all_reduce": {"supported": true, "torch_op": "all_reduce", "bus_factor": 1.0,
                           "results": [{"bytes", "time_s", "algbw", "busbw", "cpu_s"}, ...]},
            "all_gather": ..., "reduce_scatter": ..., "all_to_all": ..., "send_recv": ...
          }},
        "inter": {...},                       # one rank per node (only when nodes > 1)
        "world": {...}                        # every rank (only when nodes > 1; informative)
      },
      "summary": {"intra": {"all_reduce": busbw, ...}, "inter": {...}},   # GB/s
      "summary_bytes": {"intra": {"all_reduce": bytes, ...}, ...}
    }

Conventions are nccl-tests' (PERFORMANCE.md there): time is the slowest rank's mean over the timed
iterations; algbw = bytes / time; busbw = algbw x bus factor, with factor 2(n-1)/n for all-reduce,
(n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for send/recv. For all-gather and
reduce-scatter "bytes" is the full (gathered) size, for all-to-all what one rank sends, for
send/recv what one rank sends (every rank sends to the next and receives from the previous).
Bus bandwidth is what the planner's model needs: comm.py divides exactly these ring volumes
(factor x bytes) by a link bandwidth, so volume / busbw reproduces the measured time.

"cpu_s" (optional) is the ranks' mean CPU seconds per call, the whole process's (the backend's threads
too): on a CPU cluster whose ranks share cores, the planner charges every collective call that CPU
(planner/cpu_host.py). Profiles written before this version may hold a "busy" block (a busy-node
measurement the planner no longer reads): it is ignored.

The summary keeps, per link class and op, the busbw at the largest message measured: the planner
ignores latency (large messages), so the small sizes are there for people, not for the planner.
An op the backend lacks is recorded with "supported": false and no results (never emulated); the
planner then times it at that link's measured all-reduce bandwidth.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple

from partrain.blueprint.json_file import load_checked_json

FORMAT = "partrain-comm-profile"
VERSION = 1
OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""Ops measured, in planner vocabulary (comm.py); torch calls: all_reduce, all_gather_single,
reduce_scatter_single, all_to_all_single, batch_isend_irecv (see bench/comm.py)."""
PLANNER_LINKS = ("intra", "inter")
"""Link classes the planner distinguishes (a group inside a node / a group spanning nodes)."""
GB = 1e9
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


class ProfileError(ValueError):
    """A profile that cannot be used; the message is the rule it breaks, in plain words."""


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor for `op` over `n` ranks."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "send_recv":
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def parse_size(text: str) -> int:
    """'64K' -> 65536 (K, M, G are powers of 1024, as nccl-tests' -b/-e take them); ValueError if not > 0."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(i?B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size (a whole number of bytes, optionally with K, M or G)")
    value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ValueError(f"{text!r} is not a positive size")
    return value


def parse_sizes(text: str) -> List[int]:
    """'1K,64K,1M' -> sorted distinct byte counts; ValueError naming the first bad entry."""
    parts = [p for p in text.split(",")]
    if not text.strip() or any(not p.strip() for p in parts):
        raise ValueError(f"{text!r} has an empty entry")
    return sorted({parse_size(p) for p in parts})


def human_bytes(n: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{int(n // scale)}{unit}"
    return f"{int(n)}"


def result(nbytes: int, time_s: float, factor: float, cpu_s: Optional[float] = None) -> dict:
    """One row of a results list, nccl-tests style (bandwidths in GB/s); `cpu_s`: the ranks' mean
    CPU seconds per call (the whole process, the backend's threads too), when measured."""
    algbw = nbytes / time_s / GB
    row = {"bytes": int(nbytes), "time_s": time_s, "algbw": algbw, "busbw": algbw * factor}
    if cpu_s is not None:
        row["cpu_s"] = cpu_s
    return row


def ring_steps(op: str, n: int) -> int:
    """Messages one rank sends and receives in a call over n ranks: 2(n - 1) for a ring all-reduce
    (reduce-scatter then all-gather), n - 1 for the other collectives, 1 for a send/recv pair."""
    if op == "send_recv":
        return 1
    return max(1, (2 if op == "all_reduce" else 1) * (n - 1))


def summarize(profile: dict) -> dict:
    """Fill "summary" and "summary_bytes" from "links": busbw at the largest message of each op."""
    summary: Dict[str, Dict[str, float]] = {}
    sizes: Dict[str, Dict[str, int]] = {}
    for link, entry in profile.get("links", {}).items():
        for op, rec in entry.get("ops", {}).items():
            rows = rec.get("results") or []
            if not rec.get("supported", True) or not rows:
                continue
            top = max(rows, key=lambda r: r["bytes"])
            summary.setdefault(link, {})[op] = top["busbw"]
            sizes.setdefault(link, {})[op] = top["bytes"]
    profile["summary"], profile["summary_bytes"] = summary, sizes
    return profile


def make_profile(
    cluster: Mapping, links: Mapping, settings: Mapping, torch_version: str = "", hostname: str = "", date: str = ""
) -> dict:
    """A complete profile dict (summary computed)."""
    profile = {
        "format": FORMAT,
        "version": VERSION,
        "cluster": {k: cluster[k] for k in ("name", "nodes", "devices_per_node", "backend", "device")},
        "torch": torch_version,
        "hostname": hostname,
        "date": date,
        "settings": dict(settings),
        "units": "bytes; seconds; algbw and busbw in GB/s (10**9 bytes/s)",
        "links": dict(links),
    }
    return summarize(profile)


def write_profile(path: Path | str, profile: dict) -> Path:
    """Write atomically (temporary file, then rename), so a reader never sees half a profile."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_profile(data) -> dict:
    """The profile if it is one this partrain can use; ProfileError (the broken rule) otherwise."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ProfileError(f'is not a partrain communication profile (no "format": "{FORMAT}")')
    if data.get("version") != VERSION:
        raise ProfileError(f"has profile format version {data.get('version')!r}; this partrain reads version {VERSION}")
    cluster = data.get("cluster")
    if not isinstance(cluster, dict) or not all(isinstance(cluster.get(k), str) for k in ("backend", "device")):
        raise ProfileError("lacks the cluster it was measured on (cluster.backend, cluster.device)")
    summary = data.get("summary")
    if not isinstance(summary, dict):
        raise ProfileError('has no "summary" of bus bandwidths')
    usable = 0
    for link, ops in summary.items():
        if not isinstance(ops, dict):
            raise ProfileError(f"summary.{link} is not a table of op -> GB/s")
        for op, value in ops.items():
            if not _positive(value):
                raise ProfileError(f"summary.{link}.{op} = {value!r} is not a positive finite bandwidth")
            usable += link in PLANNER_LINKS and op in OPS
    if not usable:
        raise ProfileError("measures no intra- or inter-node bandwidth the planner can use")
    return data


def load_profile(path: Path | str) -> dict:
    """Read and check a profile; ProfileError says what is wrong (missing, unreadable, not a profile)."""
    return load_checked_json(path, ProfileError, check_profile)


def planner_bandwidths(path: Path | str) -> Tuple[Tuple[str, float], ...]:
    """(("intra/all_reduce", bytes/s), ...) for the planner's ClusterSpec: measured bus bandwidths
    of the link classes it knows, as a hashable tuple (ClusterSpec is a cache key)."""
    summary = load_profile(path)["summary"]
    return tuple(
        sorted(
            (f"{link}/{op}", float(gbps) * GB)
            for link in PLANNER_LINKS
            for op, gbps in summary.get(link, {}).items()
            if op in OPS
        )
    )


def planner_latencies(path: Path | str) -> Tuple[Tuple[str, float], ...]:
    """(("intra/all_reduce", seconds), ...): the fixed cost of each op on each link class the planner
    knows, per ring step: what the smallest measured message took beyond its bytes at the bus
    bandwidth of the largest (the alpha of an alpha-beta model; 0 when it took no longer), divided by
    the n - 1 steps a collective over the measured group of n ranks takes (a send/recv is one step).
    The planner multiplies it back by its own groups' steps."""
    profile = load_profile(path)
    out = []
    for link in PLANNER_LINKS:
        entry = profile["links"].get(link, {})
        ops, steps = entry.get("ops", {}), max(1, int(entry.get("group_size", 2)) - 1)
        for op in OPS:
            rows = [r for r in ops.get(op, {}).get("results", []) if r.get("time_s")]
            busbw = profile["summary"].get(link, {}).get(op)
            if not rows or not busbw:
                continue
            small = min(rows, key=lambda r: r["bytes"])
            factor = ops[op].get("bus_factor", 1.0)
            alpha = max(0.0, small["time_s"] - small["bytes"] * factor / (busbw * GB))
            out.append((f"{link}/{op}", alpha if op == "send_recv" else alpha / steps))
    return tuple(sorted(out))


def planner_cpu_costs(path: Path | str) -> Tuple[Tuple[str, float], ...]:
    """(("intra/all_reduce", CPU seconds), ...): what one ring step of each op costs a CPU rank's
    cores: the smallest message's measured CPU seconds per call (every rank of the node calling at
    once, as in training) over the call's `ring_steps`. Only for profiles measured on CPU devices
    (elsewhere the host's CPU is not the device's) and only rows that carry "cpu_s" (profiles
    before it have none: empty)."""
    profile = load_profile(path)
    if profile["cluster"].get("device") != "cpu":
        return ()
    out = []
    for link in PLANNER_LINKS:
        entry = (profile.get("links") or {}).get(link, {})
        n = int(entry.get("group_size", 2))
        for op, rec in entry.get("ops", {}).items():
            rows = [r for r in rec.get("results", []) if _positive(r.get("cpu_s"))]
            if op in OPS and rows:
                small = min(rows, key=lambda r: r["bytes"])
                out.append((f"{link}/{op}", small["cpu_s"] / ring_steps(op, n)))
    return tuple(sorted(out))


def mismatch(profile: dict, backend: str, device: str) -> Optional[str]:
    """Why a profile does not describe a cluster with this backend and device (None if it does)."""
    measured = profile["cluster"]
    if (measured["backend"], measured["device"]) != (backend, device):
        return (
            f"was measured with backend {measured['backend']} on {measured['device']}, but the cluster uses "
            f"{backend} on {device}"
        )
    return None
