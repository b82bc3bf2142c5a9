"""LoRA adapters (`peft=lora`): rank-r A and B next to each target projection, the base frozen.

Applied to the meta model after tensor parallelism and before recompute and FSDP (parallelize's
order), so the adapters are built against the post-TP projections and every later wrapper treats
them as ordinary (small) parameters. Each target projection (nn.Linear, or tp_layers' column- and
row-parallel modules) is replaced by a `LoraProjection` that keeps the base's `weight` / `bias`
under their own names (FQNs, checkpoints and HF export unchanged) and adds PEFT's `lora_A` /
`lora_B` children, so `<path>.lora_A.weight` is PEFT's adapter key minus its `base_model.model.`
prefix.

Why not peft's LoraLayer: it wraps `nn.Linear` / transformers' TP styles and moves the base weight
to `<path>.base_layer.weight`, while partrain's TP projections are its own local-tensor modules and
every part of partrain (materialize, DCP checkpoints, HF export) keys tensors by the HF model's FQNs.
peft is used where it composes: the on-disk format (`checkpoint export --peft`) that
`peft.PeftModel.from_pretrained` loads.

Tensor parallelism (Megatron's rule, as peft's TP support): a column-parallel base has A replicated
and B column-sharded like the base; a row-parallel base has A row-sharded (its input is sharded) and
B replicated. The base shard and the adapter's shard are summed locally, then the one collective of
the projection runs on the sum, so the reduction order is the base's own. The adapter's replicated
weight sees only this rank's part of the gradient (A behind a column split, B behind a row split):
its gradient is summed over TP in backward (`copy_to_tp` on the weight), a tiny r x d all-reduce.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from partrain.blueprint.config.schema import PeftConfig
from partrain.blueprint.validate_peft import lora_targets
from partrain.models.adapters import Adapter
from partrain.models.lora_init import LORA_A, LORA_B, is_lora_weight
from partrain.parallel.local_tensors import local
from partrain.parallel.tp_layers import ColumnParallelLinear, RowParallelLinear, copy_to_tp, reduce_from_tp, shard_param

PLAIN, COLUMN, ROW = "plain", "column", "row"


class LoraProjection(nn.Module):
    """base(x) + (alpha / r) * B A dropout(x), with the base frozen and A, B trainable."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float) -> None:
        super().__init__()
        if isinstance(base, ColumnParallelLinear):
            self.kind, self.group, self.copies_input = COLUMN, base.group, base.copies_input
        elif isinstance(base, RowParallelLinear):
            if base.to_sequence:  # validation refuses Megatron-SP with LoRA; a direct caller gets this
                raise NotImplementedError("LoRA on a sequence-parallel row projection")
            self.kind, self.group = ROW, base.group
        elif isinstance(base, nn.Linear):
            self.kind = PLAIN
        else:
            raise NotImplementedError(f"LoRA on {type(base).__name__}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        device = base.weight.device
        setattr(self, LORA_A, nn.Linear(self.in_features, r, bias=False, device=device))
        setattr(self, LORA_B, nn.Linear(r, self.out_features, bias=False, device=device))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / r
        if self.kind != PLAIN:
            mesh = base.weight.device_mesh
            a_place, b_place = (Replicate(), Shard(0)) if self.kind == COLUMN else (Shard(1), Replicate())
            shard_param(self.lora_A, "weight", mesh, a_place)
            shard_param(self.lora_B, "weight", mesh, b_place)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == COLUMN and self.copies_input:
            x = copy_to_tp(x, self.group)
        a, b = local(self.lora_A.weight), local(self.lora_B.weight)
        if self.kind == COLUMN:
            a = copy_to_tp(a, self.group)  # replicated A: each rank's gradient covers its B columns only
        elif self.kind == ROW:
            b = copy_to_tp(b, self.group)  # replicated B: each rank's gradient covers its partial sum only
        delta = F.linear(F.linear(self.lora_dropout(x), a), b) * self.scaling
        bias = None if self.bias is None else local(self.bias)
        if self.kind != ROW:
            return F.linear(x, local(self.weight), bias) + delta
        out = reduce_from_tp(F.linear(x, local(self.weight)) + delta, self.group)
        return out if bias is None else out + bias


def _layers(module: nn.Module, adapter: Adapter) -> Iterable[nn.Module]:
    layers = adapter.layers(module)
    return layers.values() if isinstance(layers, nn.ModuleDict) else layers


def apply_lora(module: nn.Module, adapter: Adapter, peft: PeftConfig, arch: str) -> int:
    """Adapt the target projections of `module`'s decoder layers and freeze everything else (embeddings,
    norms, head included); returns the number of adapted projections (0 with peft.method=none)."""
    if peft.method != "lora":
        return 0
    targets = set(lora_targets(arch, peft.target_modules))
    adapted = 0
    for layer in _layers(module, adapter):
        for path, child in list(layer.named_modules()):
            owner_path, _, leaf = path.rpartition(".")
            if leaf in targets:
                owner = layer.get_submodule(owner_path) if owner_path else layer
                setattr(owner, leaf, LoraProjection(child, peft.r, peft.alpha, peft.dropout))
                adapted += 1
    freeze_base(module)
    return adapted


def freeze_base(module: nn.Module) -> None:
    """Only adapter weights train: the base's parameters get no gradient and no optimizer state."""
    for name, param in module.named_parameters():
        param.requires_grad_(is_lora_weight(name))


def trainable_count(module: nn.Module, only: Optional[bool] = True) -> int:
    """Elements of `module`'s parameters that train (only=True), are frozen (False) or all (None)."""
    return sum(p.numel() for p in module.parameters() if only is None or p.requires_grad == only)
