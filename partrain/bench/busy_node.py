"""The busy-node part of `partrain bench comm` on CPU: what a collective call and a stretch of compute
cost a rank's cores while every rank of the node trains, as they do in a run.

The lockstep timing (comm.py) calls one op back to back on every rank at once. In training a rank
computes between its calls, and on a node whose ranks outnumber its cores its partner is often not
scheduled when it arrives, so the call blocks. What that costs the cores differs from the lockstep
figure, and not by the ring's steps (measured on 2 cores, 8 gloo ranks, gpt-3d with per-call probes:
1.17 ms of process CPU per all-reduce of a TP pair and 0.75 ms per all-reduce of all 8 ranks, where
the lockstep profile said 0.55 and 3.8). This module measures it directly:

- the node's ranks in pairs (an odd last three form one group), every pair at once;
- each rank does `BUSY_WORK_S` of compute (a matmul and an elementwise pass at a decoder layer's
  scale), then one call of the op at the profile's smallest message, `iters` times;
- per op: the ranks' mean process CPU seconds per call (gloo's threads too), measured around the call
  only; a call's CPU grows with how late its partner is and levels off past a few ms of work between
  calls (0.62 ms at 1 ms of work, 1.1-1.2 ms at 3-9 ms, measured here), so 4 ms stands for the
  stretch between a layer's collectives;
- the compute's inflation: the work's thread CPU in this loop over the same work timed alone (one
  rank at a time, the others waiting in a barrier): caches and cores shared with the other ranks
  (1.09-1.11 measured here with a GPT-2 decoder layer as the work).

The planner (planner/host_work.py) charges a busy call's CPU for each call inside a node, whatever
its group size, and scales the rank's own CPU by the inflation, when it bounds a step by the node's
CPU work over its cores.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Sequence

BUSY_WORK_S = 0.004
"""CPU seconds of compute before each timed call (see the module docstring)."""
BUSY_ITERS = 20
"""Fewest timed calls per op (whatever --iters says): a call's CPU varies with its partner's lateness."""


def busy_groups(nodes: int, devices_per_node: int) -> List[List[int]]:
    """Consecutive pairs of each node's ranks; an odd node's last three ranks form one group."""
    groups: List[List[int]] = []
    for k in range(nodes):
        ranks = list(range(k * devices_per_node, (k + 1) * devices_per_node))
        pairs = [ranks[i : i + 2] for i in range(0, len(ranks) - len(ranks) % 2, 2)]
        if len(ranks) % 2:
            pairs[-1] = pairs[-1] + ranks[-1:]
        groups += pairs
    return groups


def _work(torch) -> Callable[[], None]:
    """One unit of compute: a matmul of a small decoder layer's shape and an elementwise pass."""
    a, b = torch.randn(256, 128), torch.randn(128, 512)

    def unit() -> None:
        torch.nn.functional.gelu(a @ b)

    return unit


def _units_for(unit: Callable[[], None], seconds: float) -> int:
    """How many units take `seconds` of this thread's CPU (timed alone)."""
    for _ in range(5):
        unit()
    n, t0 = 0, time.thread_time()
    while time.thread_time() - t0 < seconds:
        unit()
        n += 1
    return max(1, n)


def measure_busy(bench, nodes: int, devices_per_node: int, sizes: Sequence[int], ops: Sequence[str], iters: int):
    """The profile's "busy" block (module docstring); every rank calls it (collective)."""
    import torch.distributed as dist

    torch, env = bench.torch, bench.env
    groups = busy_groups(nodes, devices_per_node)
    group = dist.new_subgroups_by_enumeration(groups)[0]
    members = next(g for g in groups if env.rank in g)
    unit = _work(torch)
    iters = max(BUSY_ITERS, iters)

    def work() -> float:
        t0 = time.thread_time()
        for _ in range(units):
            unit()
        return time.thread_time() - t0

    units, alone = 1, 0.0
    for turn in range(env.world_size):  # calibrated and timed alone, one rank at a time
        bench.barrier()
        if turn == env.rank:
            units = _units_for(unit, BUSY_WORK_S)
            alone = sum(work() for _ in range(10)) / 10
    bench.barrier()
    nbytes = min(sizes)
    cpu: Dict[str, float] = {}
    busy_work, timed = 0.0, 0
    for op in ops:
        count = max(len(members), nbytes // 4 // len(members) * len(members))
        call, _, _ = bench.runner(op, count, group, members)
        call()
        bench.barrier()
        spent = 0.0
        for _ in range(iters):
            busy_work += work()
            timed += 1
            p0 = time.process_time()
            call()
            spent += time.process_time() - p0
        cpu[op] = bench.world_mean(spent / iters)
    alone = bench.world_mean(alone)
    inflation = bench.world_mean(busy_work / max(1, timed)) / max(alone, 1e-9)
    return {
        "group_size": len(groups[0]),
        "bytes": int(nbytes),
        "work_s": alone,
        "iters": iters,
        "compute_inflation": inflation,
        "cpu_s": cpu,
    }
