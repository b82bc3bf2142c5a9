"""A parameter's local tensor (its DTensor shard, or itself), and a DTensor like a parameter around a
new local tensor: what the flat-buffer optimizers (ZeRO-1, master weights) need to treat
tensor-parallel parameters as the plain local tensors they are on each rank."""

from __future__ import annotations

import torch


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own piece (a view of its storage for a DTensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def like(param: torch.Tensor, local_tensor: torch.Tensor) -> torch.Tensor:
    """`local_tensor` as `param` is held: plain, or a DTensor of param's mesh, placements and global shape."""
    if not hasattr(param, "device_mesh"):
        return local_tensor
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local_tensor, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def set_data(param: torch.Tensor, new: torch.Tensor) -> None:
    """`param.data = new`, also for DTensor parameters: their ops run on the DTensor's own local
    tensor, which assigning `.data` leaves in place (measured on torch 2.13: the parameter then
    reports the new dtype but computes with the old local tensor), so that is replaced too."""
    param.data = new
    if hasattr(param, "_local_tensor"):
        param._local_tensor = new._local_tensor
