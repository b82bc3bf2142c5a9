"""Which mixed-precision runtime a run gets: the one rule the runtime, the validator and the planner ask.

- autocast: fp32 parameters and gradients, torch.autocast casts weights to 16 bits per op.
- master: 16-bit parameters, fp32 gradient buffer, fp32 master weights + Adam state in the optimizer
  (`partrain.parallel.master_weights`), sharded over dp under ZeRO-1.
- FSDP (zero_stage 2/3) has its own MixedPrecisionPolicy and is neither.
"""

from __future__ import annotations


def uses_master_weights(precision: str, param_dtype: str, zero_stage: int, device: str, ep: int = 1) -> bool:
    """Whether the model holds 16-bit parameters with fp32 master weights in the optimizer.

    `param_dtype=auto` picks them on cuda only: on CPU 16-bit matmuls are slow and the autocast
    runtime is what the CPU parity tests pin. Expert parallelism keeps its own ZeRO-1 optimizer
    (`expert_optimizer`), so auto keeps autocast there (an explicit 16bit is refused by trainable.py)."""
    if precision == "fp32" or zero_stage >= 2:
        return False
    if param_dtype == "16bit":
        return True
    return param_dtype == "auto" and device == "cuda" and ep == 1


def run_uses_master_weights(v) -> bool:
    """`uses_master_weights` of a ValidatedRun."""
    run = v.run
    return uses_master_weights(
        run.train.precision, run.train.param_dtype, run.parallel.zero_stage, run.cluster.device, v.layout.ep
    )
