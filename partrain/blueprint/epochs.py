"""train.epochs turned into train.steps once the data is counted (pure: the preflight, the dry run
and every worker use the same rule, so they agree on the run's length)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

EPSILON = 1e-9
"""3.0 x 7 steps is 21 steps, not 22 after float rounding."""


def steps_for_epochs(epochs: float, steps_per_epoch: int) -> int:
    """ceil(epochs x steps_per_epoch), at least one step."""
    return max(1, math.ceil(epochs * steps_per_epoch - EPSILON))


def with_epochs_as_steps(v, steps_per_epoch: Optional[int]):
    """The ValidatedRun `v` with train.steps from train.epochs (unchanged when epochs is 0)."""
    t = v.run.train
    if t.epochs <= 0 or steps_per_epoch is None:
        return v
    train = dataclasses.replace(t, steps=steps_for_epochs(t.epochs, steps_per_epoch))
    return dataclasses.replace(v, run=dataclasses.replace(v.run, train=train))
