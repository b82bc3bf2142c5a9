"""The search's candidates: their order (`rank_key`), the layout and overrides of each, and why it ranks
where it does (the full trade-off and a short line against #1 or #2)."""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

from partrain.blueprint.planner.spec import GIB, PlanSpec

NEAR_TIE = 1e-4
"""Step times within this relative distance rank as ties (fixed buckets: see `rank_key`)."""


def rank_key(step_time_s: float, unsupported: int, microbatches: int, memory: float, override_text: Tuple[str, ...]):
    """The search's order of candidates (search.py's docstring): a total order that does not depend on
    which other candidates are present."""
    bucket = math.floor(math.log(step_time_s) / math.log1p(NEAR_TIE)) if step_time_s > 0 else -(10**9)
    return (bucket, unsupported, microbatches, memory, override_text)


def sort_key(c: dict):
    est = c["estimate"]
    return rank_key(
        est["step_time_s"],
        len(c["unsupported"]),
        c["spec"].microbatches,
        est["memory_bytes"]["total"],
        tuple(overrides(c["spec"])),
    )


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


def candidates(picked: List[dict], info: dict) -> List[dict]:
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
    if sort_key(me)[0] == sort_key(other)[0]:
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
