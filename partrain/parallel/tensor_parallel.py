"""Tensor parallelism (Megatron column/row slicing) and Megatron sequence parallelism.

Applied to the meta model, before FSDP and before weights exist, on the "tp" axis of partrain's
mesh; every parameter it slices becomes a DTensor, so FSDP2 (2-D), distributed checkpoints and
`full_tensor()` see the true global shapes.

- Llama family (llama, qwen2, mistral, and the attention of MoE models): transformers' own
  `base_model_tp_plan` (colwise q/k/v, gate/up; rowwise o, down) says which projection is which,
  so an HF architecture that ships a plan needs no new code here. The projections become
  partrain's own local-tensor modules (`partrain.parallel.tp_layers`: DTensor parameters, plain
  compute, eager collectives), which `train.compile` can trace; torch's styles remain for what has
  no own module (Qwen3-MoE's head norms, the MoE block's gather under SP). Routed experts
  are replicated over the TP group (their MoE plan entries are skipped; expert parallelism shards
  them instead). Qwen3-MoE's per-head q_norm / k_norm ("replicated_with_grad_allreduce") stay
  whole on every rank and their gradients are summed over TP.
- GPT-2 (HF has no plan; partrain's own, as data: models/families/gpt2.py): attention is one
  fused Conv1D `c_attn` (weight stored [in, out]) holding Q, K and V side by side. A plain column
  split would hand rank 0 all of Q and half of K; instead
  its columns use `_StridedShard(1, split_factor=3)`, so each rank holds the columns of its own
  heads of Q, K and V ([q_r | k_r | v_r]) while the DTensor's global view stays HF's layout.
  `c_proj` is row-parallel; MLP `c_fc` column-, `c_proj` row-parallel.
- Vocabulary-parallel token embedding and output head; with loss parallel the logits stay sharded
  over the vocabulary and cross-entropy runs on the shards (never the full vocabulary on a rank).
  Tied embeddings (GPT-2) share one sharded parameter.
- Sequence parallelism (`parallel.tp_sequence_parallel`, every family): norms, dropouts and the
  residual stream run on sequence shards; the all-reduce of each row-parallel layer becomes a
  reduce-scatter, and each block's column-parallel projections start with one all-gather and save
  only the sequence shard (re-gathered in backward: `partrain.parallel.megatron_sp`). GPT-2's
  learned positions are looked up whole and each rank keeps its chunk before the add.
  `sharded_saves=False` keeps torch's styles throughout instead (Llama family; they save the
  gathered input), for comparison in benchmarks/sp_memory.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict, List

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from partrain.errors import ConfigError, Problem
from partrain.models.adapters import Adapter, Conv1DLayerPlan
from partrain.parallel import megatron_sp, tp_layers

LAYER_WILDCARD = ".*."
MOE_STYLES = ("packed_colwise", "moe_tp_experts", "grouped_gemm", "ep_dispatch_experts")
BLOCK_OUTPUTS = ("o_proj", "down_proj")
"""Row-parallel projections that end an attention or MLP block (their output is the residual)."""
HEAD_NORMS = ("q_norm", "k_norm")
"""Per-head norms inside attention (Qwen3-MoE), after the column-parallel q/k projections."""


def _replace(parent: nn.Module, path: str, new: nn.Module) -> None:
    owner_path, _, attr = path.rpartition(".")
    owner = parent.get_submodule(owner_path) if owner_path else parent
    setattr(owner, attr, new)


def _own_plan_layer(layer: nn.Module, plan: Conv1DLayerPlan, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Slice one decoder layer by the family's own plan (GPT-2: models/families/gpt2.py). Under
    Megatron-SP: norms on sequence shards, gathered-once column projections saving the shard, row
    projections reduce-scattering back to shards."""
    tp = mesh.size()
    for spec in plan.blocks:
        block = layer.get_submodule(spec.path)
        if sequence_parallel:
            names = [name for name, _ in spec.column]
            megatron_sp.install_block(block, names, mesh, conv=True, fused={n: k for n, k in spec.column if k > 1})
        else:
            for name, parts in spec.column:
                _replace(block, name, tp_layers.ColumnParallelConv1D(getattr(block, name), mesh, fused_parts=parts))
        for name in spec.row:
            row = tp_layers.RowParallelConv1D(getattr(block, name), mesh, to_sequence=sequence_parallel)
            _replace(block, name, row)
        for attr in spec.per_rank:  # head counts and split widths: each rank now holds 1 / tp of them
            setattr(block, attr, getattr(block, attr) // tp)
    if sequence_parallel:
        for norm in plan.sequence_norms:
            tp_layers.sequence_norm(layer.get_submodule(norm), mesh)
        megatron_sp.sequence_dropouts(layer, list(plan.sequence_dropouts), mesh)


# -- HF plans -> torch parallel styles ----------------------------------------------------------------
def _style(name: str, key: str, sequence_parallel: bool, model_type: str):
    leaf = key.rsplit(".", 1)[-1]
    if name == "colwise":
        return ColwiseParallel()
    if name == "colwise_gather_output":  # what follows needs the whole output (see tp_layers)
        return ColwiseParallel(output_layouts=Replicate())
    if name == "rowwise":
        if sequence_parallel and leaf in BLOCK_OUTPUTS:
            return RowwiseParallel(output_layouts=Shard(1))
        return RowwiseParallel()
    if name == "rowwise_split_input":  # its input is whole on every rank: each takes its slice
        return RowwiseParallel(input_layouts=Replicate())
    if name == "replicated_with_grad_allreduce" and leaf in HEAD_NORMS:
        # A per-head norm after a column-parallel q/k projection sees [batch, seq, local heads,
        # head_dim]: its weight stays whole on every rank, and each rank's gradient covers only its
        # own heads, so the gradients must be summed over TP. SequenceParallel does exactly that
        # with the heads dimension as the "sequence" one (input marked Shard(2), weight Replicate:
        # the weight's gradient comes out Partial(sum), summed over TP where it is used - optimizer
        # step, gradient norm - as for Megatron-SP's norms), then hands back local heads.
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    raise ConfigError(
        Problem(
            "parallel.tp",
            "",
            f"{model_type}'s tensor-parallel plan uses style {name!r} for {key}, which partrain does not translate",
            "set parallel.tp=1 for this model",
        )
    )


def layer_plan_from_hf(
    hf_plan: Dict[str, str], adapter: Adapter, sequence_parallel: bool, model_type: str
) -> Dict[str, object]:
    """Per-layer styles (keys relative to one decoder layer) from transformers' base_model_tp_plan."""
    prefix = adapter.layer_prefix + LAYER_WILDCARD
    plan: Dict[str, object] = {}
    for key, style in hf_plan.items():
        if not key.startswith(prefix):
            continue  # embeddings and head are handled by partrain (vocab parallel)
        rel = key[len(prefix) :]
        if style in MOE_STYLES or (adapter.experts_attr and rel.startswith(adapter.experts_attr)):
            continue  # experts stay replicated over TP; expert parallelism shards them
        plan[rel] = _style(style, key, sequence_parallel, model_type)
    return plan


def _torch_sequence_parallel_plan(layer: nn.Module, adapter: Adapter) -> Dict[str, object]:
    """Megatron-SP through torch's styles only (`sharded_saves=False`: benchmarks/sp_memory.py's
    comparison): SequenceParallel norms, and attention / MLP inputs gathered by PrepareModuleInput."""
    plan: Dict[str, object] = {}
    for norm in adapter.layer_norms:
        if hasattr(layer, norm):
            plan[norm] = SequenceParallel()
    # HF passes hidden_states to attention by keyword and to the MLP positionally.
    plan[adapter.attention_attr] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)},
        desired_input_kwarg_layouts={"hidden_states": Replicate()},
        use_local_output=True,
    )
    if adapter.experts(layer) is not None:
        plan[adapter.mlp_attr] = _moe_sequence_parallel(layer, adapter)
    else:
        plan[adapter.mlp_attr] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def _moe_sequence_parallel(layer: nn.Module, adapter: Adapter) -> list:
    """Replicated experts see the whole sequence (gathered) and return a full local tensor: hand the
    residual stream back as local sequence shards (as after down_proj)."""
    return [
        PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True),
    ]


def _input_blocks(layer: nn.Module, adapter: Adapter) -> List[str]:
    """The blocks whose column projections read the block's input straight away: attention, and the
    MLP when it is dense (replicated routed experts compute on plain tensors)."""
    return [adapter.attention_attr] + ([adapter.mlp_attr] if adapter.experts(layer) is None else [])


def _direct_columns(plan: Dict[str, object], block: str) -> List[str]:
    prefix = block + "."
    return [
        k[len(prefix) :]
        for k, style in plan.items()
        if k.startswith(prefix) and "." not in k[len(prefix) :] and isinstance(style, ColwiseParallel)
    ]


def _install_sharded_saves(layer: nn.Module, adapter: Adapter, plan: Dict[str, object], mesh: DeviceMesh) -> None:
    """Megatron-SP: take the column-parallel projections that read a block's input straight away (q,
    k, v; dense gate, up) out of `plan` and run them through megatron_sp (one gather, the shard
    saved); the layer's norms run on sequence shards."""
    for block in _input_blocks(layer, adapter):
        cols = _direct_columns(plan, block)
        for c in cols:
            del plan[f"{block}.{c}"]
        megatron_sp.install_block(layer.get_submodule(block), cols, mesh, conv=False, fused={})
    for norm in adapter.layer_norms:
        if hasattr(layer, norm):
            tp_layers.sequence_norm(getattr(layer, norm), mesh)
    if adapter.experts(layer) is not None:
        plan[adapter.mlp_attr] = _moe_sequence_parallel(layer, adapter)


def _install_projections(
    layer: nn.Module, adapter: Adapter, plan: Dict[str, object], mesh: DeviceMesh, sequence_parallel: bool
) -> None:
    """Replace the plan's column- and row-parallel nn.Linears by partrain's own modules (tp_layers)
    and take them out of `plan`. Each attention / dense MLP block applies Megatron's f once to its
    input (`copy_block_input`): q, k and v (gate and up) then sum their input gradients locally and
    all-reduce once, 2 all-reduces per layer where one per projection would make 5."""
    # Under SP the block's gather (megatron_sp) is its entry instead.
    hooked = [] if sequence_parallel else [b for b in _input_blocks(layer, adapter) if _direct_columns(plan, b)]
    for block in hooked:
        tp_layers.copy_block_input(layer.get_submodule(block), mesh.get_group())
    for key, style in list(plan.items()):
        parent, _, leaf = key.rpartition(".")
        if isinstance(style, ColwiseParallel):
            new: nn.Module = tp_layers.ColumnParallelLinear(
                layer.get_submodule(key), mesh, copies_input=parent not in hooked, gather_output=_gathers(style)
            )
        elif isinstance(style, RowwiseParallel):
            new = tp_layers.RowParallelLinear(
                layer.get_submodule(key),
                mesh,
                to_sequence=sequence_parallel and leaf in BLOCK_OUTPUTS and not _in_moe_block(layer, adapter, key),
                split_input=_gathers(style),
            )
        else:
            continue
        _replace(layer, key, new)
        del plan[key]


def _gathers(style: object) -> bool:
    """A column style whose output, or a row style whose input, is whole on every rank (Replicate)."""
    layouts = style.output_layouts if isinstance(style, ColwiseParallel) else style.input_layouts
    return isinstance(layouts[0], Replicate)


def shard_embedding_gradient(module: nn.Module, adapter: Adapter) -> None:
    """Keep the vocabulary-parallel embedding's gradient sharded like its weight.

    DTensor's embedding backward returns a Replicate [vocab, hidden] gradient on every rank: a full
    copy per rank (2 GiB of fp32 for Llama-3-8B at any tp). Call after materialize (to_empty
    replaces parameters and would drop the hook).
    """
    path = adapter.embedding_paths[0]
    if not _has(module, path):
        return
    weight = module.get_submodule(path).weight
    if not weight.requires_grad:
        return  # frozen (peft=lora): no gradient to shard
    if isinstance(weight, DTensor) and any(not isinstance(p, Replicate) for p in weight.placements):
        mesh, placements = weight.device_mesh, weight.placements
        weight.register_hook(lambda g: g.redistribute(mesh, placements) if g.placements != placements else g)


def parallelize_layers(
    model: nn.Module, adapter: Adapter, mesh: DeviceMesh, sequence_parallel: bool, sharded_saves: bool
) -> None:
    """Slice the model's decoder layers over the TP mesh (apply_tp's layer half). It works on a mesh of
    one rank too, which `partrain bench compute` uses to time what the wrappers add to a layer."""
    layers = adapter.layers(model)
    entries = layers.values() if isinstance(layers, nn.ModuleDict) else layers
    if adapter.layer_tp_plan is not None:  # the family's own plan (HF ships none)
        for layer in entries:
            _own_plan_layer(layer, adapter.layer_tp_plan, mesh, sequence_parallel)
        return
    hf_plan = adapter.hf_plan(model, "tp")
    if not hf_plan:
        raise ConfigError(
            Problem(
                "parallel.tp",
                mesh.size(),
                f"{model.config.model_type} has no tensor-parallel plan",
                "set parallel.tp=1",
            )
        )
    base = layer_plan_from_hf(hf_plan, adapter, sequence_parallel, model.config.model_type)
    for layer in entries:
        plan = {k: v for k, v in base.items() if _has(layer, k)}
        if sequence_parallel:
            _whole_outputs_inside_moe_blocks(layer, adapter, plan)
        if sequence_parallel and not sharded_saves:
            # Module-input preparation first, then the projections inside.
            plan = {**_torch_sequence_parallel_plan(layer, adapter), **plan}
        else:
            if sequence_parallel:
                _install_sharded_saves(layer, adapter, plan, mesh)
            _install_projections(layer, adapter, plan, mesh, sequence_parallel)
        for key, style in plan.items():  # what is left: torch's styles (MoE SP, head norms, sp_memory)
            for s in style if isinstance(style, list) else [style]:
                parallelize_module(layer, mesh, {key: s})


def _in_moe_block(layer: nn.Module, adapter: Adapter, key: str) -> bool:
    """Whether `key` is inside the MoE block of `layer` (GLM-4.5's shared experts, split by its tp plan)."""
    return adapter.experts(layer) is not None and key.startswith(adapter.mlp_attr + ".")


def _whole_outputs_inside_moe_blocks(layer: nn.Module, adapter: Adapter, plan: Dict[str, object]) -> None:
    """Under Megatron-SP an MoE block gathers the sequence and hands its output back as shards itself
    (_moe_sequence_parallel): a row-parallel projection inside it (a shared expert's down_proj) sums its
    output whole, to add to the routed experts' whole output, instead of reduce-scattering it."""
    for key, style in plan.items():
        if isinstance(style, RowwiseParallel) and _in_moe_block(layer, adapter, key):
            plan[key] = RowwiseParallel()


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
        return True
    except AttributeError:
        return False


def parallelize_ends(
    model: nn.Module, adapter: Adapter, mesh: DeviceMesh, sequence_parallel: bool, use_loss_parallel: bool
) -> None:
    """Slice the token embedding and the output head over the TP mesh (apply_tp's other half)."""
    token_embedding = adapter.embedding_paths[0]
    plan: Dict[str, object] = {}
    if _has(model, token_embedding):
        plan[token_embedding] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sequence_parallel else Replicate()
        )
    if sequence_parallel and _has(model, adapter.final_norm_path):
        plan[adapter.final_norm_path] = SequenceParallel()
    if sequence_parallel:
        for path in adapter.embedding_paths[1:]:  # learned positions (GPT-2 wpe): this rank's chunk
            if _has(model, path):
                megatron_sp.scatter_positions(model.get_submodule(path), mesh)
                megatron_sp.sequence_dropouts(model, [adapter.base_prefix + ".drop"], mesh)  # after wte + wpe
    if _has(model, adapter.lm_head_path):
        plan[adapter.lm_head_path] = ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1) if use_loss_parallel else Replicate(),
            use_local_output=not use_loss_parallel,
        )
    tied = adapter.tied_embeddings(model) and len(plan) >= 2
    parallelize_module(model, mesh, plan)
    if token_embedding in plan:
        model.get_submodule(token_embedding).register_forward_hook(_settled_output)
    if tied:
        # Both styles shard the [vocab, hidden] weight on dim 0: keep one parameter for both uses.
        model.get_submodule(adapter.lm_head_path).weight = model.get_submodule(token_embedding).weight


def _settled_output(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    """The vocabulary-parallel embedding's output as a plain tensor. RowwiseParallel hands back the
    AsyncCollectiveTensor of its all-reduce (reduce-scatter under SP), which waits at its first use.
    That first use is inside the first decoder block: a compiled block then traces the wait and its
    backward loses the DTensor gradient (torch 2.13: a crash at zero 0, gradients 4-13% off under
    FSDP). Any out-of-place op waits here, eagerly, with its gradient intact."""
    return out * 1


def apply_tp(
    model: nn.Module,
    adapter: Adapter,
    mesh: DeviceMesh,
    sequence_parallel: bool,
    use_loss_parallel: bool = True,
    sharded_saves: bool = True,
) -> None:
    """Slice `model` (on the meta device) over the TP mesh in place. `sharded_saves=False` (Llama
    family, SP only) uses torch's styles, which save the gathered inputs (benchmark comparison)."""
    if mesh.size() == 1:
        return
    parallelize_layers(model, adapter, mesh, sequence_parallel, sharded_saves or adapter.layer_tp_plan is not None)
    parallelize_ends(model, adapter, mesh, sequence_parallel, use_loss_parallel)


def loss_context(tp_size: int, use_loss_parallel: bool) -> Callable[[], ContextManager]:
    """Context for forward+backward: cross-entropy over vocabulary shards when loss parallel is on."""
    if tp_size > 1 and use_loss_parallel:
        return loss_parallel
    return contextlib.nullcontext
