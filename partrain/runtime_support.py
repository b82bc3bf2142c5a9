"""What this version of partrain can train, said plainly.

The validator accepts every layout that is consistent; some consistent layouts use a technique
whose runtime is not built yet. The dry run lists them in its verdict and `partrain train` refuses
them with exit code 2 instead of silently dropping the feature.
"""

from __future__ import annotations

from typing import List

from .config.validate import ValidatedRun

# Flipped to True by the module that implements each technique (kept here, one place to read).
IMPLEMENTED = {
    "tp": True,
    "pp": True,
    "sp": True,
    "ep": False,
    "recompute": True,
    "checkpoint": True,
    "fp16": True,
    "zero1-tp": False,
    "tp-sp-learned-positions": False,
}


def unsupported_features(v: ValidatedRun) -> List[str]:
    layout, p = v.layout, v.run.parallel
    wanted = {
        "tp": (layout.tp > 1, f"parallel.tp={layout.tp} (tensor parallelism)"),
        "pp": (layout.pp > 1, f"parallel.pp={layout.pp} (pipeline parallelism)"),
        "sp": (layout.sp > 1, f"parallel.sp={layout.sp} (sequence/context parallelism)"),
        "ep": (layout.ep > 1, f"parallel.ep={layout.ep} (expert parallelism)"),
        "recompute": (p.recompute != "none", f"parallel.recompute={p.recompute}"),
        "fp16": (v.run.train.precision == "fp16", "train.precision=fp16 (loss scaling; use bf16)"),
        "zero1-tp": (p.zero_stage == 1 and layout.tp > 1, "parallel.zero_stage=1 (ZeRO-1 together with tensor parallelism)"),
        "tp-sp-learned-positions": (p.tp_sequence_parallel and layout.tp > 1 and v.facts.learned_positions,
                                    f"parallel.tp_sequence_parallel=true (Megatron-SP for {v.facts.arch}'s learned position embeddings)"),
        "checkpoint": (v.run.checkpoint.every_steps > 0 or v.run.checkpoint.resume != "none",
                       "checkpoint.every_steps / checkpoint.resume (distributed checkpoints)"),
    }
    return [text for key, (used, text) in wanted.items() if used and not IMPLEMENTED[key]]
