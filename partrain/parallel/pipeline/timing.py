"""Where one pipeline step's time went on a rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict


@dataclass
class StepTiming:
    """Where one pipeline step's time went on this rank (seconds)."""

    wall: float = 0.0
    """Time inside the schedule's step (forward, backward, waits, sends)."""
    forward: float = 0.0
    backward: float = 0.0
    """Full backward, or the input-gradient part (I) for zero-bubble schedules."""
    weight: float = 0.0
    """Weight-gradient part (W) of zero-bubble schedules."""
    loss: float = 0.0
    calls: Dict[str, int] = field(default_factory=dict)

    @property
    def busy(self) -> float:
        return self.forward + self.backward + self.weight + self.loss

    @property
    def idle(self) -> float:
        return max(0.0, self.wall - self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Share of the step this rank was not computing (the measured bubble)."""
        return self.idle / self.wall if self.wall > 0 else 0.0

    def to_json(self) -> dict:
        return {
            "wall_s": self.wall,
            "busy_s": self.busy,
            "idle_s": self.idle,
            "forward_s": self.forward,
            "backward_s": self.backward,
            "weight_s": self.weight,
            "loss_s": self.loss,
            "bubble_fraction": self.bubble_fraction,
            "calls": dict(self.calls),
        }
