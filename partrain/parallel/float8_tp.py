"""float8 matmuls of partrain's tensor-parallel projections (tp_layers' column / row-parallel linears,
megatron_sp's gathered column projections), with the scales one process computes.

A projection that `apply_float8` turned into torchao's `Float8Linear` before tensor parallelism keeps
its float8 config when tp_layers / megatron_sp replace it (`for_projection`). Its matmuls then run on
the local shards through torchao's own building blocks: `hp_tensor_to_float8_dynamic` (amax, scale,
cast: the recipe's cast configs, tensorwise or rowwise) and the `Float8TrainingTensor` matmul
(torch._scaled_mm). What is written here is what torchao's `matmul_with_hp_or_float8_args` does,
plus one rule it has no way to know: an operand that is split over the TP group along the axis its
scale reduces over must have its amax all-reduced (MAX) over the group first, else each rank would
scale its shard by the shard's own amax and the run would not be the one-process run. torchao's
float8 TP styles get that from DTensor dispatch (their operands are DTensors); partrain's TP computes
on local tensors, so the reduction is asked for explicitly (torchao's `reduce_amax` over the tp mesh):

- column-parallel (W split by output rows): the weight, and the output gradient (split by columns);
  the input is whole (replicated, or gathered under Megatron-SP).
- row-parallel (W split by input columns): the input (split by features) and the weight; the output
  gradient is whole (all-reduced output, or all-gathered under Megatron-SP).

Under the rowwise recipe a scale reduces over one axis only: the all-reduce is needed just where that
axis is the split one (e.g. a column-parallel weight's forward scale, per output row over the whole
input dimension, is local), and applying it elsewhere would mix different rows' scales.

torchao is imported only when a projection really is float8 (it is an extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from partrain.parallel.compile import eager


@dataclass(frozen=True)
class Sharding:
    """Which dimension of each 2-D matmul operand is split over the TP group (None: whole)."""

    input: Optional[int]
    """Of the input [tokens, in_features]."""
    weight_t: Optional[int]
    """Of the transposed weight [in_features, out_features]."""
    grad_output: Optional[int]
    """Of the output gradient [tokens, out_features]."""


COLUMN = Sharding(input=None, weight_t=1, grad_output=1)
ROW = Sharding(input=1, weight_t=0, grad_output=None)
WHOLE = Sharding(input=None, weight_t=None, grad_output=None)
"""No operand split (no tensor parallelism): LoRA's frozen base outside TP (partrain.parallel.lora)."""


class Float8TP:
    """One TP projection's float8 matmuls on local shards (see the module docstring)."""

    def __init__(self, config, mm_config, mesh: DeviceMesh, sharding: Sharding) -> None:
        self.config, self.mm_config, self.mesh, self.sharding = config, mm_config, mesh, sharding

    def _cast(self, t: torch.Tensor, cast_config, role: str, axiswise_dim: int, sharded: Optional[int]):
        from torchao.float8.config import ScalingType
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import GemmInputRole

        if cast_config.scaling_type is ScalingType.DISABLED:
            return t
        dim = get_maybe_axiswise_dim(axiswise_dim, cast_config.scaling_granularity)
        # Tensorwise (dim None): any split needs the group's amax; axiswise: only a split of the
        # reduced axis does.
        reduce = sharded is not None and (dim is None or dim % t.dim() == sharded % t.dim())
        return hp_tensor_to_float8_dynamic(
            t,
            cast_config.target_dtype,
            self.mm_config,
            reduce_amax=reduce,
            gemm_input_role=getattr(GemmInputRole, role),
            device_mesh=self.mesh if reduce else None,
            scaling_granularity=cast_config.scaling_granularity,
            axiswise_dim=dim,
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x [..., K] @ weight [N, K]^T, both cast to float8 with whole-tensor scales."""
        c, s = self.config, self.sharding
        flat = x.reshape(-1, x.shape[-1])
        x8 = self._cast(flat, c.cast_config_input, "INPUT", -1, s.input)
        w8 = self._cast(weight.t(), c.cast_config_weight, "WEIGHT", 0, s.weight_t)
        out = torch.mm(x8, w8)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def grad_input(self, grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """grad [M, N] @ weight [N, K] in float8 (torchao's grad-input casts); [M, K], local partial
        sum for a column-parallel projection."""
        c, s = self.config, self.sharding
        g8 = self._cast(grad, c.cast_config_grad_output, "GRAD_OUTPUT", -1, s.grad_output)
        w8 = self._cast(weight.t(), c.cast_config_weight_for_grad_input, "WEIGHT", -1, s.weight_t)
        return torch.mm(g8, w8.t())

    def grad_weight(self, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """grad [M, N]^T @ x [M, K] in float8: the local weight shard's gradient [N, K]."""
        c, s = self.config, self.sharding
        g8 = self._cast(grad, c.cast_config_grad_output_for_grad_weight, "GRAD_OUTPUT", 0, s.grad_output)
        x8 = self._cast(x, c.cast_config_input_for_grad_weight, "INPUT", 0, s.input)
        return torch.mm(g8.t(), x8)

    def project(self, full: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Float8Linear's output without autograd (megatron_sp's gathered projections write their own
        backward from grad_input / grad_weight)."""
        out = self.forward(full, weight)
        return out if bias is None else out + bias.to(out.dtype)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """Float8Linear's forward on local shards (autograd through `_Float8Matmul`)."""
        x = autocast_input(x)
        out = _float8_matmul(x, weight, self)
        return out if bias is None else out + bias.to(out.dtype)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """The input dtype torchao's Float8Linear uses: it casts to the autocast dtype under CUDA autocast
    only (its check); on CPU the input keeps its own dtype. Mirrored so that TP matches one process."""
    if torch.is_autocast_enabled():
        return x.to(torch.get_autocast_dtype("cuda"))
    return x


class _Float8Matmul(torch.autograd.Function):
    """x @ W^T on local shards in float8 (Float8TP.forward); backward: both float8 gradient matmuls."""

    @staticmethod
    def forward(ctx, x, weight, f8: Float8TP):
        ctx.save_for_backward(x, weight)
        ctx.f8 = f8
        return f8.forward(x, weight)

    @staticmethod
    def backward(ctx, grad) -> Tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.f8.grad_input(flat, weight).reshape(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:  # a frozen weight (peft) needs no weight-gradient matmul
            grad_w = ctx.f8.grad_weight(flat, x.reshape(-1, x.shape[-1]))
        return grad_x, grad_w, None


def for_projection(linear: nn.Module, mesh: Optional[DeviceMesh], sharding: Sharding) -> Optional[Float8TP]:
    """The float8 matmuls of `linear` once sharded, when apply_float8 converted it (a torchao
    Float8Linear: it carries its config); None for a plain nn.Linear (the TP module stays as it was)."""
    mm_config = getattr(linear, "linear_mm_config", None)
    if mm_config is None:
        return None
    return Float8TP(linear.config, mm_config, mesh, sharding)


# The amax all-reduces are collectives: run eagerly inside compiled blocks (partrain.parallel.compile.eager).
_float8_matmul = eager(_Float8Matmul.apply)
