"""The worker's side of an elastic run: re-plan for the world torchrun started, agree, record changes.

torchrun restarts the workers of an elastic run (cluster.min_nodes < cluster.nodes) when a node is
lost or joins, with WORLD_SIZE the processes now present. The run folder's config.yaml states the
layout chosen for all `cluster.nodes`; on another world every rank re-plans
(partrain.blueprint.planner.relayout) with the fixed keys of the original `parallel=auto` choice
(auto_layout.json), and the ranks check they reached the same layout.

Every layout change (the layout resumed into differs from the one the checkpoint was saved under)
is one entry of a history carried inside the checkpoints (so it survives rank 0 moving to another
node) and written by rank 0 to RUN_DIR/layout_changes.jsonl; the summary lists it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import List, Optional

from partrain.blueprint.planner.relayout import change_reason, layout_brief, replan, short
from partrain.blueprint.validate_elastic import is_elastic
from partrain.train.auto_check import read_auto_record

log = logging.getLogger("partrain")

CHANGES_FILE = "layout_changes.jsonl"
"""RUN_DIR/layout_changes.jsonl: one JSON object per layout change (rank 0's node)."""

PEER_LEFT_EXIT = 75
"""A rank of an elastic run that stopped because other ranks were stopped (their node is being taken
away) exits with this, after the shared checkpoint: torchrun then restarts this node's workers."""


def layout_for_world(v, run_dir: Path, world_size: int):
    """(ValidatedRun for `world_size` processes, {dropped fixed key: value}). The run's own layout when
    the world is the configured one; a re-plan for an elastic run; RuntimeError otherwise."""
    if world_size == v.world_size:
        return v, {}
    if not is_elastic(v.run.cluster):
        raise RuntimeError(f"the layout needs {v.world_size} processes but the launcher started {world_size}")
    record = read_auto_record(run_dir) or {}
    new, _, dropped = replan(v.run, record.get("fixed", {}), world_size)
    log.info("elastic: %d processes instead of %d; re-planned to %s", world_size, v.world_size, layout_brief(new))
    return new, dropped


def restarted(v, world_size: int, restart_count: int) -> bool:
    """Whether this attempt continues an earlier one (resume from the newest checkpoint). Elastic runs
    first check that every rank re-planned alike, then ask every rank (collectives)."""
    if not is_elastic(v.run.cluster):
        return restart_count > 0
    agree(v, world_size)
    return any_restarted(restart_count)


def resume(checkpoints, v, dropped: dict, run_dir: Optional[Path]):
    """(step to continue after, LayoutHistory): resume through `checkpoints` (the run's
    partrain.checkpoint.manager.CheckpointManager), note a layout change against the checkpoint's
    layout, and (run_dir given: rank 0) write the history."""
    history = checkpoints.history = LayoutHistory(v, dropped)
    step = checkpoints.resume()
    changed = history.resumed(checkpoints.resumed_extra, checkpoints.last[1], step)
    if changed and run_dir is not None:
        history.write(run_dir)
    return step, history


def peers_left(v, state, stop) -> bool:
    """An elastic run stopped by other ranks' stop signal (their node is being taken away), not by one
    of its own: this node's workers must end so that torchrun restarts them on the nodes that remain."""
    if not (state.stopped and is_elastic(v.run.cluster)) or (stop is not None and stop.signum):
        return False
    log.warning("elastic: other ranks stopped after step %d; restarting on the remaining nodes", state.step)
    return True


def agree(v, world_size: int) -> None:
    """Every rank must have reached the same layout (collective); RuntimeError naming both otherwise."""
    import torch.distributed as dist

    mine = json.dumps(layout_brief(v), sort_keys=True)
    everyone: list = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if len(set(everyone)) > 1:
        raise RuntimeError(f"elastic re-plan: the ranks chose different layouts: {sorted(set(everyone))}")


def any_restarted(restart_count: int) -> bool:
    """Whether torchrun restarted any rank's node (collective). A node that joins an elastic run starts
    its agent afresh (restart count 0) while the others were restarted: all must resume alike."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([restart_count], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) > 0


class LayoutHistory:
    """The layout changes of a run, carried in the checkpoints' trainer JSON ("layout", "layout_changes")."""

    def __init__(self, v, dropped: Optional[dict] = None) -> None:
        self.current = layout_brief(v)
        self.dropped = dropped or {}
        self.changes: List[dict] = []

    def extra(self) -> dict:
        """What every checkpoint saves about the layout."""
        return {"layout": self.current, "layout_changes": self.changes}

    def resumed(self, extra: dict, checkpoint: Optional[Path], step: int) -> Optional[dict]:
        """After loading a checkpoint: the change from the layout it was saved under, if any (also kept)."""
        self.changes = list(extra.get("layout_changes", []))
        old = extra.get("layout") or _saved_layout(checkpoint)
        if not old or _same(old, self.current):
            return None
        change = {
            "step": step,
            "old": old,
            "new": self.current,
            "reason": change_reason(old, self.current, self.dropped),
            "checkpoint": str(checkpoint) if checkpoint else None,
            "dropped_fixed": self.dropped,
        }
        self.changes.append(change)
        log.warning("layout change at step %d: %s -> %s; %s", step, short(old), short(self.current), change["reason"])
        return change

    def write(self, run_dir: Path) -> None:
        """Rank 0: the whole history into RUN_DIR/layout_changes.jsonl (replaced atomically)."""
        path = Path(run_dir) / CHANGES_FILE
        tmp = path.with_name(f".{CHANGES_FILE}.tmp")
        tmp.write_text("".join(json.dumps(c) + "\n" for c in self.changes))
        os.replace(tmp, path)


_COMPARED = ("world_size", "dp", "tp", "pp", "sp", "ep", "zero_stage", "micro_batch_size")


def _same(old: dict, new: dict) -> bool:
    return all(old[k] == new.get(k) for k in _COMPARED if k in old)


def _saved_layout(checkpoint: Optional[Path]) -> Optional[dict]:
    """A checkpoint saved before layout histories existed: its partrain.json's degrees and world."""
    if checkpoint is None:
        return None
    try:
        record = json.loads((Path(checkpoint) / "partrain.json").read_text())
    except (OSError, ValueError):
        return None
    lay = record.get("layout") or {}
    if "world_size" not in record:
        return None
    return {"world_size": record["world_size"], **{k: lay.get(k) for k in ("dp", "tp", "pp", "sp", "ep")}}
