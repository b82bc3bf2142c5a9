"""Build this rank's share of the model and the engine that trains it, in one documented order.

    meta model -> pipeline split (this rank's chunks) -> tensor/sequence parallel -> expert parallel
    -> recompute -> FSDP (zero_stage 2/3) -> materialize weights -> DDP / gradient sync -> optimizer
    -> engine

Everything before `materialize` runs on the meta device, so no rank ever allocates the full model
when the layout shards it. Every axis exists (size 1 when unused); the code asks the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import List, Optional

import torch
from torch import nn

from .config.validate import ValidatedRun
from .models.adapters import get_adapter
from .models.build import build_meta_model
from .models.init import materialize
from .models.loss import token_loss
from .parallel import data_parallel, expert_parallel
from .parallel.recompute import apply_recompute
from .parallel.tensor_parallel import apply_tp, loss_context, shard_embedding_gradient
from .runtime.mesh import ParallelMesh
from .train.engine import DirectEngine, PipelineEngine
from .train.optim import param_groups


def _shard(module: nn.Module, v: ValidatedRun, mesh: ParallelMesh, adapter, moe=None) -> None:
    p = v.run.parallel
    apply_tp(module, adapter, mesh["tp"], sequence_parallel=p.tp_sequence_parallel)
    if moe is not None:
        expert_parallel.apply_ep(module, adapter, mesh["ep"], moe)
    apply_recompute(module, adapter, p.recompute, p.recompute_every)
    if data_parallel.uses_fsdp(p.zero_stage):
        if moe is not None:
            expert_parallel.shard_experts_fsdp(module, mesh, p.zero_stage, v.run.train.precision)
        data_parallel.apply_fsdp(module, adapter, mesh, p.zero_stage, v.run.train.precision)


@dataclass
class RankModules:
    """This rank's share of the model, sharded but still on the meta device (no weights yet)."""

    model: nn.Module
    """The whole meta model (with pp == 1 it is also the one module this rank trains)."""
    adapter: object
    modules: List[nn.Module]
    """What this rank holds: [model], or its pipeline stage modules in chunk order."""
    chunks: List[int] = field(default_factory=list)
    """Pipeline chunks (virtual stages) of this rank; empty without pipeline parallelism."""
    moe: Optional[expert_parallel.MoERuntime] = None
    """MoE models: the routed-experts state shared by this rank's MoE layers (losses, load metrics)."""


def shard_on_meta(v: ValidatedRun, mesh: ParallelMesh) -> RankModules:
    """Every step of the order above that runs before weights exist. `partrain plan --simulate`
    runs exactly this under the fake process group, so what it reports is what a rank builds."""
    model = build_meta_model(v.run.model)
    adapter = get_adapter(model)
    moe = expert_parallel.new_runtime(model, adapter, v.run.parallel)
    if mesh.size("pp") == 1:
        _shard(model, v, mesh, adapter, moe)
        return RankModules(model, adapter, [model], moe=moe)
    from .parallel.pipeline import build_stage_module
    from .parallel.stage_split import plan_chunks

    run, p = v.run, v.run.parallel
    pp, vstages = mesh.size("pp"), p.pp_virtual_stages
    plan = plan_chunks(v.facts, pp, vstages, p.pp_schedule, run.train.seq_len, p.pp_layers_per_stage)
    chunks = plan["placement"][mesh.local("pp")]
    stages: List[nn.Module] = [build_stage_module(model, adapter, c, pp * vstages, plan["ranges"][c]) for c in chunks]
    for stage in stages:
        _shard(stage, v, mesh, adapter, moe)
    return RankModules(model, adapter, stages, list(chunks), moe=moe)


def build_engine(v: ValidatedRun, mesh: ParallelMesh, device: torch.device):
    run = v.run
    loss_ctx = loss_context(mesh.size("tp"), use_loss_parallel=True)
    held = shard_on_meta(v, mesh)
    if mesh.size("pp") == 1:
        model = held.model
        materialize(model, run.model, run.train.seed, device)
        shard_embedding_gradient(model, held.adapter)
        model.train()
        dp_model = data_parallel.wrap(model, mesh, run.parallel.zero_stage, run.optim, run.parallel.fsdp_grad_sync)
        if mesh.size("ep") > 1 and not data_parallel.uses_fsdp(run.parallel.zero_stage):
            # Expert gradients reduce over edp, not dp x sp (see expert_parallel).
            dp_model = replace(dp_model, finish_gradients=lambda: expert_parallel.sync_gradients([model], mesh))
        engine = DirectEngine(dp_model, run.train.micro_batch_size, run.train.precision, device, loss_ctx)
        engine.moe = held.moe
        return engine
    return _pipeline_engine(v, mesh, device, held, loss_ctx)


def _pipeline_engine(v: ValidatedRun, mesh: ParallelMesh, device: torch.device, held: RankModules, loss_ctx):
    from .parallel.pipeline import PipelineRunner

    run, p = v.run, v.run.parallel
    pp, vstages = mesh.size("pp"), p.pp_virtual_stages
    stages, chunks = held.modules, held.chunks
    for stage in stages:
        materialize(stage, run.model, run.train.seed, device)
        shard_embedding_gradient(stage, held.adapter)
        stage.train()
    groups = [g for stage in stages for g in param_groups(stage, run.optim.weight_decay)]
    optimizer = data_parallel.make_optimizer(groups, mesh, p.zero_stage, run.optim)
    fsdp = data_parallel.uses_fsdp(p.zero_stage)
    dp_group = mesh["dp_sp"].get_group() if (not fsdp and mesh.size("dp_sp") > 1) else None
    # DTensor activations (sequence parallel) and autocast change what flows between stages:
    # let torch infer the shapes then.
    static = not (p.tp_sequence_parallel and mesh.size("tp") > 1) and run.train.precision == "fp32"
    runner = PipelineRunner(stages, chunks, pp * vstages, mesh["pp"], p.pp_schedule, v.microbatches, token_loss, device,
                            microbatch_size=run.train.micro_batch_size, seq_len=run.train.seq_len, static_shapes=static)
    sync = (lambda: data_parallel.allreduce_gradients_of(stages, dp_group, mesh.size("dp_sp"))) if dp_group else (lambda: None)
    if dp_group and mesh.size("ep") > 1:
        sync = lambda: expert_parallel.sync_gradients(stages, mesh)  # noqa: E731 - experts reduce over edp
    engine = PipelineEngine(runner, optimizer, stages, mesh["pp"].get_group(), run.train.precision, device, loss_ctx, sync)
    engine.moe = held.moe
    return engine
