"""Copy a rank's part of a full tensor into a (possibly sharded) parameter, and name parameters
the same way under every wrapper.

A parameter may be a plain tensor (the rank holds all of it) or a DTensor (FSDP2 `fully_shard`,
tensor parallelism, or both). For a DTensor, `distribute_tensor(..., src_data_rank=None)` cuts the
local piece out of the full value on this rank alone: in torch 2.13 that path only splits
(`Shard._shard_tensor` / `_StridedShard._shard_tensor` skip the scatter and `Replicate` skips the
broadcast when src_data_rank is None), so no collective runs and every rank needs the same full
value, which the callers guarantee by generating it deterministically.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

# Wrappers insert these into FQNs: activation checkpointing, torch.compile, FSDP1, DDP.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_fqn(name: str) -> str:
    """`name` as in the plain HF model, whatever wrappers sit around the modules."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name[len("module.") :] if name.startswith("module.") else name


@torch.no_grad()
def copy_local_shard(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of `full` into `target` in place.

    `target` is an allocated parameter or buffer (after `to_empty`); writing in place keeps FSDP2's
    padded shard storage and any weight tying intact.
    """
    if tuple(full.shape) != tuple(target.shape):
        raise ValueError(f"full value has shape {tuple(full.shape)}, the parameter {tuple(target.shape)}")
    if isinstance(target, DTensor):
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


def param_fqns(parts: Iterable[nn.Module]) -> Dict[int, str]:
    """id(parameter) -> FQN in the plain model, over all parts."""
    names: Dict[int, str] = {}
    for part in parts:
        for name, param in part.named_parameters():
            names.setdefault(id(param), canonical_fqn(name))
    return names
