"""An elastic run's new layout for the processes present after torchrun restarted it.

The same rules as `parallel=auto` (partrain.blueprint.planner.auto): the planner's search on the run
with `cluster.nodes` = the nodes now present, the global batch unchanged, the keys the user fixed on
the original command line kept fixed. When a fixed key cannot be kept on the new world (tp=4 on
fewer devices than a node holds, say), it is dropped and the change says so. Pure and deterministic:
every rank computes the same layout from the same config (the worker also checks that they agree).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from partrain.blueprint.planner.auto import choose_with_fixed
from partrain.errors import ConfigError, Problem


def nodes_for_world(run, world_size: int) -> int:
    per_node = run.cluster.devices_per_node
    if world_size < 1 or world_size % per_node:
        raise ConfigError(
            Problem(
                "cluster.devices_per_node",
                per_node,
                f"the restarted job has {world_size} processes, not a whole number of nodes of {per_node}",
                "start every node with cluster.devices_per_node processes",
            )
        )
    return world_size // per_node


def replan(run, fixed: Dict[str, object], world_size: int, mixed: str = "autocast") -> Tuple[object, dict, dict]:
    """(ValidatedRun, choice record, {dropped fixed key: value}) for `world_size` processes.

    Keeps as many fixed keys as fit: all of them, else all but one (the first that can go, in the
    order they were given), else none. Raises ConfigError when no layout fits even then."""
    nodes = nodes_for_world(run, world_size)
    cluster = dataclasses.replace(
        run.cluster, nodes=nodes, node_rank=0, min_nodes=min(run.cluster.min_nodes or nodes, nodes)
    )
    on_world = dataclasses.replace(run, cluster=cluster)
    attempts: List[Dict[str, object]] = [dict(fixed)]
    attempts += [{k: v for k, v in fixed.items() if k != drop} for drop in fixed]
    if len(fixed) > 1:
        attempts.append({})
    last = None
    for kept in attempts:
        try:
            validated, record = choose_with_fixed(on_world, kept, mixed)
        except ConfigError as err:
            last = err
            continue
        dropped = {k: v for k, v in fixed.items() if k not in kept}
        return validated, record, dropped
    assert last is not None
    raise last


def layout_brief(validated) -> dict:
    """The degrees and batch split of a layout, as the layout-change record states them."""
    lay, p, t = validated.layout, validated.run.parallel, validated.run.train
    return {
        "world_size": lay.world_size,
        "dp": lay.dp,
        "tp": lay.tp,
        "pp": lay.pp,
        "sp": lay.sp,
        "ep": lay.ep,
        "zero_stage": p.zero_stage,
        "micro_batch_size": t.micro_batch_size,
        "microbatches": validated.microbatches,
        "global_batch_size": validated.global_batch_size,
    }


def short(brief: dict) -> str:
    """`8 processes: dp8 x tp1 x pp1` (sp/ep only when used)."""
    text = f"{brief['world_size']} processes: dp{brief['dp']} x tp{brief['tp']} x pp{brief['pp']}"
    text += f" x sp{brief['sp']}" if brief.get("sp", 1) > 1 else ""
    text += f", ep{brief['ep']}" if brief.get("ep", 1) > 1 else ""
    return text


def change_reason(old: dict, new: dict, dropped: Dict[str, object]) -> str:
    """Why the layout changed, in words."""
    if new["world_size"] < old["world_size"]:
        why = f"the job restarted on {new['world_size']} of {old['world_size']} processes (a node left)"
    elif new["world_size"] > old["world_size"]:
        why = f"the job restarted on {new['world_size']} processes, {old['world_size']} before (a node joined)"
    else:
        why = "re-planned on the same number of processes"
    if dropped:
        kept_not = ", ".join(f"{k}={v}" for k, v in dropped.items())
        why += f"; fixed {kept_not} could not be kept on {new['world_size']} processes and was left to the planner"
    return why


def layout_change_text(change: dict) -> str:
    """One line for a recorded change: `8 processes: dp8 x tp1 x pp1 -> 4 processes: ...; reason`."""
    return f"{short(change['old'])} -> {short(change['new'])}; {change['reason']}"
