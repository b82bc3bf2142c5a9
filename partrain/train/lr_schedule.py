"""The learning-rate schedule: transformers' schedule functions (LambdaLR underneath), kept in checkpoints.

partrain's optimizers include wrappers torch's schedulers do not accept (ZeRO-1's `ShardedOptimizer`,
the expert split), so the scheduler drives a one-group "clock" optimizer that holds no parameter, and
the loop copies its learning rate into every group of the real optimizer before each step (`set_lr`).
The schedule is read one step ahead: optimizer step s (0-based) runs at the schedule's value for s+1,
so the first step trains at lr/warmup_steps instead of 0 and the last one reaches min_lr_ratio.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.optim.lr_scheduler import LambdaLR

from partrain.blueprint.config.schema import OptimConfig


def decay_steps(cfg: OptimConfig, total_steps: int) -> int:
    """wsd: steps of the final decay (at least one)."""
    return max(1, round(cfg.decay_fraction * total_steps))


def _scheduler(clock: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> LambdaLR:
    from transformers import (
        get_constant_schedule_with_warmup,
        get_cosine_with_min_lr_schedule_with_warmup,
        get_wsd_schedule,
    )

    warmup = cfg.warmup_steps
    if cfg.schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(clock, warmup, total_steps, min_lr_rate=cfg.min_lr_ratio)
    if cfg.schedule == "constant":
        return get_constant_schedule_with_warmup(clock, warmup)
    if cfg.schedule == "linear":  # wsd without a stable phase: linear warmup, linear decay to min_lr_ratio
        decay = max(1, total_steps - warmup)
        return get_wsd_schedule(
            clock, warmup, decay, num_stable_steps=0, min_lr_ratio=cfg.min_lr_ratio, decay_type="linear"
        )
    if cfg.schedule == "wsd":
        decay = decay_steps(cfg, total_steps)
        stable = max(0, total_steps - warmup - decay)
        return get_wsd_schedule(
            clock, warmup, decay, num_stable_steps=stable, min_lr_ratio=cfg.min_lr_ratio, decay_type="linear"
        )
    raise ValueError(f"unknown optim.schedule {cfg.schedule!r}")


class LRSchedule:
    """The learning rate of each optimizer step, and its state for checkpoints."""

    def __init__(self, cfg: OptimConfig, total_steps: int) -> None:
        self.clock = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
        self.scheduler = _scheduler(self.clock, cfg, total_steps)
        self.clock.step()  # no gradient, no update: tells torch the optimizer steps before its scheduler
        self.scheduler.step()  # one step ahead (module docstring)

    def lr(self) -> float:
        """The learning rate of the next optimizer step."""
        return float(self.scheduler.get_last_lr()[0])

    def step(self) -> None:
        self.scheduler.step()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load(self, state: Optional[dict], step: int) -> None:
        """Continue after optimizer step `step`: from the checkpoint's scheduler state, or (a checkpoint
        written before schedules were saved) by stepping the fresh schedule forward."""
        if state is not None:
            self.scheduler.load_state_dict(state)
            return
        for _ in range(step):
            self.scheduler.step()


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
