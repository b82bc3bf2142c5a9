"""Shard this rank's share of the model on the meta device, in one documented order.

    meta model -> pipeline split (this rank's chunks) -> float8 linears (train.float8; torchtitan's
    place: before every wrapper) -> tensor parallel (and Megatron-SP)
    -> context parallel (sp attention) -> expert parallel -> LoRA adapters (peft=lora; base frozen)
    -> recompute -> compile (each block)
    -> FSDP (zero_stage 2/3; experts on their own edp mesh)

`partrain.train.assemble` then materializes the weights and adds DDP / gradient sync, the
optimizer and the engine. Everything here runs on the meta device, so no rank ever allocates the
full model when the layout shards it. Every axis exists (size 1 when unused); the code asks the mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from torch import nn

from partrain.blueprint.validate import ValidatedRun
from partrain.data.example_packing import packs_documents
from partrain.models.adapters import get_adapter
from partrain.models.build import build_meta_model
from partrain.parallel import data_parallel, expert_gradients, expert_parallel
from partrain.parallel.compile import apply_compile, compile_enabled
from partrain.parallel.context_parallel import apply_sp, sequence_shard
from partrain.parallel.float8 import apply_float8
from partrain.parallel.lora import apply_lora
from partrain.parallel.recompute import apply_recompute
from partrain.parallel.tensor_parallel import apply_tp
from partrain.runtime.mesh import ParallelMesh


def _shard(module: nn.Module, v: ValidatedRun, mesh: ParallelMesh, adapter, moe=None) -> None:
    p = v.run.parallel
    fsdp, lora = data_parallel.uses_fsdp(p.zero_stage), v.run.peft.method == "lora"
    apply_float8(module, v.run.train, fsdp, mesh.size("tp"), lora)
    apply_tp(module, adapter, mesh["tp"], sequence_parallel=p.tp_sequence_parallel)
    # Packed examples: the sp attention keeps each query inside its example (document masks).
    apply_sp(module, adapter, sequence_shard(mesh, p.sp_mode, packs_documents(v.run.data)), v.run.train.seq_len)
    if moe is not None:
        expert_parallel.apply_ep(module, adapter, mesh["ep"], moe)
    # Adapters against the post-TP projections; after EP, whose re-made expert parameters it freezes too.
    apply_lora(module, adapter, v.run.peft, v.facts.arch)
    apply_recompute(module, adapter, p.recompute, p.recompute_every)
    if compile_enabled(v.run):
        apply_compile(module, adapter, v.run.train.compile_backend)
    if data_parallel.uses_fsdp(p.zero_stage):
        if moe is not None:
            expert_gradients.shard_experts_fsdp(module, mesh, p.zero_stage, v.run.train.precision)
        data_parallel.apply_fsdp(
            module, adapter, mesh, p.zero_stage, v.run.train.precision, v.run.train.loss_chunk_tokens > 0
        )


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
    if moe is not None and mesh.size("sp") > 1:
        moe.sp_group, moe.sp_size = mesh["sp"].get_group(), mesh.size("sp")
    if mesh.size("pp") == 1:
        _shard(model, v, mesh, adapter, moe)
        return RankModules(model, adapter, [model], moe=moe)
    from partrain.blueprint.stage_split import plan_chunks
    from partrain.parallel.pipeline import build_stage_module

    run, p = v.run, v.run.parallel
    pp, vstages = mesh.size("pp"), p.pp_virtual_stages
    plan = plan_chunks(v.facts, pp, vstages, p.pp_schedule, run.train.seq_len, p.pp_layers_per_stage)
    chunks = plan["placement"][mesh.local("pp")]
    stages: List[nn.Module] = [build_stage_module(model, adapter, c, pp * vstages, plan["ranges"][c]) for c in chunks]
    for stage in stages:
        if mesh.size("tp") > 1 and p.tp_sequence_parallel:
            # Under Megatron-SP a later stage receives a sequence shard: its positions (rotary, masks)
            # are those of the whole (context-parallel) sequence, as on the first stage.
            stage.seq_len = run.train.seq_len // mesh.size("sp")
        _shard(stage, v, mesh, adapter, moe)
    return RankModules(model, adapter, stages, list(chunks), moe=moe)
