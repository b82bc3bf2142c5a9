"""Dynamic loss scaling for fp16 mixed precision (the scheme of Micikevicius et al. 2018, as
torch.amp.GradScaler and Megatron-LM run it).

fp16 activations' gradients underflow to zero below about 6e-8: the loss is multiplied by a large
scale S before backward, so every gradient in the graph is S times larger, and the fp32 parameter
gradients are divided by S before clipping and the optimizer step. When S was too large some
gradient overflows to inf/NaN: that step is skipped and S halved; after `window` steps in a row
without overflow S doubles.

Whether a step overflowed is read from the global gradient norm the trainer computes anyway
(`clip_gradients`: the same number on every rank, summed over every shard, stage and replica), so
all ranks skip the same steps without a collective of their own - unlike torch's GradScaler,
which looks only at this rank's gradients (FSDP/TP/PP shards differ per rank).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Optional


@dataclass
class DynamicLossScale:
    scale: float
    """Current multiplier of the loss."""
    window: int
    """Overflow-free steps before the scale doubles."""
    min_scale: float = 1.0
    """Never scale below this (a model that overflows at scale 1 has a real problem)."""
    good_steps: int = 0
    """Overflow-free steps since the last change of scale."""
    skipped_steps: int = 0
    """Steps skipped because their gradients overflowed (over the whole run)."""

    @classmethod
    def for_run(cls, train_cfg) -> Optional["DynamicLossScale"]:
        """A loss scale for fp16 runs; None for fp32 and bf16 (bf16 has fp32's exponent range)."""
        if train_cfg.precision != "fp16":
            return None
        return cls(scale=float(train_cfg.loss_scale_init), window=int(train_cfg.loss_scale_window))

    def update(self, grads_finite: bool) -> bool:
        """Record this step's outcome; returns whether the optimizer should step."""
        if not grads_finite:
            self.scale = max(self.min_scale, self.scale / 2)
            self.good_steps = 0
            self.skipped_steps += 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.window:
            self.scale *= 2
            self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))


def unscale_gradients(modules: Iterable, scale: float) -> None:
    """Divide every local gradient (each shard once) by the loss scale, in place."""
    inv = 1.0 / scale
    seen = set()
    for module in modules:
        for p in module.parameters():
            if p.grad is None or id(p) in seen:
                continue
            seen.add(id(p))
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            grad.mul_(inv)
