"""Automatic layout search: every valid layout of a run's model, cluster and global batch, ranked by
predicted step time.

Enumerated (the global batch, sequence length, context-parallel degree and precision stay fixed):

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

Pruning that never drops a better layout under the model: a (layout, micro batch, schedule) that
does not fit even at ZeRO-3 with full recompute is skipped whole, and then so are larger micro
batches (memory grows with them); for each ZeRO stage only the lightest recompute policy that fits
is kept (heavier ones only add compute), and a higher ZeRO stage is tried only with a lighter
recompute than a lower stage already fitted with (it only adds traffic). `prune=False` lists every
fitting layout (tests check that set against the validator). Candidates are estimated from plain
`PlanSpec`s; only the ones reported are rebuilt as RunConfigs (`dataclasses.replace`) and passed through
`partrain.blueprint.validate.validate`, then estimated again from the validated run, so every
reported layout is one `partrain train` accepts as consistent.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterator, List, Optional, Tuple

from partrain.blueprint.layout import divisors
from partrain.blueprint.planner.estimate import estimate, estimate_spec
from partrain.blueprint.planner.spec import GIB, PlanSpec, spec_from_validated

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
    from partrain.blueprint.trainable import zero1_with_tp_unsupported

    return not zero1_with_tp_unsupported(spec.zero_stage, spec.tp)


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


def enumerate_specs(
    base: PlanSpec,
    space: SearchSpace = SearchSpace(),
    allow_tp_across_nodes: bool = False,
    stats: Optional[dict] = None,
    prune: bool = True,
) -> Iterator[Tuple[PlanSpec, dict]]:
    """Yield (spec, light estimate) for every layout that fits (see module docstring);
    stats["evaluated"] counts the estimates made. prune=False skips the dominance pruning and
    yields every fitting layout (tests use it to check completeness)."""
    stats = stats if stats is not None else {}
    stats.setdefault("evaluated", 0)
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
            if G % dp or (space.dp is not None and dp not in space.dp):
                continue
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
                        layouts = dict(
                            tp=tp,
                            pp=pp,
                            dp=dp,
                            ep=ep,
                            dp_shard=dp,
                            tp_sp=tp_sp,
                            mbs=mbs,
                            layers_per_chunk=None,
                            recompute_every=1,
                        )
                        any_fit = False
                        for spec, est in _fitting_at(base, space, layouts, zeros, stats, prune):
                            any_fit = True
                            yield spec, est
                        if prune and not any_fit:
                            break  # a larger micro batch needs more memory still


def _fitting_at(
    base: PlanSpec, space: SearchSpace, layout: dict, zeros: List[int], stats: dict, prune: bool
) -> Iterator[Tuple[PlanSpec, dict]]:
    """The fitting (schedule, ZeRO stage, recompute) choices for one set of degrees and micro batch."""
    m = base.global_batch // (layout["dp"] * layout["mbs"])
    for schedule, v in _schedules(layout["pp"], m, base.facts.n_layers, space):
        frugal = dataclasses.replace(
            base, **layout, zero_stage=max(zeros), recompute=space.recompute[-1], schedule=schedule, v=v
        )
        stats["evaluated"] += 1
        if prune and not estimate_spec(frugal, detail=False)["fits"]:
            continue  # nothing lighter on memory exists for this schedule and micro batch
        # A higher ZeRO stage only adds traffic, so it is worth trying only with a lighter
        # recompute than a lower stage already fitted with.
        lightest = len(space.recompute)
        for zero in zeros:
            for i, rec in enumerate(space.recompute[:lightest]):
                spec = dataclasses.replace(base, **layout, zero_stage=zero, recompute=rec, schedule=schedule, v=v)
                if space.runnable_only and not _trainable(spec):
                    break  # every recompute of this ZeRO stage is as untrainable
                est = estimate_spec(spec, detail=False)
                stats["evaluated"] += 1
                if est["fits"]:
                    yield spec, est
                    if prune:
                        lightest = i
                        break  # heavier recompute only adds compute
            if prune and lightest == 0:
                break


def base_spec(v_or_run, mixed: str = "autocast", dp_overlap: bool = True) -> PlanSpec:
    """What the search keeps of a run: model, cluster, sequence length, context-parallel degree and
    mode, precision and global batch. Accepts a ValidatedRun, or a RunConfig whose own layout need
    not be valid (say, degrees written for another cluster); then the global batch must be stated."""
    if hasattr(v_or_run, "layout"):
        return spec_from_validated(v_or_run, mixed=mixed, dp_overlap=dp_overlap)
    from partrain.blueprint.model_facts import model_facts
    from partrain.blueprint.planner.spec import cluster_spec, model_extras
    from partrain.errors import ConfigError, Problem

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
    facts = model_facts(run.model.arch, run.model.config, run.model.pretrained)
    cl = run.cluster
    sp = max(1, run.parallel.sp)
    world = cl.nodes * cl.devices_per_node
    return PlanSpec(
        facts=facts,
        extras=model_extras(run.model.arch, run.model.config, run.model.pretrained, facts),
        cluster=cluster_spec(cl),
        tp=1,
        pp=1,
        dp=max(1, world // sp),
        sp=sp,
        order=tuple(run.parallel.order),
        sp_mode=run.parallel.sp_mode,
        seq=run.train.seq_len,
        mbs=1,
        global_batch=run.train.global_batch_size,
        precision=run.train.precision,
        mixed=mixed,
        dp_overlap=dp_overlap,
        moe_capacity_factor=run.parallel.moe_capacity_factor,
        loss_chunk_tokens=run.train.loss_chunk_tokens,
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
) -> List[dict]:
    """The best `top_k` fitting layouts for the run's model, cluster and global batch, best first.

    `v` is a ValidatedRun, or a RunConfig whose own layout may be invalid (see `base_spec`).

    Each candidate: {"rank", "layout" (degrees, zero stage, recompute, micro batch, schedule, v),
    "overrides" (to paste after `partrain train recipe=...`), "estimate" (as `estimate`), "why",
    "unsupported" (features this partrain version cannot train yet; empty = runnable), "search"
    (layouts evaluated and fitting, seconds)}. Near-ties (within 0.01% of step time) list runnable
    layouts first, then the ones needing less memory. `runnable_only` drops the others.
    """
    from partrain.blueprint.trainable import unsupported_features
    from partrain.blueprint.validate import validate
    from partrain.errors import ConfigError

    started = time.perf_counter()
    if runnable_only:
        space = dataclasses.replace(space, runnable_only=True)
    run = getattr(v, "run", v)
    base = base_spec(v, mixed=mixed, dp_overlap=dp_overlap)
    stats = {"evaluated": 0}
    found = list(enumerate_specs(base, space, run.cluster.allow_tp_across_nodes, stats))
    found.sort(key=lambda item: (item[1]["step_time_s"], item[1]["memory_bytes"]["total"]))
    picked: List[dict] = []
    seen = set()
    for spec, light in found:
        # Validate lazily: stop once top_k are found and the rest are clearly slower (near-ties are
        # still collected so that runnable layouts can be listed first among them).
        if len(picked) >= top_k and light["step_time_s"] > picked[top_k - 1]["estimate"]["step_time_s"] * 1.0001:
            break
        key = tuple(describe(spec).values())
        if key in seen:
            continue
        seen.add(key)
        try:
            validated = validate(_run_config(run, spec))
        except ConfigError:
            continue
        missing = unsupported_features(validated)
        if runnable_only and missing:
            continue
        est = estimate(validated, mixed=mixed, dp_overlap=dp_overlap)
        if est["fits"]:
            picked.append({"spec": spec, "estimate": est, "unsupported": missing})
            picked.sort(key=lambda c: c["estimate"]["step_time_s"])
    if not picked:
        return []
    return _candidates(picked, top_k, stats["evaluated"], len(found), time.perf_counter() - started)


def _candidates(picked: List[dict], top_k: int, evaluated: int, fitting: int, elapsed: float) -> List[dict]:
    """The report's candidate list: near-ties (0.01% of step time) runnable first, then with fewer
    microbatches (the model charges no per-microbatch overhead; real runs pay one: kernel launches,
    Python, smaller matmuls), then lighter."""
    fastest = picked[0]["estimate"]["step_time_s"]
    picked.sort(
        key=lambda c: (
            round(c["estimate"]["step_time_s"] / fastest, 4),
            len(c["unsupported"]),
            c["spec"].microbatches,
            c["estimate"]["memory_bytes"]["total"],
        )
    )
    picked = picked[:top_k]
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
                "unsupported": c["unsupported"],
                "search": {"evaluated": evaluated, "fitting": fitting, "seconds": elapsed},
            }
        )
    return out


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
