"""torch's own per-rank action orders, to draw the exact schedule at run time."""

from __future__ import annotations

from partrain.blueprint.stage_split import (
    SCHEDULE_CLASS,
)


def torch_rank_orders(schedule: str, pp: int, v: int, n_microbatches: int):
    """torch's own per-rank action order for `schedule`, as `schedule_sim.Action`s (imports torch;
    DualPipeV's overlapped F+B pairs are listed as their F then their B). Pass the result to
    `schedule_sim.schedule_grid(..., orders=...)` for an exact picture at run time."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from partrain.blueprint.schedule_sim import Action

    name = SCHEDULE_CLASS[schedule][len("Schedule") :]
    if schedule == "1f1b":  # torch's IR for single-stage 1F1B is not what it executes; use ours
        from partrain.blueprint.schedule_sim import rank_orders

        return rank_orders(schedule, pp, 1, n_microbatches)
    ops = get_schedule_ops(name, pp, n_microbatches, None if schedule == "gpipe" else v)
    out = []
    for row in ops:
        actions = []
        for a in row:
            if a is None:
                continue
            for sub in a.sub_actions or (a,):
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    actions.append(Action(kind, sub.microbatch_index, sub.stage_index))
        out.append(actions)
    return out
