"""Parity harness: run a layout for real in N processes and the same model, data and seed in one
process, and compare per-step losses and gradient norms.

Both runs go through the real `partrain train` path (torchrun, gloo, the same worker code). The
reference keeps the global batch and everything else, and sets every parallel degree to 1 on a
one-process cluster. Used by the tests of every parallelism feature and usable by hand:

    python -m partrain.testing.parity recipe=gpt-dp parallel.zero_stage=3 --steps 5
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from partrain.rehearse.parity import (
    FP32_RTOL,
    REFERENCE_OVERRIDES,
    RunRecord,
    check_parity,
    max_relative_difference,
    parity_args,
    read_record,
    reference_overrides,
)

__all__ = [
    "FP32_RTOL",
    "REFERENCE_OVERRIDES",
    "RunRecord",
    "check_parity",
    "max_relative_difference",
    "parity_args",
    "read_record",
    "reference_overrides",
    "run_training",
]


def run_training(
    overrides: Sequence[str], run_dir: Path, steps: int, extra_env: dict | None = None, timeout_s: int = 600
) -> RunRecord:
    """`partrain train OVERRIDES` for `steps` steps into run_dir; raises with the output on failure."""
    args = [*parity_args(overrides, steps), f"train.run_dir={run_dir}"]
    proc = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=extra_env,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"partrain train {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return read_record(run_dir)


def main(argv: Sequence[str]) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=FP32_RTOL)
    args = parser.parse_intermixed_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ref = run_training(reference_overrides(args.overrides), Path(tmp) / "reference", args.steps)
        got = run_training(args.overrides, Path(tmp) / "layout", args.steps)
        print(f"reference losses: {ref.losses}\nlayout losses:    {got.losses}")
        print(json.dumps(check_parity(ref, got, args.rtol)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
