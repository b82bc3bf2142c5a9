"""The optimizer every layout gets: AdamW with decoupled weight decay on matrices only, its state
sharded over the dp_shard ranks for ZeRO-1 (`ShardedOptimizer`)."""

from __future__ import annotations

from typing import Dict, List

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


def adamw_kwargs(cfg: OptimConfig) -> Dict:
    # foreach=False keeps the update order per tensor identical for sharded and unsharded runs.
    return {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2), "eps": cfg.eps, "foreach": False}


def make_adamw(groups: List[Dict], cfg: OptimConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, **adamw_kwargs(cfg))


def make_optimizer(groups, mesh: ParallelMesh, zero_stage: int, optim_cfg: OptimConfig):
    """AdamW; for ZeRO-1 with its state sharded over the dp_shard ranks."""
    if zero_stage == 1 and mesh.size("dp_shard") > 1:

        def sharded(gs):
            return ShardedOptimizer(gs, torch.optim.AdamW, mesh["dp_shard"].get_group(), **adamw_kwargs(optim_cfg))

        if mesh.size("ep") > 1:  # expert shards differ per ep rank: they stay out of the flat buffers
            from partrain.parallel.expert_optimizer import ExpertShardOptimizer, zero1_optimizer

            edp = mesh["edp"].get_group() if mesh.size("edp") > 1 else None
            return zero1_optimizer(
                groups, sharded, lambda gs: ExpertShardOptimizer(gs, edp, lambda inner: make_adamw(inner, optim_cfg))
            )
        return sharded(groups)
    return make_adamw(groups, optim_cfg)
