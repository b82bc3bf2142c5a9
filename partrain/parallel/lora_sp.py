"""LoRA on the column-parallel projections of Megatron sequence parallelism (`peft=lora` with
`parallel.tp_sequence_parallel`).

Under Megatron-SP a block's column projections are `megatron_sp.SequenceColumn`s: the block's
pre-hook gathers the sequence shard once and computes every projection of the block from it
(`_GatherColumns`), the projection itself receives only a zero-byte stand-in. Replacing such a module
would leave the pre-hook computing with the old one, so the adapters are attached to it in place
(`<path>.lora_A.weight`, the same FQNs as `partrain.parallel.lora.LoraProjection`), and its forward
adds the adapter's output:

    delta = gather_seq(dropout(x_shard) A^T) B_local^T * alpha / r

A runs on this rank's sequence shard, so what is gathered is the rank-r activation ([b, s, r], not
[b, s, h]); B is column-sharded like the base. Backward of the gather is a reduce-scatter (Megatron's
g / g-bar pair): each rank's output columns contribute a partial gradient of every token's A output,
summed over TP and cut back to this rank's tokens. A is replicated and its gradient covers this rank's
tokens only: it is summed over TP (`copy_to_tp` on the weight), as for plain TP. The block input is
taken by a pre-hook that runs before the Megatron-SP one (prepend).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from partrain.models.lora_init import LORA_A, LORA_B
from partrain.parallel.compile import eager
from partrain.parallel.local_tensors import local
from partrain.parallel.megatron_sp import SequenceColumn, _gather_seq, _reduce_scatter_seq
from partrain.parallel.tp_layers import shard_param
from partrain.parallel.tp_ops import copy_to_tp

LORA_INPUT = "_lora_input"
"""Attribute of an adapted SequenceColumn: its block's sequence-shard input for the current call."""


class _GatherSequence(torch.autograd.Function):
    """All-gather [b, s/t, r] sequence shards forward; reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_seq(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad.contiguous(), ctx.group), None


gather_sequence = eager(_GatherSequence.apply)


class _SequenceLoraForward:
    """`column.forward` of an adapted SequenceColumn: the base output its block computed, plus the
    adapter's (see the module docstring)."""

    def __init__(self, column: SequenceColumn, mesh, scaling: float) -> None:
        self.column, self.mesh, self.scaling = column, mesh, scaling

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        column = self.column
        out = SequenceColumn.forward(column, x)
        shard: Optional[torch.Tensor] = getattr(column, LORA_INPUT, None)
        setattr(column, LORA_INPUT, None)
        if shard is None:
            raise RuntimeError("LoRA SequenceColumn called outside its block (the block's pre-hook passes its input)")
        if not getattr(column, "lora_enabled", True):  # partrain.parallel.lora.adapters_disabled
            return out
        group = self.mesh.get_group()  # looked up when training (`plan --simulate` builds without running)
        a = copy_to_tp(local(column.lora_A.weight), group)
        hidden = gather_sequence(F.linear(column.lora_dropout(shard), a), group)
        return out + F.linear(hidden, local(column.lora_B.weight)) * self.scaling


def adapt_sequence_column(
    column: SequenceColumn, block: nn.Module, r: int, alpha: float, dropout: float, b_place
) -> None:
    """Give `column` (a direct child of `block`) LoRA adapters in place: A replicated, B placed like
    the base's output features (`b_place`: Shard(0), or GPT-2 c_attn's strided split)."""
    mesh = column.weight.device_mesh
    in_dim = 0 if column.conv else 1  # Conv1D W [in, out], Linear W [out, in]
    in_features, out_features = column.weight.shape[in_dim], column.weight.shape[1 - in_dim]
    device = column.weight.device
    setattr(column, LORA_A, nn.Linear(in_features, r, bias=False, device=device))
    setattr(column, LORA_B, nn.Linear(r, out_features, bias=False, device=device))
    column.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
    shard_param(column.lora_A, "weight", mesh, Replicate())
    shard_param(column.lora_B, "weight", mesh, b_place)
    setattr(column, LORA_INPUT, None)
    column.forward = _SequenceLoraForward(column, mesh, alpha / r)
    if not getattr(block, "_lora_input_hook", False):
        block.register_forward_pre_hook(_pass_block_input, with_kwargs=True, prepend=True)
        block._lora_input_hook = True


def _pass_block_input(block: nn.Module, args, kwargs):
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    if isinstance(x, DTensor):  # a SequenceParallel norm hands over a Shard(1) DTensor
        x = x.to_local()
    for child in block.children():
        if isinstance(child, SequenceColumn) and hasattr(child, LORA_INPUT):
            setattr(child, LORA_INPUT, x)
    return None
