"""Initial values of LoRA adapter weights (peft=lora), identical under every parallel layout.

The adapters are not part of the HF model, so neither HF's `_init_weights` (random_init) nor a
pretrained checkpoint can give them values. As for every other tensor, the full value is a function
of (seed, FQN) alone, so a sharded adapter (tensor parallel, FSDP) starts bit-identical to the
one-process run. PEFT's default init: A Kaiming-uniform (a = sqrt(5), i.e. uniform within
1/sqrt(in_features)), B zeros, so the adapted model starts as the base model exactly.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from partrain.models.random_init import name_seed

LORA_A, LORA_B = "lora_A", "lora_B"
"""Child modules of an adapted projection (PEFT's names, so FQNs map onto its checkpoint keys)."""


def is_lora_weight(fqn: str) -> bool:
    """Whether `fqn` names an adapter weight (`...q_proj.lora_A.weight`)."""
    parts = fqn.split(".")
    return len(parts) >= 2 and parts[-2] in (LORA_A, LORA_B)


@torch.no_grad()
def lora_initial_value(fqn: str, shape: Sequence[int], seed: int) -> torch.Tensor:
    """Full fp32 value (CPU) of the adapter weight `fqn`: A [r, in] uniform, B [out, r] zeros."""
    if fqn.split(".")[-2] == LORA_B:
        return torch.zeros(tuple(shape))
    generator = torch.Generator().manual_seed(name_seed(seed, fqn))
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform_(a=sqrt(5)) on [r, in]: gain sqrt(1/3) * sqrt(3 / in)
    return torch.empty(tuple(shape)).uniform_(-bound, bound, generator=generator)
