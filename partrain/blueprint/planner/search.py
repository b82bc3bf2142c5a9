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
import copy
import dataclasses
import math
import time
from typing import Iterator, List, Optional, Tuple

from partrain.blueprint.layout import divisors
from partrain.blueprint.planner.estimate import USABLE_MEMORY_FRACTION, estimate, estimate_spec
from partrain.blueprint.planner.spec import GIB, PlanSpec, rank_memory_gib, spec_from_run
from partrain.blueprint.trainable import zero1_with_tp_unsupported
from partrain.errors import ConfigError, Problem

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

NEAR_TIE = 1e-4
"""Step times within this relative distance rank as ties (fixed buckets: see `rank_key`)."""


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


def rank_key(step_time_s: float, unsupported: int, microbatches: int, memory: float, override_text: Tuple[str, ...]):
    """The search's order of candidates (module docstring): a total order that does not depend on
    which other candidates are present."""
    bucket = math.floor(math.log(step_time_s) / math.log1p(NEAR_TIE)) if step_time_s > 0 else -(10**9)
    return (bucket, unsupported, microbatches, memory, override_text)


def _key(c: dict):
    est = c["estimate"]
    return rank_key(
        est["step_time_s"],
        len(c["unsupported"]),
        c["spec"].microbatches,
        est["memory_bytes"]["total"],
        tuple(overrides(c["spec"])),
    )


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


def describe(spec: PlanSpec) -> dict:
    return {
        "dp": spec.dp,
        "tp": spec.tp,
        "pp": spec.pp,
        "sp": spec.sp,
        "ep": spec.ep,
        "zero_stage": spec.zero_stage,
        "recompute": spec.recompute,
        "micro_batch_size": spec.mbs,
        "microbatches": spec.microbatches,
        "pp_schedule": spec.schedule if spec.pp > 1 else None,
        "pp_virtual_stages": spec.v,
        "tp_sequence_parallel": spec.tp_sp,
    }


def overrides(spec: PlanSpec) -> List[str]:
    """Command-line overrides that select this layout (for `partrain train ...`)."""
    out = [
        f"parallel.dp={spec.dp}",
        f"parallel.tp={spec.tp}",
        f"parallel.pp={spec.pp}",
        f"parallel.sp={spec.sp}",
        f"parallel.ep={spec.ep}",
        f"parallel.zero_stage={spec.zero_stage}",
        "parallel.dp_shard=-1",
        f"parallel.recompute={spec.recompute}",
        f"parallel.tp_sequence_parallel={str(spec.tp_sp).lower()}",
        f"train.micro_batch_size={spec.mbs}",
        f"train.global_batch_size={spec.global_batch}",
        "train.microbatches=0",
    ]
    if spec.pp > 1:
        out += [f"parallel.pp_schedule={spec.schedule}", f"parallel.pp_virtual_stages={spec.v}"]
    return out


def why(spec: PlanSpec, est: dict, best: Optional[dict]) -> str:
    """One line: what this layout does well, and (for a runner-up) what costs it time vs the best."""
    mem = est["memory_bytes"]["total"] / GIB
    cap = spec.cluster.device_memory_bytes / GIB
    tb = est["time_breakdown_s"]
    step = est["step_time_s"]
    comm = sum(tb[k] for k in ("tp", "sp", "ep", "pp", "dp_exposed"))
    parts = [
        f"fits ({mem:.1f} of {cap:.1f} GiB)"
        + (" without recompute" if spec.recompute == "none" else f" with {spec.recompute} recompute")
    ]
    if spec.zero_stage:
        parts.append(f"ZeRO-{spec.zero_stage} over {spec.shard}")
    if spec.pp > 1:
        sched = "interleaved x%d" % spec.v if spec.v > 1 else "1F1B"
        parts.append(f"bubble {est['pipeline_bubble_fraction']:.1%} ({sched}, {spec.microbatches} microbatches)")
    else:
        parts.append("no pipeline bubble")
    if spec.tp > 1:
        where = "inside a node" if est.get("links", {}).get("tp", "intra").startswith("intra") else "across nodes"
        parts.append(f"TP{spec.tp} {where}" + (" + SP" if spec.tp_sp else ""))
    parts.append(f"exposed comm {comm / step:.1%} of step")
    text = "; ".join(parts)
    if best is not None and best["step_time_s"] > 0:
        reasons = _worse_parts(est, best)
        text += f"; {step / best['step_time_s'] - 1:+.1%} vs #1" + (
            f" (more {', '.join(reasons[:2])})" if reasons else ""
        )
    return text


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
            key = _key(c)
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
    return _candidates(picked[:top_k], info)


def _candidates(picked: List[dict], info: dict) -> List[dict]:
    """The report's candidate list (already in `rank_key` order), with the reasons."""
    out: List[dict] = []
    best = picked[0]["estimate"]
    for i, c in enumerate(picked):
        spec, est = c["spec"], c["estimate"]
        text = why(spec, est, None if i == 0 else best)
        if i == 0 and len(picked) > 1:
            text += "; " + _lead(picked[0], picked[1])
        out.append(
            {
                "rank": i + 1,
                "layout": describe(spec),
                "overrides": overrides(spec),
                "estimate": est,
                "why": text,
                "why_short": why_short(picked, i),
                "auto_ok": c["auto_ok"],
                "unsupported": c["unsupported"],
                "search": info,
            }
        )
    return out


def why_short(picked: List[dict], i: int) -> str:
    """At most about 40 characters: the candidate's main trade-off against #1 (for #1: against #2)."""
    if len(picked) == 1:
        return "the only layout listed"
    me = picked[i]
    other = picked[1] if i == 0 else picked[0]
    a, b = me["estimate"], other["estimate"]
    if _key(me)[0] == _key(other)[0]:
        if len(me["unsupported"]) != len(other["unsupported"]):
            what = "trainable now" if len(me["unsupported"]) < len(other["unsupported"]) else "not trainable yet"
        elif me["spec"].microbatches != other["spec"].microbatches:
            what = "fewer microbatches" if me["spec"].microbatches < other["spec"].microbatches else "more microbatches"
        elif a["memory_bytes"]["total"] != b["memory_bytes"]["total"]:
            what = "less memory" if a["memory_bytes"]["total"] < b["memory_bytes"]["total"] else "more memory"
        else:
            return f"ties #{2 if i == 0 else 1}"
        return f"ties #{2 if i == 0 else 1}: {what}"
    if i == 0:
        ahead = b["step_time_s"] / a["step_time_s"] - 1
        reasons = [SHORT_LABELS[r] for r in _worse_parts(b, a)]
        return f"{ahead:.1%} ahead of #2" + (f": less {reasons[0]}" if reasons else "")
    behind = a["step_time_s"] / b["step_time_s"] - 1
    reasons = [SHORT_LABELS[r] for r in _worse_parts(a, b)]
    return f"+{behind:.1%}" + (f": more {' and '.join(reasons[:2])}" if reasons else "")


SHORT_LABELS = {
    "bubble": "bubble",
    "compute/recompute": "compute",
    "TP traffic": "TP comm",
    "DP traffic": "DP comm",
    "pipeline sends": "PP sends",
    "EP traffic": "EP comm",
    "SP traffic": "SP comm",
}
"""`_worse_parts`' labels in the few characters of a short "why"."""


def _lead(first: dict, second: dict) -> str:
    best, other = first["estimate"], second["estimate"]
    ahead = other["step_time_s"] / best["step_time_s"] - 1
    if ahead < 1e-4:
        if len(first["unsupported"]) < len(second["unsupported"]):
            return "ties #2 on time and this version of partrain can train more of it"
        if first["spec"].microbatches < second["spec"].microbatches:
            return "ties #2 on time with fewer, larger microbatches (less per-microbatch overhead)"
        return (
            "ties #2 on time with less memory"
            if best["memory_bytes"]["total"] < other["memory_bytes"]["total"]
            else "ties #2"
        )
    reasons = _worse_parts(other, best)
    return f"{ahead:.1%} faster than #2" + (f" (less {', '.join(reasons[:2])})" if reasons else "")


def _worse_parts(est: dict, ref: dict) -> List[str]:
    tb, rb = est["time_breakdown_s"], ref["time_breakdown_s"]
    diffs = []
    for key, label in (
        ("bubble", "bubble"),
        ("compute", "compute/recompute"),
        ("tp", "TP traffic"),
        ("dp_exposed", "DP traffic"),
        ("pp", "pipeline sends"),
        ("ep", "EP traffic"),
        ("sp", "SP traffic"),
    ):
        diff = tb[key] - rb[key]
        if diff > 0.002 * ref["step_time_s"]:
            diffs.append((diff, label))
    diffs.sort(reverse=True)
    return [label for _, label in diffs]
