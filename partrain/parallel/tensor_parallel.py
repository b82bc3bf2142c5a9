"""Tensor parallelism (Megatron column/row slicing) and Megatron sequence parallelism.

Applied to the meta model, before FSDP and before weights exist, on the "tp" axis of partrain's
mesh; every parameter it slices becomes a DTensor, so FSDP2 (2-D), distributed checkpoints and
`full_tensor()` see the true global shapes.

- Llama family (llama, qwen2, mistral, and the attention of MoE models): transformers' own
  `base_model_tp_plan` (colwise q/k/v, gate/up; rowwise o, down) is translated into torch's
  parallel styles, so an HF architecture that ships a plan needs no new code here. Routed experts
  are replicated over the TP group (their MoE plan entries are skipped; expert parallelism shards
  them instead). Qwen3-MoE's per-head q_norm / k_norm ("replicated_with_grad_allreduce") stay
  whole on every rank and their gradients are summed over TP.
- GPT-2 (HF has no plan): attention is one fused Conv1D `c_attn` (weight stored [in, out]) holding
  Q, K and V side by side. A plain column split would hand rank 0 all of Q and half of K; instead
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
  `sharded_saves=False` keeps torch's styles instead (Llama family; they save the gathered input),
  for comparison in benchmarks/sp_memory.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Dict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from partrain.errors import ConfigError, Problem
from partrain.models.adapters import Adapter
from partrain.parallel import megatron_sp
from partrain.parallel.compile import eager

LAYER_WILDCARD = ".*."
MOE_STYLES = ("packed_colwise", "moe_tp_experts", "grouped_gemm", "ep_dispatch_experts")
BLOCK_OUTPUTS = ("o_proj", "down_proj")
"""Row-parallel projections that end an attention or MLP block (their output is the residual)."""
HEAD_NORMS = ("q_norm", "k_norm")
"""Per-head norms inside attention (Qwen3-MoE), after the column-parallel q/k projections."""


# -- Megatron's f and g for hand-written (Conv1D) layers --------------------------------------------
class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward (entering a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """All-reduce forward; identity backward (leaving a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _shard_param(module: nn.Module, name: str, mesh: DeviceMesh, placement) -> None:
    param = getattr(module, name)
    sharded = distribute_tensor(param.data, mesh, [placement], src_data_rank=None)
    module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


class ColumnParallelConv1D(nn.Module):
    """HF Conv1D (y = x @ W + b, W [in, out]) with the output features split over the TP group."""

    def __init__(self, conv: nn.Module, mesh: DeviceMesh, fused_parts: int) -> None:
        super().__init__()
        self.nf = conv.nf
        self.weight, self.bias = conv.weight, conv.bias
        self.group = mesh.get_group()
        weight_place = _StridedShard(1, split_factor=fused_parts) if fused_parts > 1 else Shard(1)
        bias_place = _StridedShard(0, split_factor=fused_parts) if fused_parts > 1 else Shard(0)
        _shard_param(self, "weight", mesh, weight_place)
        _shard_param(self, "bias", mesh, bias_place)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTensorParallel_eager(x, self.group)
        w, b = self.weight.to_local(), self.bias.to_local()
        out = torch.addmm(b, x.reshape(-1, x.shape[-1]), w)
        return out.view(*x.shape[:-1], w.shape[1])


class RowParallelConv1D(nn.Module):
    """HF Conv1D with the input features split over the TP group; outputs summed by all-reduce."""

    def __init__(self, conv: nn.Module, mesh: DeviceMesh) -> None:
        super().__init__()
        self.nf = conv.nf
        self.weight, self.bias = conv.weight, conv.bias
        self.group = mesh.get_group()
        _shard_param(self, "weight", mesh, Shard(0))
        _shard_param(self, "bias", mesh, Replicate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.weight.to_local(), self.bias.to_local()
        partial = x.reshape(-1, x.shape[-1]) @ w
        out = _ReduceFromTensorParallel_eager(partial, self.group) + b
        return out.view(*x.shape[:-1], w.shape[1])


def _replace(parent: nn.Module, path: str, new: nn.Module) -> None:
    owner_path, _, attr = path.rpartition(".")
    owner = parent.get_submodule(owner_path) if owner_path else parent
    setattr(owner, attr, new)


def _gpt2_layer(layer: nn.Module, mesh: DeviceMesh) -> None:
    tp = mesh.size()
    attn = layer.attn
    _replace(layer, "attn.c_attn", ColumnParallelConv1D(attn.c_attn, mesh, fused_parts=3))
    _replace(layer, "attn.c_proj", RowParallelConv1D(attn.c_proj, mesh))
    # The fused output is split into q, k, v by width: each rank now holds embed_dim / tp of each.
    attn.split_size = attn.split_size // tp
    attn.num_heads = attn.num_heads // tp
    _replace(layer, "mlp.c_fc", ColumnParallelConv1D(layer.mlp.c_fc, mesh, fused_parts=1))
    _replace(layer, "mlp.c_proj", RowParallelConv1D(layer.mlp.c_proj, mesh))


def _gpt2_layer_sp(layer: nn.Module, mesh: DeviceMesh) -> None:
    """GPT-2 block under Megatron-SP: norms on sequence shards, gathered-once column projections
    saving the shard, row projections reduce-scattering back to shards."""
    tp = mesh.size()
    attn = layer.attn
    megatron_sp.install_block(attn, ["c_attn"], mesh, conv=True, fused={"c_attn": 3})
    _replace(layer, "attn.c_proj", megatron_sp.SequenceRowConv1D(attn.c_proj, mesh))
    attn.split_size = attn.split_size // tp
    attn.num_heads = attn.num_heads // tp
    megatron_sp.install_block(layer.mlp, ["c_fc"], mesh, conv=True, fused={})
    _replace(layer, "mlp.c_proj", megatron_sp.SequenceRowConv1D(layer.mlp.c_proj, mesh))
    parallelize_module(layer, mesh, {"ln_1": SequenceParallel(), "ln_2": SequenceParallel()})
    megatron_sp.sequence_dropouts(layer, ["attn.resid_dropout", "mlp.dropout"], mesh)


# -- HF plans -> torch parallel styles ----------------------------------------------------------------
def _style(name: str, key: str, sequence_parallel: bool, model_type: str):
    leaf = key.rsplit(".", 1)[-1]
    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        if sequence_parallel and leaf in BLOCK_OUTPUTS:
            return RowwiseParallel(output_layouts=Shard(1))
        return RowwiseParallel()
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


def _sequence_parallel_layer_plan(layer: nn.Module, adapter: Adapter, sharded_saves: bool) -> Dict[str, object]:
    plan: Dict[str, object] = {}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        if hasattr(layer, norm):
            plan[norm] = SequenceParallel()
    if sharded_saves:  # attention and dense MLP gather inside megatron_sp.install_block
        if adapter.experts(layer) is not None:
            plan[adapter.mlp_attr] = _moe_sequence_parallel(layer, adapter)
        return plan
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


def _install_sharded_saves(layer: nn.Module, adapter: Adapter, plan: Dict[str, object], mesh: DeviceMesh) -> None:
    """Take the column-parallel projections that read a block's input straight away (q, k, v; dense
    gate, up) out of `plan` and run them through megatron_sp (one gather, the shard saved)."""
    blocks = [adapter.attention_attr] + ([adapter.mlp_attr] if adapter.experts(layer) is None else [])
    for block in blocks:
        prefix = block + "."
        cols = [
            k[len(prefix) :]
            for k, style in plan.items()
            if k.startswith(prefix) and "." not in k[len(prefix) :] and isinstance(style, ColwiseParallel)
        ]
        for c in cols:
            del plan[prefix + c]
        megatron_sp.install_block(layer.get_submodule(block), cols, mesh, conv=False, fused={})


def _replicated_block_inputs(layer: nn.Module, adapter: Adapter) -> Dict[str, object]:
    """Enter each attention / dense MLP block once as a replicated DTensor.

    Without this every column-parallel projection (q, k, v; gate, up) turns the plain input into
    a DTensor itself and all-reduces its own input gradient in backward: 5 all-reduces per layer
    where 2 suffice (measured: 68 -> 44 all-reduces per step, about 8% less CPU per step).
    """
    plan: Dict[str, object] = {
        adapter.attention_attr: PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Replicate()},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=False,
        )
    }
    if adapter.experts(layer) is None:  # replicated experts compute on plain tensors
        plan[adapter.mlp_attr] = PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_output=False
        )
    return plan


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
    if adapter.conv1d_weights:
        for layer in entries:
            (_gpt2_layer_sp if sequence_parallel else _gpt2_layer)(layer, mesh)
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
            if sharded_saves:
                _install_sharded_saves(layer, adapter, plan, mesh)
            # Module-input preparation first, then the projections inside.
            plan = {**_sequence_parallel_layer_plan(layer, adapter, sharded_saves), **plan}
        else:
            plan = {**_replicated_block_inputs(layer, adapter), **plan}
        for key, style in plan.items():
            for s in style if isinstance(style, list) else [style]:
                parallelize_module(layer, mesh, {key: s})


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
    if tied:
        # Both styles shard the [vocab, hidden] weight on dim 0: keep one parameter for both uses.
        model.get_submodule(adapter.lm_head_path).weight = model.get_submodule(token_embedding).weight


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
    parallelize_layers(model, adapter, mesh, sequence_parallel, sharded_saves or bool(adapter.conv1d_weights))
    parallelize_ends(model, adapter, mesh, sequence_parallel, use_loss_parallel)


def loss_context(tp_size: int, use_loss_parallel: bool) -> Callable[[], ContextManager]:
    """Context for forward+backward: cross-entropy over vocabulary shards when loss parallel is on."""
    if tp_size > 1 and use_loss_parallel:
        return loss_parallel
    return contextlib.nullcontext


# Run eagerly inside compiled blocks (partrain.parallel.compile.eager: collectives, Python state).
_CopyToTensorParallel_eager = eager(_CopyToTensorParallel.apply)
_ReduceFromTensorParallel_eager = eager(_ReduceFromTensorParallel.apply)
