"""`parallel=auto`: the planner chooses the layout that `partrain train` runs.

The choice is the search's (`partrain.blueprint.planner.search`) over the layouts this version of
partrain can train, for the run's model, cluster, sequence length, sp, run settings and global batch:
the first candidate in the search's own order that is within auto's memory allowance, the one
`plan --search` marks first as within it ("auto" column, `auto_ok`). Beyond the search:

- the memory allowance keeps a safety margin: a candidate must be predicted at most
  (1 - parallel.auto_memory_margin) x device memory (never more than the planner's own usable 95%);
- degrees and choices given on the command line are fixed; everything else the recipe or the config
  groups say about the layout is only a starting point, replaced by the search.

The result is a ValidatedRun of the chosen layout (the resolved config keeps `parallel.auto: true`
beside the chosen degrees) and a plain record of the choice (chosen, runner-up, why, what was fixed)
that the launcher writes into the run folder and the run compares with what it measures.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Sequence

from partrain.blueprint.layout import divisors
from partrain.blueprint.planner.search import SearchSpace, auto_memory_fraction, search
from partrain.blueprint.planner.spec import GIB, rank_memory_gib
from partrain.errors import ConfigError, Problem

FIXABLE_KEYS = (
    "parallel.dp",
    "parallel.tp",
    "parallel.pp",
    "parallel.ep",
    "parallel.zero_stage",
    "parallel.recompute",
    "parallel.pp_schedule",
    "parallel.pp_virtual_stages",
    "parallel.tp_sequence_parallel",
    "train.micro_batch_size",
)
"""Keys a user may fix on the command line next to `parallel=auto`; the search fills in the others."""

CHOSEN_ONLY_KEYS = (
    "parallel.dp_shard",
    "parallel.recompute_every",
    "parallel.pp_layers_per_stage",
    "train.microbatches",
)
"""Layout keys the search always sets itself (shard over all of dp, every block, balanced stages,
microbatches from the global batch): fixing them next to `parallel=auto` is refused."""

_LAYOUT_FIELD = {
    "parallel.dp": "dp",
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.ep": "ep",
    "parallel.zero_stage": "zero_stage",
    "parallel.recompute": "recompute",
    "parallel.pp_schedule": "pp_schedule",
    "parallel.pp_virtual_stages": "pp_virtual_stages",
    "parallel.tp_sequence_parallel": "tp_sequence_parallel",
    "train.micro_batch_size": "micro_batch_size",
}
"""Fixable key -> its name in a search candidate's "layout"."""

RECORD_FILE = "auto_layout.json"
"""The run folder's record of a `parallel=auto` choice (written by the launcher, read by rank 0)."""

SLOWER_THAN_PLANNED = 1.3
"""A chosen layout whose measured step time is more than this times the predicted one is reported."""


def command_line_keys(overrides: Sequence[str]) -> List[str]:
    """The dotted keys set by command-line overrides (`parallel.tp=2`, `++train.x=1`), in order."""
    keys = []
    for text in overrides:
        key = text.split("=", 1)[0].strip().lstrip("+")
        if "=" in text and key not in keys:
            keys.append(key)
    return keys


def fixed_constraints(run, overrides: Sequence[str]) -> Dict[str, object]:
    """{key: value} of the layout keys fixed on the command line, values as the composed run holds them.
    `parallel.dp=-1` (whatever is left) fixes nothing."""
    keys = command_line_keys(overrides)
    refused = [k for k in keys if k in CHOSEN_ONLY_KEYS]
    if refused:
        raise ConfigError(
            [
                Problem(
                    key,
                    _value(run, key),
                    "parallel=auto sets this itself (sharding over all of dp, every block recomputed, balanced "
                    "stages, microbatches from the global batch)",
                    f"drop {key} from the command line, or drop parallel=auto and choose every degree",
                )
                for key in refused
            ]
        )
    fixed = {k: _value(run, k) for k in keys if k in FIXABLE_KEYS}
    if fixed.get("parallel.dp") == -1:
        fixed.pop("parallel.dp")
    return fixed


def _value(run, dotted: str):
    group, _, name = dotted.partition(".")
    return getattr(getattr(run, group), name)


def _space(fixed: Dict[str, object], world: int) -> SearchSpace:
    """Narrow the search to the fixed values where it has a knob for them (the rest is filtered after)."""
    one = lambda key: (fixed[key],) if key in fixed else None  # noqa: E731
    tp = one("parallel.tp")
    if tp is None and fixed.get("parallel.tp_sequence_parallel") is True:
        tp = tuple(d for d in divisors(world) if d > 1)  # Megatron-SP lives inside a TP group
    space = SearchSpace(
        tp=tp,
        pp=one("parallel.pp"),
        dp=one("parallel.dp"),
        micro_batch_sizes=one("train.micro_batch_size"),
        expert_parallel=one("parallel.ep"),
    )
    changes = {}
    if "parallel.zero_stage" in fixed:
        changes["zero_stages"] = (fixed["parallel.zero_stage"],)
    if "parallel.recompute" in fixed:
        changes["recompute"] = (fixed["parallel.recompute"],)
    if "parallel.pp_schedule" in fixed:
        changes["schedules"] = (fixed["parallel.pp_schedule"],)
    if "parallel.pp_virtual_stages" in fixed:
        changes["virtual_stages"] = (fixed["parallel.pp_virtual_stages"],)
    if "parallel.tp_sequence_parallel" in fixed:
        changes["sequence_parallel"] = (fixed["parallel.tp_sequence_parallel"],)
    return dataclasses.replace(space, **changes)


def _honours(candidate: dict, fixed: Dict[str, object]) -> bool:
    lay = candidate["layout"]
    for key, value in fixed.items():
        name = _LAYOUT_FIELD[key]
        if name == "pp_schedule" and lay["pp"] == 1:
            continue  # one stage has no schedule
        if name == "pp_virtual_stages" and lay["pp"] == 1 and value == 1:
            continue
        if lay[name] != value:
            return False
    return True


def _margin(run) -> float:
    margin = run.parallel.auto_memory_margin
    if not 0.0 <= margin < 1.0:
        raise ConfigError(
            Problem(
                "parallel.auto_memory_margin",
                margin,
                "must be a fraction of device memory in [0, 1)",
                "use e.g. parallel.auto_memory_margin=0.1 (keep 10% free)",
            )
        )
    return margin


def choose_layout(run, overrides: Sequence[str], mixed: str = "autocast"):
    """(ValidatedRun of the chosen layout, record of the choice). Raises ConfigError (exit 2) when no
    layout that `partrain train` can run fits with the fixed keys and the memory margin."""
    from partrain.blueprint.problems import ProblemCollector
    from partrain.blueprint.validate_elastic import elastic_problems

    # Before the search: a run the search could never validate would otherwise read "nothing fits".
    c = ProblemCollector()
    elastic_problems(c, run)
    if c.problems:
        raise ConfigError(c.problems)
    return choose_with_fixed(run, fixed_constraints(run, overrides), mixed)


def choose_with_fixed(run, fixed: Dict[str, object], mixed: str = "autocast"):
    """choose_layout with the fixed keys given as {key: value} (an elastic re-plan passes the original
    choice's). Raises ConfigError when nothing fits."""
    from partrain.blueprint.validate import validate

    margin = _margin(run)
    usable = auto_memory_fraction(margin)
    # The search on the real device, keeping only the candidates within the allowance: its order
    # does not depend on which candidates are present, so the first is `plan --search`'s first
    # candidate marked within the allowance.
    candidates = search(
        run,
        top_k=8,
        mixed=mixed,
        space=_space(fixed, run.cluster.nodes * run.cluster.devices_per_node),
        runnable_only=True,
        within_auto_margin=True,
    )
    candidates = [c for c in candidates if _honours(c, fixed)]
    if not candidates:
        raise ConfigError(_nothing_fits(run, fixed, usable))
    validated = validate(_with_layout(run, candidates[0]["layout"]))
    record = _record(validated, candidates[:2], fixed, margin, usable, mixed)
    return validated, record


def _with_layout(run, lay: dict):
    """The run with a candidate's layout, on the real cluster (the search saw a shrunken device)."""
    p = dataclasses.replace(
        run.parallel,
        dp=lay["dp"],
        tp=lay["tp"],
        pp=lay["pp"],
        sp=lay["sp"],
        ep=lay["ep"],
        zero_stage=lay["zero_stage"],
        dp_shard=-1,
        pp_schedule=lay["pp_schedule"] or run.parallel.pp_schedule,
        pp_virtual_stages=lay["pp_virtual_stages"],
        pp_layers_per_stage=None,
        tp_sequence_parallel=lay["tp_sequence_parallel"],
        recompute=lay["recompute"],
        recompute_every=1,
    )
    t = dataclasses.replace(run.train, micro_batch_size=lay["micro_batch_size"], microbatches=0)
    return dataclasses.replace(run, parallel=p, train=t)


def _nothing_fits(run, fixed: Dict[str, object], usable: float) -> Problem:
    world = run.cluster.nodes * run.cluster.devices_per_node
    cap = rank_memory_gib(run.cluster) * usable
    if fixed:
        what = ", ".join(f"{k}={v}" for k, v in fixed.items())
        return Problem(
            "parallel",
            "auto",
            f"no layout that partrain can train fits in {cap:.1f} GiB per device on {world} devices with {what} "
            f"fixed (global batch {run.train.global_batch_size}, sequence {run.train.seq_len})",
            f"drop some of {', '.join(fixed)} from the command line (`partrain plan --search` shows what fits)",
        )
    return Problem(
        "parallel",
        "auto",
        f"no layout that partrain can train fits in {cap:.1f} GiB per device on {world} devices "
        f"(global batch {run.train.global_batch_size}, sequence {run.train.seq_len})",
        "use more devices, a smaller train.global_batch_size or seq_len, or a smaller "
        "parallel.auto_memory_margin (`partrain plan --search --include-unsupported` shows more)",
    )


def _record(validated, picked: List[dict], fixed: Dict[str, object], margin: float, usable: float, mixed: str):
    from partrain.blueprint.planner.estimate import estimate

    chosen_est = estimate(validated, mixed=mixed)
    out = {
        "fixed": fixed,
        "memory_margin": margin,
        "usable_memory_gib": rank_memory_gib(validated.run.cluster) * usable,
        "device_memory_gib": rank_memory_gib(validated.run.cluster),
        "allowed_fraction": usable,
        "compute_source": chosen_est.get("compute_source"),
        "bandwidth_source": chosen_est.get("bandwidth_source"),
        "searched": picked[0]["search"],
        "chosen": _entry(picked[0], chosen_est),
        "runner_up": None,
    }
    if len(picked) > 1:
        out["runner_up"] = _entry(picked[1], picked[1]["estimate"])
    return out


def _entry(candidate: dict, est: dict) -> dict:
    # The choice line states memory against the allowance; the search's "fits (x of Y GiB)" would
    # repeat it, so keep only what follows.
    parts = candidate["why"].split("; ")
    if parts[0].startswith("fits ("):
        parts[0] = parts[0].partition(")")[2].strip()
    return {
        "layout": candidate["layout"],
        "overrides": candidate["overrides"],
        "why": "; ".join(p for p in parts if p),
        "step_time_s": est["step_time_s"],
        "tokens_per_s": est["tokens_per_s"],
        "memory_gib": est["memory_bytes"]["total"] / GIB,
    }


def choice_lines(record: dict) -> List[str]:
    """The choice in a few plain lines (the CLI prints them before the layout report or the launch)."""
    chosen = record["chosen"]
    lines = [
        f"parallel=auto chose: {short_layout(chosen['layout'])}: predicted {chosen['step_time_s']:.4g} s/step, "
        f"{chosen['tokens_per_s']:,.0f} tokens/s, {memory_phrase(record)}",
        f"  why: {chosen['why']}",
    ]
    if record["fixed"]:
        lines.append("  fixed on the command line: " + ", ".join(f"{k}={v}" for k, v in record["fixed"].items()))
    runner = record["runner_up"]
    if runner:
        lines.append(f"  runner-up: {short_layout(runner['layout'])}: {runner['why']}")
    else:
        lines.append("  runner-up: none (no other layout fits)")
    return lines


def memory_phrase(record: dict) -> str:
    """The chosen layout's memory in one phrase: "66.2 GiB of 79.6 GiB: 90% allowed for auto, 95% usable"."""
    from partrain.blueprint.planner.estimate import USABLE_MEMORY_FRACTION

    device = record.get("device_memory_gib") or record["usable_memory_gib"] / (1 - record["memory_margin"])
    allowed = record.get("allowed_fraction", 1 - record["memory_margin"])
    return (
        f"{record['chosen']['memory_gib']:.1f} GiB of {device:.1f} GiB: {allowed:.0%} allowed for auto, "
        f"{USABLE_MEMORY_FRACTION:.0%} usable"
    )


def short_layout(lay: dict) -> str:
    """A candidate's layout in one phrase: "dp4 x tp8+sp x pp2, zero 3, recompute none, ..."."""
    parts = [f"dp{lay['dp']}", f"tp{lay['tp']}" + ("+sp" if lay["tp_sequence_parallel"] else ""), f"pp{lay['pp']}"]
    if lay["sp"] > 1:
        parts.append(f"sp{lay['sp']}")
    if lay["ep"] > 1:
        parts.append(f"ep{lay['ep']}")
    text = " x ".join(parts) + f", zero {lay['zero_stage']}, recompute {lay['recompute']}"
    text += f", micro batch {lay['micro_batch_size']}"
    if lay["pp"] > 1:
        v = lay["pp_virtual_stages"]
        text += f", {lay['pp_schedule']}" + (f" v{v}" if v > 1 else "")
    return text


def resolve_layout(run, overrides: Sequence[str]):
    """(ValidatedRun, choice record or None): the planner's choice under `parallel=auto`, else the run's
    own layout validated. Raises ConfigError."""
    if run.parallel.auto:
        return choose_layout(run, overrides)
    from partrain.blueprint.validate import validate

    return validate(run), None
