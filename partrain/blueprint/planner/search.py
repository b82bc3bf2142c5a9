"""Automatic layout search: every valid layout of a run's model, cluster and global batch, ranked by
predicted step time.

Taken from the run (`spec.spec_from_run`): the model, cluster, sequence length, context-parallel
degree and mode, precision and every other run-level setting the estimate reads (`spec.run_settings`),
and the global batch. The run's own degrees, micro batch, microbatches, ZeRO stage, recompute and
schedule are never read, so they need not be valid (`start_problems` checks the rest).

Enumerated:

- tp: divides the world, the attention and KV heads, MLP width(s) and vocabulary; at most one node
  (unless the cluster allows TP across nodes); with Ulysses sp, heads divisible by tp x sp.
- pp: divides what tp and sp leave, at most the number of layers; dp is the rest and must divide
  the global batch.
- Megatron sequence parallelism on/off (tp > 1; sequence divisible by tp).
- ep for MoE models: divisors of the expert count that divide dp x sp.
- micro batch size: every divisor of global batch / dp.
- schedule: 1F1B, or interleaved 1F1B with v = 2, 4, 8, ... chunks per rank (pp x v <= layers;
  microbatches a multiple of the rounds).
- zero stage 0..3 (sharding over all of dp x sp) and recompute none / selective / full.

No pruning: every combination is estimated, because none of the shortcuts once used holds under
the planner's own model. Memory is not monotone in the ZeRO stage (ZeRO-2 holds the rank's whole
model gathered; FSDP inside a pipeline keeps unsharded gradients until the last microbatch; ZeRO-0/1
with 16-bit parameters keep fp32 master weights), nor in the micro batch (one microbatch turns that
unsharded-gradient buffer off), nor in recompute (full recompute adds autocast's cast cache and a
recomputed layer's activations). Step time is not monotone in the ZeRO stage (FSDP's traffic hides
behind each microbatch's compute while ZeRO-0/1 expose a reduction at the end of the step), and a
heavier recompute can tie a lighter one on time and need less memory, which the order prefers.

Two shortcuts remain, both exact under the model:

- each layout is first estimated cheaply (`estimate_spec(detail=False)`), which takes the maxima
  (step time, memory) over a subset of the pipeline ranks (all of them on CPU clusters, where the
  shared-core term averages ranks): a lower bound of the full estimate. A layout whose cheap
  estimate does not fit cannot fit in full.
- layouts are validated and estimated in full in order of their cheap step time, and the search
  stops once top_k are found and the next cheap step time is in a later near-tie bucket than the
  k-th (its full step time, never lower, cannot rank before it).

Order (`rank_key`), the same for `plan --search` and `parallel=auto`: step time in near-tie buckets
of 0.01% (fixed, not relative to the fastest, so that a filtered list keeps the same order), then
layouts this version of partrain can train, fewer microbatches (real runs pay a per-microbatch
overhead the model does not charge), less memory, and the overrides as text. `parallel=auto`'s choice
is the first candidate within its memory allowance (`auto_ok`), so it is the first `auto_ok`
candidate `plan --search` lists. tests/test_search_optimum.py compares the search with every
layout estimated in full.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from typing import List

from partrain.blueprint.planner.candidates import candidates, overrides, rank_key, sort_key
from partrain.blueprint.planner.estimate import USABLE_MEMORY_FRACTION, estimate
from partrain.blueprint.planner.search_space import SEARCHED_KEYS, SearchSpace, enumerate_specs
from partrain.blueprint.planner.spec import GIB, PlanSpec, rank_memory_gib, spec_from_run
from partrain.errors import ConfigError, Problem

__all__ = [
    "SearchSpace",
    "auto_memory_bytes",
    "auto_memory_fraction",
    "base_spec",
    "enumerate_specs",
    "overrides",
    "rank_key",
    "search",
]


def auto_memory_fraction(margin: float) -> float:
    """Share of a device's memory `parallel=auto` may fill: 1 - parallel.auto_memory_margin, never more
    than the planner's usable share (USABLE_MEMORY_FRACTION)."""
    return min(USABLE_MEMORY_FRACTION, 1.0 - min(max(margin, 0.0), 1.0))


def auto_memory_bytes(run) -> float:
    """Bytes per device `parallel=auto` may fill on the run's cluster."""
    return rank_memory_gib(run.cluster) * GIB * auto_memory_fraction(run.parallel.auto_memory_margin)


def searched_run(v_or_run):
    """The RunConfig the search reads, with the global batch stated: a ValidatedRun's own (derived
    where the config leaves it 0), or a RunConfig's, which must then be stated."""
    if hasattr(v_or_run, "layout"):
        run = v_or_run.run
        return dataclasses.replace(
            run, train=dataclasses.replace(run.train, global_batch_size=v_or_run.global_batch_size)
        )
    run = v_or_run
    if run.train.global_batch_size <= 0:
        raise ConfigError(
            Problem(
                "train.global_batch_size",
                run.train.global_batch_size,
                "the layout search keeps the global batch fixed, so it must be stated",
                "set train.global_batch_size (sequences per optimizer step)",
            )
        )
    return run


def _neutral(run):
    """The run with the searched keys at values that are valid on any world (dp takes it all)."""
    p = dataclasses.replace(
        run.parallel,
        dp=-1,
        tp=1,
        pp=1,
        ep=1,
        dp_shard=-1,
        zero_stage=0,
        recompute="none",
        recompute_every=1,
        pp_schedule="1f1b",
        pp_virtual_stages=1,
        pp_layers_per_stage=None,
        tp_sequence_parallel=False,
    )
    t = dataclasses.replace(run.train, micro_batch_size=1, microbatches=0, global_batch_size=0)
    return dataclasses.replace(run, parallel=p, train=t)


def start_problems(run) -> List[Problem]:
    """Problems of the run that no layout can fix (model, cluster, sequence, data, ...): the validator's
    verdict on the run with every searched key neutral (`_neutral`). The global batch is checked by
    the search itself (`batch_problem`)."""
    from partrain.blueprint.validate import validate

    try:
        validate(_neutral(run))
    except ConfigError as err:
        return [p for p in err.problems if p.key not in SEARCHED_KEYS and p.key != "train.global_batch_size"]
    return []


def batch_problem(run, dps) -> Problem:
    """The global batch admits no layout: no dp the model and cluster allow divides it. Names the
    nearest global batch sizes that some allowed dp divides."""
    G = run.train.global_batch_size
    near = set()
    for dp in dps:
        near.update(k * dp for k in range(max(1, G // dp - 2), G // dp + 4))
    good = sorted(sorted(near, key=lambda x: (abs(x - G), x))[:4])
    world = run.cluster.nodes * run.cluster.devices_per_node
    return Problem(
        "train.global_batch_size",
        G,
        f"admits no layout on {world} devices: the data-parallel degree of every valid layout "
        f"({', '.join(map(str, sorted(dps)))}) must divide it",
        f"use train.global_batch_size in {good}" if good else "use another cluster size",
    )


def base_spec(v_or_run, mixed: str = "autocast", dp_overlap: bool = True) -> PlanSpec:
    """What the search keeps of a run (`spec.spec_from_run`), from a ValidatedRun or a RunConfig whose
    own layout need not be valid (then the global batch must be stated)."""
    from partrain.blueprint.model_facts import model_facts

    run = searched_run(v_or_run)
    facts = getattr(v_or_run, "facts", None) or model_facts(run.model.arch, run.model.config, run.model.pretrained)
    return spec_from_run(run, facts, run.train.global_batch_size, mixed=mixed, dp_overlap=dp_overlap)


def _run_config(run, spec: PlanSpec):
    p = dataclasses.replace(
        run.parallel,
        tp=spec.tp,
        pp=spec.pp,
        dp=spec.dp,
        sp=spec.sp,
        ep=spec.ep,
        zero_stage=spec.zero_stage,
        dp_shard=-1,
        pp_schedule=spec.schedule,
        pp_virtual_stages=spec.v,
        pp_layers_per_stage=None,
        tp_sequence_parallel=spec.tp_sp,
        recompute=spec.recompute,
        recompute_every=1,
    )
    t = dataclasses.replace(run.train, micro_batch_size=spec.mbs, global_batch_size=spec.global_batch, microbatches=0)
    return dataclasses.replace(run, parallel=p, train=t)


def search(
    v,
    top_k: int = 10,
    mixed: str = "autocast",
    space: SearchSpace = SearchSpace(),
    runnable_only: bool = False,
    dp_overlap: bool = True,
    within_auto_margin: bool = False,
) -> List[dict]:
    """The best `top_k` fitting layouts for the run's model, cluster and global batch, in `rank_key` order.

    `v` is a ValidatedRun, or a RunConfig whose own layout may be invalid (see `searched_run`).
    Raises ConfigError for problems no layout fixes (`start_problems`) and for a global batch that
    admits no layout (`batch_problem`).

    Each candidate: {"rank", "layout" (degrees, zero stage, recompute, micro batch, schedule, v),
    "overrides" (to paste after `partrain train recipe=...`), "estimate" (as `estimate`), "why" (the
    full trade-off), "why_short" (one short line), "auto_ok" (within `parallel=auto`'s memory
    allowance), "unsupported" (features this partrain version cannot train yet; empty = runnable),
    "search" (layouts evaluated and fitting, seconds, auto's allowance in bytes)}. `runnable_only`
    drops the layouts partrain cannot train; `within_auto_margin` the ones outside auto's allowance
    (what `parallel=auto` picks from).
    """
    from partrain.blueprint.trainable import unsupported_features
    from partrain.blueprint.validate import validate

    started = time.perf_counter()
    if runnable_only:
        space = dataclasses.replace(space, runnable_only=True)
    run = searched_run(v)
    problems = start_problems(run)
    if problems:
        raise ConfigError(problems)
    base = base_spec(v, mixed=mixed, dp_overlap=dp_overlap)
    allowance = auto_memory_bytes(run)
    stats = {"evaluated": 0}
    found = list(
        enumerate_specs(
            base,
            space,
            run.cluster.allow_tp_across_nodes,
            stats,
            memory_limit=allowance if within_auto_margin else None,
        )
    )
    if not stats["layouts"] and stats["batch_dps"]:
        raise ConfigError(batch_problem(run, stats["batch_dps"]))
    found.sort(key=lambda item: item[1]["step_time_s"])
    picked: List[dict] = []
    keys: list = []
    for spec, light in found:
        # The cheap step time never exceeds the full one: once it falls in a later near-tie bucket
        # than the k-th candidate's, nothing left can rank before that candidate.
        if len(picked) >= top_k and rank_key(light["step_time_s"], 0, 0, 0, ())[0] > keys[top_k - 1][0]:
            break
        try:
            validated = validate(_run_config(run, spec))
        except ConfigError:
            continue
        missing = unsupported_features(validated)
        if runnable_only and missing:
            continue
        est = estimate(validated, mixed=mixed, dp_overlap=dp_overlap)
        ok = est["memory_bytes"]["total"] <= allowance
        if est["fits"] and (ok or not within_auto_margin):
            c = {"spec": spec, "estimate": est, "unsupported": missing, "auto_ok": ok}
            key = sort_key(c)
            i = bisect.bisect(keys, key)
            keys.insert(i, key)
            picked.insert(i, c)
    if not picked:
        return []
    info = {
        "evaluated": stats["evaluated"],
        "fitting": len(found),
        "seconds": time.perf_counter() - started,
        "auto_memory_bytes": allowance,
    }
    return candidates(picked[:top_k], info)
