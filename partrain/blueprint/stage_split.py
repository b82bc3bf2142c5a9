"""Which decoder layers each pipeline chunk holds, and which chunks each pipeline rank runs.

Pure Python (no torch): the validator, the planner and the dry run use it as well as the workers.

Vocabulary
----------
- pp ranks: the processes of one pipeline (mesh axis "pp").
- chunk (= torch's "stage"): a contiguous run of decoder layers. There are n_chunks = pp * v of
  them, v = virtual stages per rank. Chunk 0 also holds the embeddings; chunk n_chunks-1 the final
  norm, the LM head and the loss.
- placement style: which chunks a rank owns. "loop": rank r owns r, r+pp, r+2pp, ...
  (GPipe/1F1B with v=1, interleaved 1F1B, looped BFS, interleaved zero bubble). "v": rank r owns r
  and 2pp-1-r (ZBV, DualPipeV), so rank 0 holds both the first and the last chunk.

Cost model (`chunk_costs`)
--------------------------
Layers are split so that the most expensive chunk is as cheap as possible (the pipeline runs at the
pace of its slowest stage); among such splits the one with the smallest sum of squared chunk costs
wins (the most even), then the most even layer counts, and remaining ties give earlier chunks
more layers. Costs are per token, in
multiply-accumulates (MACs) of one forward pass (backward is ~2x forward for every part alike, so it
does not change the split):

- decoder layer: its active weight matrices (q, k, v, o projections; 2 or 3 MLP matrices of
  hidden x ffn, for MoE the top-k experts plus shared expert and router) plus causal attention
  scores, seq_len * heads * head_dim (QK^T and AV, each over seq_len/2 keys on average);
- embeddings: hidden (a lookup, plus the learned-position add for GPT-2): almost free in time;
- head: vocab * hidden for the output projection plus vocab for softmax/cross-entropy.

So with a large vocabulary the last chunk gets fewer layers (Llama-3 8B: the head costs about 2.4
layers). `kind="params"` instead balances model-state memory (parameter counts; the embedding then
costs vocab*hidden too, so the first chunk also gets fewer layers). A uniform MoE/dense mix
(Qwen2-MoE `mlp_only_layers`) is averaged over the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Union

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv", "dualpipev")
"""Pipeline schedules partrain runs (config value `parallel.pp_schedule`)."""

SCHEDULE_CLASS: Dict[str, str] = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zero-bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""torch.distributed.pipelining class of each schedule."""

SCHEDULE_STYLE: Dict[str, str] = {
    "gpipe": "loop",
    "1f1b": "loop",
    "interleaved-1f1b": "loop",
    "looped-bfs": "loop",
    "interleaved-zero-bubble": "loop",
    "zbv": "v",
    "dualpipev": "v",
}
"""Chunk placement style each schedule expects (see module docstring)."""

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
"""Schedules that run exactly one chunk per rank (v = 1)."""

ZERO_BUBBLE_SCHEDULES = ("interleaved-zero-bubble", "zbv", "dualpipev")
"""Schedules that split backward into input-gradient (I) and weight-gradient (W) passes."""


def schedule_style(schedule: str) -> str:
    try:
        return SCHEDULE_STYLE[schedule]
    except KeyError:
        raise ValueError(f"unknown pipeline schedule {schedule!r} (known: {', '.join(SCHEDULES)})") from None


def schedule_problems(schedule: str, pp: int, v: int, n_microbatches: int, n_layers: Optional[int] = None) -> List[str]:
    """Why (schedule, pp, v, microbatches, layers) cannot run; empty when it can.

    The rules are those torch.distributed.pipelining 2.13 enforces (or hangs without), stated
    before any process starts: GPipe/1F1B run one chunk per rank; 1F1B needs microbatches >= pp;
    interleaved and zero-bubble schedules group microbatches in rounds of about pp and need
    microbatches to be a multiple of the number of rounds (max(1, m // pp)); ZBV and DualPipeV need
    exactly 2 chunks per rank, DualPipeV at least as many microbatches as chunks (2 pp); every chunk
    needs at least one decoder layer.
    """
    out: List[str] = []
    if schedule not in SCHEDULE_STYLE:
        return [f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"]
    if pp < 1 or v < 1 or n_microbatches < 1:
        return ["pp, virtual stages and microbatches must be >= 1"]
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        out.append(f"{schedule} runs one chunk per rank: set pp_virtual_stages=1 (or use interleaved-1f1b)")
    if schedule not in SINGLE_STAGE_SCHEDULES and schedule not in ("zbv", "dualpipev") and v < 2:
        out.append(f"{schedule} needs pp_virtual_stages >= 2 (with 1 use 1f1b or gpipe)")
    if schedule in ("zbv", "dualpipev") and v != 2:
        out.append(f"{schedule} needs exactly pp_virtual_stages=2 (V-shaped placement)")
    if schedule == "1f1b" and n_microbatches < pp:
        out.append(f"1f1b needs microbatches >= pp ({n_microbatches} < {pp})")
    if schedule in ("interleaved-1f1b", "interleaved-zero-bubble"):
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            out.append(
                f"{schedule} needs microbatches to be a multiple of the rounds max(1, m // pp) = {rounds} "
                f"(m={n_microbatches}); multiples of pp always work"
            )
    if schedule == "dualpipev" and n_microbatches < 2 * pp:
        out.append(f"dualpipev needs microbatches >= 2 * pp = {2 * pp} (got {n_microbatches})")
    if n_layers is not None and n_layers < pp * v:
        out.append(f"{pp} x {v} = {pp * v} pipeline chunks but only {n_layers} decoder layers; each chunk needs one")
    return out


def chunk_placement(pp: int, v: int, style: str) -> List[List[int]]:
    """For each pp rank, the chunk indices it owns (ascending = order of its stages in torch)."""
    if pp < 1 or v < 1:
        raise ValueError(f"pp and v must be >= 1 (got pp={pp}, v={v})")
    if style == "loop":
        return [[r + k * pp for k in range(v)] for r in range(pp)]
    if style == "v":
        if v != 2:
            raise ValueError(f"V-shaped placement needs exactly 2 chunks per rank (got v={v})")
        return [[r, 2 * pp - 1 - r] for r in range(pp)]
    raise ValueError(f"unknown placement style {style!r} (loop or v)")


def owner_of_chunk(pp: int, v: int, style: str) -> List[int]:
    """pp rank owning each chunk."""
    owner = [0] * (pp * v)
    for rank, chunks in enumerate(chunk_placement(pp, v, style)):
        for c in chunks:
            owner[c] = rank
    return owner


# ---- cost model ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkCosts:
    """Per-token cost of one decoder layer, of the embeddings and of norm + head + loss."""

    layer: float
    embed: float
    head: float
    kind: str = "flops"

    def to_json(self) -> dict:
        return dict(self.__dict__)


def chunk_costs(facts, seq_len: int = 0, kind: str = "flops") -> ChunkCosts:
    """Costs for `split_layers` from a `partrain.blueprint.model_facts.ModelFacts` (see module docstring).

    kind="flops": MACs per token of one forward pass (balances step time; the default).
    kind="params": parameter counts (balances model-state memory).
    """
    h, q = facts.hidden, facts.heads * facts.head_dim
    kv = facts.kv_heads * facts.head_dim
    attn = h * q + 2 * h * kv + q * h
    mats = 3 if facts.gated_mlp else 2
    dense_mlp = mats * h * facts.ffn
    if facts.is_moe:
        shared = 3 * h * facts.shared_expert_ffn
        router = h * facts.n_experts
        frac = facts.moe_layers / max(1, facts.n_layers)  # share of layers that hold experts
        experts = facts.n_experts if kind == "params" else facts.experts_per_token
        moe_mlp = experts * dense_mlp + shared + router
        mlp = frac * moe_mlp + (1 - frac) * dense_mlp
    else:
        mlp = dense_mlp
    if kind == "flops":
        layer = attn + mlp + seq_len * q
        embed = float(h)
        head = float(facts.vocab * h + facts.vocab)
    elif kind == "params":
        layer = attn + mlp + 2 * h
        embed = float(facts.vocab * h + (facts.max_positions * h if facts.learned_positions else 0))
        head = float(facts.vocab * h + h)  # a tied head is a separate copy on the last stage
    else:
        raise ValueError(f"unknown cost kind {kind!r} (flops or params)")
    return ChunkCosts(layer=float(layer), embed=embed, head=head, kind=kind)


def split_layers(
    n_layers: int,
    n_chunks: int,
    layers_per_chunk: Optional[Sequence[int]] = None,
    embed_cost: float = 0.0,
    head_cost: float = 0.0,
    layer_cost: Union[float, Sequence[float]] = 1.0,
) -> List[range]:
    """Contiguous decoder-layer ranges, one per chunk, in chunk order.

    `layers_per_chunk` (explicit counts, e.g. from `parallel.pp_layers_per_stage`) wins; counts may
    be 0 for a chunk that only holds the embeddings or the head. Otherwise the split minimises the
    largest chunk cost (chunk cost = its layers' costs, plus `embed_cost` for chunk 0, plus
    `head_cost` for the last chunk), then the sum of squared chunk costs, then the sum of squared
    layer counts, then gives earlier chunks more layers. `layer_cost` is one number for identical
    layers or one per layer; any unit works as long as all costs share it (see `chunk_costs`).
    Every chunk gets >= 1 layer.
    """
    if n_chunks < 1:
        raise ValueError(f"n_chunks must be >= 1 (got {n_chunks})")
    if layers_per_chunk is not None:
        return _explicit_ranges(n_layers, n_chunks, layers_per_chunk)
    if n_layers < n_chunks:
        raise ValueError(f"{n_chunks} pipeline chunks need at least as many decoder layers (got {n_layers})")
    costs = _layer_costs(n_layers, layer_cost, embed_cost, head_cost)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, e: int, k: int) -> float:  # chunk k holds layers [i, e)
        extra = (embed_cost if k == 0 else 0.0) + (head_cost if k == n_chunks - 1 else 0.0)
        return prefix[e] - prefix[i] + extra

    scale = max(prefix[-1] + embed_cost + head_cost, 1e-30)
    eps = 1e-9 * scale
    inf = float("inf")
    # best_max[k][i]: smallest possible max cost when chunks k..n_chunks-1 hold layers i..n_layers-1.
    best_max = [[inf] * (n_layers + 1) for _ in range(n_chunks + 1)]
    best_max[n_chunks][n_layers] = 0.0
    for k in range(n_chunks - 1, -1, -1):
        remaining = n_chunks - k
        for i in range(n_layers - remaining, -1, -1):
            best = inf
            for e in range(i + 1, n_layers - (remaining - 1) + 1):
                c = cost(i, e, k)
                if c >= best:  # chunk cost only grows with e (costs are >= 0): no better split ahead
                    break
                best = min(best, max(c, best_max[k + 1][e]))
            best_max[k][i] = best
    bound = best_max[0][0] + eps
    # Second pass: among splits whose every chunk is <= bound, minimise the sum of squared chunk
    # costs, then the sum of squared layer counts (equal costs: prefer even layer counts).
    best_sq = [[(inf, inf)] * (n_layers + 1) for _ in range(n_chunks + 1)]
    choice = [[-1] * (n_layers + 1) for _ in range(n_chunks + 1)]
    best_sq[n_chunks][n_layers] = (0.0, 0)
    tol = 1e-9 * scale * scale
    for k in range(n_chunks - 1, -1, -1):
        remaining = n_chunks - k
        for i in range(n_layers - remaining, -1, -1):
            best, pick = (inf, inf), -1
            last = i + 1  # chunks within the bound end at i+1 .. last
            while last < n_layers - (remaining - 1) and cost(i, last + 1, k) <= bound:
                last += 1
            for e in range(last, i, -1):  # larger chunks first: ties keep them
                c = cost(i, e, k)
                rest = best_sq[k + 1][e]
                if c > bound or rest[0] == inf:
                    continue
                total = (c * c + rest[0], (e - i) ** 2 + rest[1])
                if total[0] < best[0] - tol or (total[0] <= best[0] + tol and total[1] < best[1]):
                    best, pick = total, e
            best_sq[k][i], choice[k][i] = best, pick
    counts, i = [], 0
    for k in range(n_chunks):
        e = choice[k][i]
        counts.append(e - i)
        i = e
    return _ranges(counts)


def _explicit_ranges(n_layers: int, n_chunks: int, layers_per_chunk: Sequence[int]) -> List[range]:
    counts = [int(c) for c in layers_per_chunk]
    if len(counts) != n_chunks:
        raise ValueError(f"layers_per_chunk has {len(counts)} entries, the pipeline has {n_chunks} chunks")
    if any(c < 0 for c in counts) or sum(counts) != n_layers:
        raise ValueError(f"layers_per_chunk {counts} must be >= 0 and sum to the {n_layers} decoder layers")
    return _ranges(counts)


def _layer_costs(
    n_layers: int, layer_cost: Union[float, Sequence[float]], embed_cost: float, head_cost: float
) -> List[float]:
    costs = [float(layer_cost)] * n_layers if isinstance(layer_cost, (int, float)) else [float(c) for c in layer_cost]
    if len(costs) != n_layers:
        raise ValueError(f"layer_cost has {len(costs)} entries for {n_layers} layers")
    if min(costs, default=0.0) < 0 or embed_cost < 0 or head_cost < 0:
        raise ValueError("costs must be >= 0")
    return costs


def _ranges(counts: Sequence[int]) -> List[range]:
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def plan_chunks(
    facts,
    pp: int,
    v: int,
    schedule: str,
    seq_len: int = 0,
    layers_per_chunk: Optional[Sequence[int]] = None,
    kind: str = "flops",
) -> dict:
    """Everything the dry run and a worker need: layer ranges per chunk, chunks per rank, costs.

    Returns {"ranges": [range, ...], "placement": [[chunk, ...] per rank], "style", "costs"}.
    """
    style = schedule_style(schedule)
    costs = chunk_costs(facts, seq_len=seq_len, kind=kind)
    n_chunks = pp * v
    ranges = split_layers(
        facts.n_layers,
        n_chunks,
        layers_per_chunk,
        embed_cost=costs.embed / costs.layer,
        head_cost=costs.head / costs.layer,
        layer_cost=1.0,
    )
    return {"ranges": ranges, "placement": chunk_placement(pp, v, style), "style": style, "costs": costs}
