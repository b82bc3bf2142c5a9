"""Data parallelism: DDP (zero_stage 0), sharded optimizer state (1), FSDP2 (2 and 3), hybrid.

- zero_stage 0: `DistributedDataParallel` over the dp x sp ranks; gradients all-reduced in
  buckets during backward; the optimizer is replicated.
- zero_stage 1: DDP for the gradients plus `ShardedOptimizer` (optimizer state split 1/N).
- zero_stage 2: FSDP2 `fully_shard` with `reshard_after_forward=False`: parameters stay
  gathered from forward to backward (no second all-gather), gradients and optimizer state sharded.
- zero_stage 3: FSDP2 with `reshard_after_forward=True`: parameters are sharded at rest too.
- hybrid (`parallel.dp_shard` < dp): FSDP shards within groups of dp_shard ranks and replicates
  across them (a 2-D mesh: dp_replicate x dp_shard); for zero_stage 1 the optimizer state is
  sharded within dp_shard groups and gradients are all-reduced over all of dp.

FSDP is applied to the meta model before weights exist (so no rank ever holds the full model);
DDP wraps the materialized model. The first decoder layers are sharded as their own units so
their all-gathers overlap with compute, then the root (embeddings, norm, head).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import torch
from torch import nn

from partrain.blueprint.config.schema import FSDP_GRAD_SYNC, OptimConfig
from partrain.models.adapters import Adapter
from partrain.parallel.dp_sync.setup import SyncRuntime, SyncSettings
from partrain.parallel.optimizer import make_optimizer, make_torch_optimizer, param_groups
from partrain.parallel.precision import mixed_precision_policy
from partrain.runtime.mesh import ParallelMesh


def uses_fsdp(zero_stage: int) -> bool:
    return zero_stage >= 2


def fsdp_mesh(mesh: ParallelMesh):
    """FSDP shards over dp x sp (sequence-parallel ranks hold the same weights and reduce gradients
    like data-parallel ones); hybrid: replicate over dp_replicate, shard over dp_shard x sp."""
    sp = mesh.size("sp") > 1
    if mesh.layout.dp_shard == mesh.layout.dp:
        return mesh["dp_sp"] if sp else mesh["dp"]
    return mesh.world["dp_replicate", "dp_shard_sp"] if sp else mesh.world["dp_replicate", "dp_shard"]


def apply_fsdp(
    model: nn.Module,
    adapter: Adapter,
    mesh: ParallelMesh,
    zero_stage: int,
    precision: str = "fp32",
    keep_root_gathered: bool = False,
) -> None:
    """Shard each decoder layer, then the root; call on the meta model, before materialize.

    keep_root_gathered: the root's parameters (embeddings, final norm, head) stay gathered from
    forward to backward. The chunked loss (`train.loss_chunk_tokens`) calls the head after the
    model's forward and again in backward (recompute), before the root's pre-backward would gather
    it; the root is gathered through the whole forward anyway, so the peak does not grow."""
    from torch.distributed.fsdp import fully_shard

    reshard = zero_stage == 3
    dmesh = fsdp_mesh(mesh)
    policy = mixed_precision_policy(precision)
    extra = {"mp_policy": policy} if policy is not None else {}
    container = adapter.layers(model)
    layers = list(container.values() if isinstance(container, nn.ModuleDict) else container)
    for i, layer in enumerate(layers):
        # The last layer is used first in backward; keeping it gathered saves one all-gather.
        fully_shard(layer, mesh=dmesh, reshard_after_forward=reshard and i < len(layers) - 1, **extra)
    fully_shard(model, mesh=dmesh, reshard_after_forward=reshard and not keep_root_gathered, **extra)


@dataclass
class DataParallelModel:
    """What the training loop talks to, whatever the zero stage."""

    module: nn.Module
    """Call this for forward."""
    inner: nn.Module
    """The unwrapped model (parameters, state dict)."""
    optimizer: object
    microbatch: Callable[[bool], ContextManager]
    """Context for one microbatch's forward+backward; argument: is it the last of the step."""
    finish_gradients: Callable[[], None] = lambda: None
    """Called once after the last backward of a step (gradient sync where no wrapper does it)."""
    clip: Optional[Callable[[float], float]] = None
    """The global gradient norm, clipped, where the gradients live elsewhere (parameter server);
    None = clip the model's own gradients."""
    sync: Optional[SyncRuntime] = None
    """parallel.dp_sync other than allreduce: its byte counter and overlap statistics."""


def _has_dtensor_params(model: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def allreduce_gradients(model: nn.Module, group, size: int) -> None:
    allreduce_gradients_of([model], group, size)


def allreduce_gradients_of(modules, group, size: int) -> None:
    """Average local gradients over the data-parallel group in one flat buffer (for layouts DDP
    cannot wrap: tensor-parallel DTensor parameters, pipeline stages)."""
    grads = []
    seen = set()
    for module in modules:
        for p in module.parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                grads.append(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
    if size == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    with torch.profiler.record_function("partrain/dp/all_reduce"):
        torch.distributed.all_reduce(flat, group=group)
    flat /= size
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


@contextlib.contextmanager
def _fsdp_sync_only_if(model: nn.Module, last: bool):
    """Skip FSDP's reduce-scatter for all but the last microbatch: gradients accumulate unsharded in
    each FSDP unit and are reduce-scattered once (what DDP's no_sync and Accelerate do)."""
    model.set_requires_gradient_sync(last)
    try:
        yield
    finally:
        # Leave the module syncing, so a forward/backward outside the step loop (a test, an eval
        # with gradients) never silently keeps unsharded gradients.
        model.set_requires_gradient_sync(True)


def wrap(
    model: nn.Module,
    mesh: ParallelMesh,
    zero_stage: int,
    optim_cfg: OptimConfig,
    fsdp_grad_sync: str = "every_microbatch",
    sync: SyncSettings = SyncSettings(),
) -> DataParallelModel:
    """After materialize: DDP (or `parallel.dp_sync`'s strategy) for stages 0/1, and the optimizer."""
    groups = param_groups(model, optim_cfg.weight_decay)
    dp_group_size = mesh.size("dp_sp")
    if sync.strategy != "allreduce" and dp_group_size > 1 and not uses_fsdp(zero_stage):
        from partrain.parallel.dp_sync.wrap import wrap_with_strategy

        made = wrap_with_strategy(
            model, mesh, groups, optim_cfg, sync, lambda: make_optimizer(groups, mesh, zero_stage, optim_cfg)
        )
        return DataParallelModel(model, model, made.optimizer, made.microbatch, made.finish, made.clip, made.runtime)
    if uses_fsdp(zero_stage):
        if fsdp_grad_sync not in FSDP_GRAD_SYNC:
            raise ValueError(f"fsdp_grad_sync must be one of {FSDP_GRAD_SYNC}, not {fsdp_grad_sync!r}")
        microbatch = lambda last: contextlib.nullcontext()
        if fsdp_grad_sync == "last_microbatch":
            microbatch = lambda last: _fsdp_sync_only_if(model, last)
        return DataParallelModel(model, model, make_torch_optimizer(groups, optim_cfg), microbatch)
    # The sharded optimizer re-homes parameters into its flat buffers: build it before DDP.
    optimizer = make_optimizer(groups, mesh, zero_stage, optim_cfg)
    module: nn.Module = model
    microbatch: Callable[[bool], ContextManager] = lambda last: contextlib.nullcontext()
    if dp_group_size > 1 and _has_dtensor_params(model):
        group = mesh["dp_sp"].get_group()
        return DataParallelModel(
            module, model, optimizer, microbatch, lambda: allreduce_gradients(model, group, dp_group_size)
        )
    if dp_group_size > 1:
        ddp = nn.parallel.DistributedDataParallel(
            model, process_group=mesh["dp_sp"].get_group(), bucket_cap_mb=sync.bucket_mb
        )
        module = ddp
        microbatch = lambda last: contextlib.nullcontext() if last else ddp.no_sync()
    return DataParallelModel(module, model, optimizer, microbatch)
