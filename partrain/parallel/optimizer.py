"""The optimizer every layout gets: AdamW (or SGD with momentum) with weight decay on matrices only, its
state sharded over the dp_shard ranks for ZeRO-1 (`ShardedOptimizer`, AdamW only)."""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch
from torch import nn

from partrain.blueprint.config.schema import OptimConfig
from partrain.parallel.zero1_optimizer import ShardedOptimizer
from partrain.runtime.mesh import ParallelMesh


def param_groups(model: nn.Module, weight_decay: float) -> List[Dict]:
    """Decay weight matrices and embeddings; not biases and norm gains (1-D tensors)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


IMPLEMENTATION_KWARGS = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
"""optim.implementation -> torch's flags. for_loop keeps the update order per tensor identical for sharded and
unsharded runs (bit-identical parity); foreach and fused batch the tensors (faster, last-bit differences)."""


def optimizer_class(cfg: OptimConfig) -> Tuple[type, Dict]:
    """The torch optimizer class of optim.name and its keyword arguments (without params)."""
    impl = IMPLEMENTATION_KWARGS[cfg.implementation]
    if cfg.name == "sgd":
        return torch.optim.SGD, {"lr": cfg.lr, "momentum": cfg.momentum, **impl}
    return torch.optim.AdamW, {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, **impl}


def make_torch_optimizer(groups: List[Dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_class(cfg)
    return cls(groups, **kwargs)


def make_optimizer(groups, mesh: ParallelMesh, zero_stage: int, optim_cfg: OptimConfig):
    """The run's optimizer; for ZeRO-1 with its state sharded over the dp_shard ranks."""
    if zero_stage == 1 and mesh.size("dp_shard") > 1:
        if optim_cfg.name != "adamw":  # validation refuses it first; a direct caller gets the same rule
            raise ValueError(f"ZeRO-1 shards AdamW's state only, not optim.name={optim_cfg.name}")
        cls, kwargs = optimizer_class(optim_cfg)

        def sharded(gs):
            return ShardedOptimizer(gs, cls, mesh["dp_shard"].get_group(), **kwargs)

        if mesh.size("ep") > 1:  # expert shards differ per ep rank: they stay out of the flat buffers
            from partrain.parallel.expert_optimizer import ExpertShardOptimizer, zero1_optimizer

            edp = mesh["edp"].get_group() if mesh.size("edp") > 1 else None
            return zero1_optimizer(
                groups,
                sharded,
                lambda gs: ExpertShardOptimizer(gs, edp, lambda inner: make_torch_optimizer(inner, optim_cfg)),
            )
        return sharded(groups)
    return make_torch_optimizer(groups, optim_cfg)
