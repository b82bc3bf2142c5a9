"""Validation of the profiling switches of `train` (`train.profile_steps`, `train.memory_history`),
checked with the rest before any process starts."""

from __future__ import annotations

from partrain.blueprint.config.schema import RunConfig
from partrain.blueprint.problems import ProblemCollector


def _suggested_steps(steps: int) -> str:
    """A window that fits a run of `steps` steps: after the first step (start-up, compilation) when
    there is one, two steps long when there are two."""
    first = 2 if steps >= 2 else 1
    return f"train.profile_steps=[{first},{min(first + 1, steps)}]"


def profiling_problems(c: ProblemCollector, run: RunConfig) -> None:
    t = run.train
    window = list(t.profile_steps)
    fix = f"e.g. {_suggested_steps(t.steps)}, or train.profile_steps=[] (off)"
    if window and c.check(
        len(window) == 2,
        "train.profile_steps",
        window,
        "must be two step numbers, the first and the last step traced, or empty (off)",
        fix,
    ):
        first, last = window
        c.check(
            1 <= first <= last <= t.steps,
            "train.profile_steps",
            window,
            f"needs 1 <= first <= last <= train.steps ({t.steps}); steps count from 1, as in metrics.jsonl",
            fix,
        )
    c.check(
        not t.memory_history or run.cluster.device == "cuda",
        "train.memory_history",
        t.memory_history,
        "records the CUDA caching allocator's history: needs cluster.device=cuda",
        "set train.memory_history=false on CPU (peak RSS per rank is in summary.json), or run on cluster.device=cuda",
    )
