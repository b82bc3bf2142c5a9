"""Assemble this rank's engine: its shard of the model (built on meta by `shard_on_meta`), weights
materialized, gradient sync and optimizer, and the engine that trains it (direct or pipeline).

    shard_on_meta -> materialize -> tied embedding-gradient sharding -> DDP / FSDP sync + optimizer
    -> DirectEngine | PipelineEngine
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace

import torch

from partrain.blueprint.precision_mode import run_uses_master_weights
from partrain.blueprint.validate import ValidatedRun
from partrain.blueprint.validate_objective import reference_kind
from partrain.models.chunked_loss import head_loss_sum, labelled_count
from partrain.models.logits import final_softcap
from partrain.models.loss import forward_loss, token_loss
from partrain.models.materialize import materialize
from partrain.parallel import data_parallel, expert_gradients, master_weights
from partrain.parallel.context_parallel import sequence_shard
from partrain.parallel.dp_sync.counter import CommCounter
from partrain.parallel.dp_sync.setup import SyncSettings, flat_strategy, sync_flat
from partrain.parallel.lora import adapters_disabled
from partrain.parallel.optimizer import make_optimizer, param_groups
from partrain.parallel.parallelize import RankModules, shard_on_meta
from partrain.parallel.pipeline import PipelineRunner
from partrain.parallel.tensor_parallel import loss_context, shard_embedding_gradient
from partrain.runtime.mesh import ParallelMesh
from partrain.train.engine import DirectEngine, Engine, PipelineEngine
from partrain.train.preference import PreferenceObjective


def build_engine(v: ValidatedRun, mesh: ParallelMesh, device: torch.device) -> Engine:
    run = v.run
    loss_ctx = loss_context(mesh.size("tp"), use_loss_parallel=True)
    held = shard_on_meta(v, mesh)
    master = run_uses_master_weights(v)
    # 16-bit parameters compute in their own dtype: autocast (the engines' precision) stays off.
    autocast = "fp32" if master else run.train.precision
    if mesh.size("pp") == 1:
        model = held.model
        materialize(model, run.model, run.train.seed, device)
        shard_embedding_gradient(model, held.adapter)
        model.train()
        if master:
            dp_model = master_weights.wrap(model, mesh, run.parallel.zero_stage, run.optim, run.train.precision)
        else:
            dp_model = data_parallel.wrap(
                model,
                mesh,
                run.parallel.zero_stage,
                run.optim,
                run.parallel.fsdp_grad_sync,
                SyncSettings.of(run.parallel),
            )
        if mesh.size("ep") > 1 and not data_parallel.uses_fsdp(run.parallel.zero_stage):
            # Expert gradients reduce over edp, not dp x sp (see expert_parallel).
            dp_model = replace(dp_model, finish_gradients=lambda: expert_gradients.sync_gradients([model], mesh))
        shard = sequence_shard(mesh, run.parallel.sp_mode)
        loss_fn = functools.partial(
            shard.forward_loss if shard else forward_loss,
            head_path=held.adapter.lm_head_path,
            chunk_tokens=run.train.loss_chunk_tokens,
        )
        if run.train.objective != "lm":  # dpo / simpo
            frozen = frozen_copy(v, mesh, device) if reference_kind(run.train, run.peft.method) == "copy" else None
            loss_fn = preference_objective(run.train, run.peft.method, shard, frozen)
            engine_preference = loss_fn
        else:
            engine_preference = None
        engine = DirectEngine(dp_model, run.train.micro_batch_size, autocast, device, loss_ctx, forward_loss=loss_fn)
        engine.preference = engine_preference
        engine.moe = held.moe
        engine.label_group = shard.group if shard else None  # masked labels: counted over the sp slices
        return engine
    return _pipeline_engine(v, mesh, device, held, loss_ctx, autocast)


def preference_objective(train, peft_method: str, sequence=None, frozen=None) -> PreferenceObjective:
    """The engine's loss for train.objective=dpo or simpo. dpo's reference (train.preference_reference): the
    adapters switched off, the frozen copy, or (table) none here: the table computed before step 1
    (partrain.train.reference_logps)."""
    kind = reference_kind(train, peft_method)
    reference = None
    if kind == "adapters":
        reference = _adapters_off
    elif kind == "copy":
        reference = lambda model: contextlib.nullcontext(frozen)  # noqa: E731 - the copy runs, not the policy
    return PreferenceObjective(
        kind=train.objective,
        beta=train.preference_beta,
        label_smoothing=train.preference_label_smoothing,
        simpo_gamma=train.simpo_gamma,
        reference=reference,
        sequence=sequence,
        frozen=frozen,
    )


@contextlib.contextmanager
def _adapters_off(model):
    with adapters_disabled([model]):
        yield model


def frozen_copy(v: ValidatedRun, mesh: ParallelMesh, device: torch.device) -> torch.nn.Module:
    """dpo's train.preference_reference=copy: the starting model built again by the same shard_on_meta, so it
    is sharded as the policy is (tp, sp, ep, FSDP), its weights filled as the policy's are (the seed's
    initialisation or model.pretrained; checkpoint.init_from is loaded into it at the start), without
    gradients and in eval mode."""
    model = shard_on_meta(v, mesh).model
    materialize(model, v.run.model, v.run.train.seed, device)
    model.requires_grad_(False)
    return model.eval()


def static_stage_shapes(v: ValidatedRun) -> bool:
    """Whether the pipeline stages get their activations' shapes up front (torch then skips its shape
    inference, which exchanges metadata between stages at the first step)."""
    # DTensor activations (sequence parallel) and autocast change what flows between stages:
    # let torch infer the shapes then.
    p = v.run.parallel
    return not (p.tp_sequence_parallel and v.layout.tp > 1) and v.run.train.precision == "fp32"


def _pipeline_engine(
    v: ValidatedRun, mesh: ParallelMesh, device: torch.device, held: RankModules, loss_ctx, autocast: str
):
    run, p = v.run, v.run.parallel
    pp, vstages = mesh.size("pp"), p.pp_virtual_stages
    stages, chunks = held.modules, held.chunks
    for stage in stages:
        materialize(stage, run.model, run.train.seed, device)
        shard_embedding_gradient(stage, held.adapter)
        stage.train()
    groups = [g for stage in stages for g in param_groups(stage, run.optim.weight_decay)]
    master = autocast != run.train.precision
    if master:  # torch's schedule accumulates the stages' gradients itself: no hooks (master_weights)
        master_weights.cast_frozen(stages, run.train.precision)
        optimizer = master_weights.make_master_optimizer(
            groups, mesh, p.zero_stage, run.optim, run.train.precision, hooks=False
        )
    else:
        optimizer = make_optimizer(groups, mesh, p.zero_stage, run.optim)
    fsdp = data_parallel.uses_fsdp(p.zero_stage)
    dp_group = mesh["dp_sp"].get_group() if (not fsdp and mesh.size("dp_sp") > 1) else None
    static = static_stage_shapes(v)
    shard = sequence_shard(mesh, p.sp_mode)  # context parallelism: local tokens, its own loss
    # dpo / simpo: the pairs' loss on the last stage (validation keeps sp off under pp for them)
    preference = preference_objective(run.train, run.peft.method) if run.train.objective != "lm" else None
    loss_fn = (
        preference.pipeline_loss
        if preference
        else _stage_loss(stages, held.adapter, shard, run.train.loss_chunk_tokens)
    )
    runner = PipelineRunner(
        stages,
        chunks,
        pp * vstages,
        mesh["pp"],
        p.pp_schedule,
        v.microbatches,
        loss_fn,
        device,
        microbatch_size=run.train.micro_batch_size,
        seq_len=run.train.seq_len // mesh.size("sp"),
        static_shapes=static,
        activation_seq_len=run.train.seq_len // mesh.size("sp") // (mesh.size("tp") if p.tp_sequence_parallel else 1),
    )
    sync = (
        (lambda: data_parallel.allreduce_gradients_of(stages, dp_group, mesh.size("dp_sp")))
        if dp_group
        else (lambda: None)
    )
    if dp_group and p.dp_sync != "allreduce":  # ring / hierarchical (validation refuses the others)
        strategy = flat_strategy(p.dp_sync, mesh, CommCounter())
        sync = lambda: sync_flat(stages, strategy)
    if dp_group and mesh.size("ep") > 1:
        sync = lambda: expert_gradients.sync_gradients(stages, mesh)  # experts reduce over edp
    if master:
        sync = optimizer.finish_gradients
    runner.label_group = shard.group if shard else None  # masked labels: counted over the sp slices
    engine = PipelineEngine(runner, optimizer, stages, mesh["pp"].get_group(), autocast, device, loss_ctx, sync)
    engine.moe = held.moe
    engine.preference = preference
    return engine


def _stage_loss(stages, adapter, shard, chunk_tokens: int):
    """The pipeline's loss_fn(last stage output, labels): chunked head + cross-entropy when
    `train.loss_chunk_tokens` > 0 (the last stage then returns the final-norm output), else the
    plain token loss of the stage's logits (context parallelism: its sp-scaled loss)."""
    last = [s for s in stages if s.is_last]
    if chunk_tokens <= 0 or not last:
        return shard.loss if shard else token_loss
    last[0].head_in_loss = True
    head = last[0].get_submodule(adapter.lm_head_path)

    def loss_fn(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        total = head_loss_sum(head, hidden, labels, chunk_tokens, final_softcap(last[0].config))
        return shard.scale_sum(total, labels) if shard else total / labelled_count(labels)

    return loss_fn
