"""FSDP2's mixed-precision policy for each `train.precision` (shared by dense and expert FSDP)."""

from __future__ import annotations

import torch


def mixed_precision_policy(precision: str):
    """FSDP2's policy for 16-bit training: parameters all-gathered and used in 16 bits (half the
    all-gather traffic and gathered-parameter memory of fp32), gradients reduce-scattered and
    kept in fp32, the sharded master parameters and Adam state in fp32. None for fp32."""
    if precision == "fp32":
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if precision == "bf16" else torch.float16, reduce_dtype=torch.float32
    )
