"""The tensor-parallel operator f and what it builds: the few pieces that tp_layers and megatron_sp share.

f (`copy_to_tp`) is the identity forward and an all-reduce of the gradient backward: a tensor every TP rank
holds whole enters work that each rank does on its own columns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.profiler import record_function

from partrain.parallel.compile import eager


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward (entering a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        with record_function("partrain/tp/all_reduce"):
            dist.all_reduce(grad, group=ctx.group)
        return grad, None


def fused_bias_placement(fused_parts: int):
    """A column-parallel bias's placement: its own shard, or, for a fused projection (GPT-2's c_attn:
    [q | k | v]), the whole bias on every rank (see local_fused_bias)."""
    return Replicate() if fused_parts > 1 else Shard(0)


def local_fused_bias(bias: DTensor, group, parts: int) -> torch.Tensor:
    """This rank's columns of every part of a fused bias kept whole on each TP rank ([q_r | k_r | v_r]),
    its gradient summed over TP by f (each rank's covers only its own columns).

    Whole, not a strided shard as the weight is: FSDP shards a bias's only dimension over dp too, and a
    strided TP shard on the dimension FSDP shards is saved by DCP in another order than HF's (a resume
    or an export then permutes q, k and v's biases). A bias is 3 x hidden numbers: keeping it whole costs
    nothing."""
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    full = copy_to_tp(bias.to_local(), group)
    return full.view(parts, tp, -1)[:, rank].reshape(-1)


# Run eagerly inside compiled blocks (partrain.parallel.compile.eager: collectives).
copy_to_tp = eager(_CopyToTensorParallel.apply)
