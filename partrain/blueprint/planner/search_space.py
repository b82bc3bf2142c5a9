"""The layouts the search enumerates (`enumerate_specs`): degrees, micro batch, schedule, ZeRO stage and
recompute, each estimated cheaply and kept when it fits. Why every combination is estimated (no pruning):
search.py's module docstring."""

from __future__ import annotations

import copy
import dataclasses
from typing import Iterator, List, Optional, Tuple

from partrain.blueprint.layout import divisors
from partrain.blueprint.planner.estimate import estimate_spec
from partrain.blueprint.planner.spec import PlanSpec
from partrain.blueprint.trainable import zero1_with_tp_unsupported

RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Restrictions of the search (None = everything valid)."""

    tp: Optional[Tuple[int, ...]] = None
    pp: Optional[Tuple[int, ...]] = None
    dp: Optional[Tuple[int, ...]] = None
    zero_stages: Tuple[int, ...] = (0, 1, 2, 3)
    recompute: Tuple[str, ...] = RECOMPUTE_ORDER
    schedules: Tuple[str, ...] = ("1f1b", "interleaved-1f1b")
    virtual_stages: Tuple[int, ...] = (2, 4, 8, 16)
    sequence_parallel: Tuple[bool, ...] = (False, True)
    micro_batch_sizes: Optional[Tuple[int, ...]] = None
    expert_parallel: Optional[Tuple[int, ...]] = None
    runnable_only: bool = False
    """Leave out, before pruning, the choices `partrain train` cannot run yet (ZeRO-1 with TP), so
    that a runnable layout is never pruned in favour of one that cannot train."""


def _trainable(spec: PlanSpec) -> bool:
    """The spec-level part of `partrain.blueprint.trainable.unsupported_features` for the choices the
    search makes (the rest: model, sp and checkpoint settings, are the same for every candidate)."""
    return not zero1_with_tp_unsupported(spec.zero_stage, spec.tp)


def _with_state_choices(spec: PlanSpec, zero_stage: int, recompute: str) -> PlanSpec:
    """`spec` with another ZeRO stage and recompute: `dataclasses.replace` without re-running the
    constructor of every field (PlanSpec has no __post_init__), for the 12 choices of each layout."""
    out = copy.copy(spec)
    object.__setattr__(out, "zero_stage", zero_stage)
    object.__setattr__(out, "recompute", recompute)
    return out


def _tp_options(spec: PlanSpec, world: int, allow_across: bool, space: SearchSpace) -> List[int]:
    f, cl = spec.facts, spec.cluster
    out = []
    for t in divisors(world):
        if space.tp is not None and t not in space.tp:
            continue
        if t > cl.devices_per_node and not allow_across:
            continue
        widths = [f.heads, f.kv_heads, f.ffn, f.vocab] + ([f.shared_expert_ffn] if f.shared_expert_ffn else [])
        if spec.extras.dense_ffn:
            widths.append(spec.extras.dense_ffn)
        if any(w % t for w in widths):
            continue
        if spec.sp > 1 and spec.sp_mode == "ulysses" and (f.heads % (t * spec.sp) or f.kv_heads % (t * spec.sp)):
            continue
        out.append(t)
    return out


def _schedules(pp: int, m: int, layers: int, space: SearchSpace) -> Iterator[Tuple[str, int]]:
    if pp == 1:
        yield "1f1b", 1
        return
    if "1f1b" in space.schedules and m >= pp:
        yield "1f1b", 1
    if "interleaved-1f1b" in space.schedules:
        rounds = max(1, m // pp)
        if m % rounds == 0:
            for v in space.virtual_stages:
                if pp * v <= layers:
                    yield "interleaved-1f1b", v


SEARCHED_KEYS = frozenset(
    [f"parallel.{k}" for k in ("dp", "tp", "pp", "ep", "dp_shard", "zero_stage", "recompute", "recompute_every")]
    + [f"parallel.{k}" for k in ("pp_schedule", "pp_virtual_stages", "pp_layers_per_stage", "tp_sequence_parallel")]
    + ["train.micro_batch_size", "train.microbatches"]
)
"""Keys the search chooses itself: their starting values are never checked."""


def enumerate_specs(
    base: PlanSpec,
    space: SearchSpace = SearchSpace(),
    allow_tp_across_nodes: bool = False,
    stats: Optional[dict] = None,
    memory_limit: Optional[float] = None,
) -> Iterator[Tuple[PlanSpec, dict]]:
    """Yield (spec, cheap estimate) for every layout whose cheap estimate fits (and needs at most
    `memory_limit` bytes when given); see the module docstring. stats["evaluated"] counts the
    estimates made, stats["layouts"] the degree choices the global batch admits, stats["batch_dps"]
    the dp degrees the model and cluster admit whatever the global batch."""
    stats = stats if stats is not None else {}
    stats.setdefault("evaluated", 0)
    stats.setdefault("layouts", 0)
    stats.setdefault("batch_dps", set())
    f = base.facts
    world = base.cluster.nodes * base.cluster.devices_per_node
    G, sp = base.global_batch, base.sp
    for tp in _tp_options(base, world, allow_tp_across_nodes, space):
        if (world // tp) % sp:
            continue
        rest = world // (tp * sp)
        for pp in divisors(rest):
            if pp > f.n_layers or (space.pp is not None and pp not in space.pp):
                continue
            dp = rest // pp
            if space.dp is not None and dp not in space.dp:
                continue
            stats["batch_dps"].add(dp)
            if G % dp:
                continue
            stats["layouts"] += 1
            eps = [1]
            if f.is_moe:
                eps = [e for e in divisors(f.n_experts) if (dp * sp) % e == 0]
                if space.expert_parallel is not None:
                    eps = [e for e in eps if e in space.expert_parallel] or [1]
            sps = [s for s in space.sequence_parallel if not s or (tp > 1 and base.seq % tp == 0)] or [False]
            zeros = [z for z in space.zero_stages if z == 0 or dp * sp > 1] or [0]
            mbss = [b for b in divisors(G // dp) if space.micro_batch_sizes is None or b in space.micro_batch_sizes]
            for ep in eps:
                for tp_sp in sps:
                    for mbs in mbss:
                        layout = dict(tp=tp, pp=pp, dp=dp, ep=ep, dp_shard=dp, tp_sp=tp_sp, mbs=mbs)
                        yield from _fitting_at(base, space, layout, zeros, stats, memory_limit)


def _fitting_at(
    base: PlanSpec, space: SearchSpace, layout: dict, zeros: List[int], stats: dict, memory_limit: Optional[float]
) -> Iterator[Tuple[PlanSpec, dict]]:
    """The fitting (schedule, ZeRO stage, recompute) choices for one set of degrees and micro batch:
    every one is estimated (no pruning: see the module docstring)."""
    m = base.global_batch // (layout["dp"] * layout["mbs"])
    for schedule, v in _schedules(layout["pp"], m, base.facts.n_layers, space):
        degrees = dataclasses.replace(base, **layout, recompute_every=1, schedule=schedule, v=v)
        for zero in zeros:
            for rec in space.recompute:
                spec = _with_state_choices(degrees, zero, rec)
                if space.runnable_only and not _trainable(spec):
                    break  # every recompute of this ZeRO stage is as untrainable
                est = estimate_spec(spec, detail=False)
                stats["evaluated"] += 1
                if est["fits"] and (memory_limit is None or est["memory_bytes"]["total"] <= memory_limit):
                    yield spec, est
