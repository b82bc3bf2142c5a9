"""Pipeline arithmetic: which layers each pipeline rank holds, how many microbatches each keeps in
flight (activation memory), and the bubble (idle time) of each schedule.

Stage split: the same rule as the runtime (`partrain.blueprint.stage_split.split_layers` with the
costs of `chunk_costs`: minimise the most expensive chunk, then make chunks as even as possible,
ties giving earlier chunks more layers). For identical layers that rule is what a greedy fill
gives (one layer at a time to the currently cheapest chunk, the earliest on a tie); it runs in
microseconds where the runtime's dynamic programme takes up to seconds for 128 layers x 128 chunks,
and a test checks that both agree.

Bubble (share of the step a device idles), with p ranks, m microbatches per step, v chunks per rank:

- GPipe and 1F1B: (p-1)/(m+p-1) - GPipe's (K-1)/(M+K-1); relative to the ideal time this is
  Narayanan et al.'s (p-1)/m.
- interleaved 1F1B, looped BFS: (p-1)/v idle chunk-slots per m: (p-1)/(v*m+p-1) of the step,
  (p-1)/(v*m) relative to the ideal (Narayanan et al. 2021).
- zero-bubble variants are approximated: interleaved-zero-bubble and ZBV a third of the interleaved
  bubble (Qi et al. 2023: splitting backward into B and W fills about two thirds of it), DualPipeV
  half a third (approximate; no published closed form for these torch implementations).

Microbatches in flight on pipeline rank r (each holding the activations of one chunk's layers):

- GPipe: m (all forwards run before any backward). Looped BFS: m * v.
- 1F1B: min(p - r, m) (Narayanan et al.; Korthikanti et al.: the first stage holds p).
- interleaved 1F1B (and its zero-bubble variant): torch's warm-up (v-1)*mpr + 2*(p-1-r) plus one,
  capped at m*v, mpr = microbatches per round = m // max(1, m // p). For rank 0 with m >= p this is
  (v-1)p + 2p - 1 chunk-microbatches of L/(pv) layers = L*(1 + (p-1)/(pv)) layer-microbatches:
  Korthikanti et al.'s interleaving factor 1 + (p-1)/(pv).
- ZBV / DualPipeV: 2p and 2p+1 chunk-microbatches (V placement; about 1F1B's memory), capped at 2m.
"""

from __future__ import annotations

import functools
import heapq
from typing import List, Optional, Tuple

from partrain.blueprint.stage_split import chunk_costs, chunk_placement, schedule_style


def greedy_counts(n_layers: int, n_chunks: int, embed_cost: float, head_cost: float) -> List[int]:
    """Layers per chunk for identical layers (the runtime's rule; see module docstring)."""
    if n_chunks < 1 or n_layers < n_chunks:
        raise ValueError(f"{n_chunks} chunks need at least as many layers (got {n_layers})")
    extra = [0.0] * n_chunks
    extra[0] += embed_cost
    extra[-1] += head_cost
    counts = [1] * n_chunks
    heap = [(1 + extra[k], k) for k in range(n_chunks)]
    heapq.heapify(heap)
    for _ in range(n_layers - n_chunks):
        cost, k = heapq.heappop(heap)
        counts[k] += 1
        heapq.heappush(heap, (counts[k] + extra[k], k))
    return counts


@functools.lru_cache(maxsize=4096)
def chunk_layer_counts(
    facts, pp: int, v: int, seq: int, layers_per_chunk: Optional[Tuple[int, ...]] = None
) -> Tuple[int, ...]:
    """Decoder layers in each of the pp*v chunks (chunk order)."""
    n_chunks = pp * v
    if layers_per_chunk:
        return tuple(layers_per_chunk)
    if n_chunks == 1:
        return (facts.n_layers,)
    costs = chunk_costs(facts, seq_len=seq, kind="flops")
    return tuple(greedy_counts(facts.n_layers, n_chunks, costs.embed / costs.layer, costs.head / costs.layer))


def rank_chunks(pp: int, v: int, schedule: str) -> List[List[int]]:
    """Chunk indices each pipeline rank owns."""
    return chunk_placement(pp, v, schedule_style(schedule) if pp > 1 else "loop")


def in_flight(schedule: str, pp: int, v: int, m: int, rank: int) -> int:
    """Chunk-microbatches whose activations pipeline rank `rank` holds at its peak."""
    if pp == 1:
        return 1  # gradient accumulation: one microbatch at a time
    if schedule == "gpipe":
        return m
    if schedule == "looped-bfs":
        return m * v
    if schedule in ("interleaved-1f1b", "interleaved-zero-bubble"):
        rounds = max(1, m // pp)
        per_round = m // rounds
        return min(m * v, (v - 1) * per_round + 2 * (pp - 1 - rank) + 1)
    if schedule == "zbv":
        return min(2 * m, 2 * pp)
    if schedule == "dualpipev":
        return min(2 * m, 2 * pp + 1)
    return min(pp - rank, m)  # 1f1b


def bubble_units(schedule: str, pp: int, v: int) -> float:
    """Idle time per step in units of one microbatch's full pass through one rank's layers."""
    if pp == 1:
        return 0.0
    base = (pp - 1) / v
    if schedule in ("interleaved-zero-bubble", "zbv"):
        return base / 3
    if schedule == "dualpipev":
        return base / 6
    return base


def bubble_fraction(schedule: str, pp: int, v: int, m: int) -> float:
    """Share of the step a device idles (GPipe's (K-1)/(M+K-1) for 1F1B/GPipe)."""
    units = bubble_units(schedule, pp, v)
    return units / (m + units) if units else 0.0


def bubble_overhead(schedule: str, pp: int, v: int, m: int) -> float:
    """Idle time relative to the ideal step (Narayanan et al.: (p-1)/m, interleaved (p-1)/(v*m))."""
    return bubble_units(schedule, pp, v) / m
