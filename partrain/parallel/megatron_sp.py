"""Megatron sequence parallelism with sharded saves (Korthikanti et al. 2022, section 4.2.2).

Under Megatron-SP the residual stream, the norms and the dropouts run on sequence shards
[b, s/t, h]; each attention / MLP block starts with an all-gather along the sequence (Megatron's
g) and ends with a reduce-scatter (g-bar). torch's styles (ColwiseParallel after a gather) save
the gathered input of every column-parallel projection for its weight gradient: s·b·h on every
rank, which SP was meant to divide by t. Here the column-parallel projections of a block run in
one autograd function (`_GatherColumns`) that

- forward: all-gathers the sequence shard once and computes every projection of the block
  (q, k, v or gate, up; GPT-2's fused c_attn or c_fc) from it, saving only the shard;
- backward: launches the all-gather of the saved shard again (async) and computes the input
  gradient GEMMs meanwhile; then launches the reduce-scatter of the input gradient (async) and
  computes the weight-gradient GEMMs while it runs (the overlaps of Megatron's
  `LinearWithGradAccumulationAndAsyncCommunication`; gloo runs the collectives on its own
  threads, NCCL on its stream).

Wiring (no HF forward is rewritten): each projection is replaced by a `SequenceColumn` module that
keeps its parameters (same names, DTensors sharded like ColwiseParallel / GPT-2's strided c_attn,
so FSDP2 and distributed checkpoints see the usual global shapes). A forward pre-hook on the block
takes the sequence shard, runs `_GatherColumns` and hands each `SequenceColumn` its output; the
block itself receives a zero-byte stand-in of the full [b, s, h] shape (HF reads only its shape).
Row-parallel projections end the block with a reduce-scatter to sequence shards
(`partrain.parallel.tp_layers`' row-parallel modules with `to_sequence`). HF builds the attention
mask from the embeddings, here sequence shards: a mask it built (packed examples, from position ids)
covers s/t tokens, so the attention block's pre-hook rebuilds it for whole rows (`_whole_row_mask`).
Under `train.float8` the gathered projections' matmuls (forward and both gradients) run through
`float8_tp`.

Dropout in the sequence-parallel regions (GPT-2's embedding and residual dropout) is
`SequenceDropout`: each rank draws the whole tensor's mask with the generator every rank seeds alike
(`train.seed`) and keeps its chunk, so the masks are those of the unsplit run (parity-tested with
resid/embd dropout 0.1). Attention dropout runs inside the core on head shards, as under plain TP,
and does not reproduce the unsplit masks (nor does plain TP's).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.profiler import record_function

from partrain.parallel import float8_tp
from partrain.parallel.compile import eager
from partrain.parallel.tp_ops import local_fused_bias

SEQ_DIM = 1
"""Sequence dimension of HF hidden states [batch, seq, hidden]."""


# ---- collectives along the sequence dimension ---------------------------------------------------------
def _gather_seq(x: torch.Tensor, group, async_op: bool = False):
    """All-gather [b, s/t, h] shards into [b, s, h] (rank order); (tensor, work) when async_op."""
    t = dist.get_world_size(group)
    shard = x.transpose(0, SEQ_DIM).contiguous()  # [s/t, b, h]: gather along dim 0 is contiguous
    out = shard.new_empty((shard.shape[0] * t, *shard.shape[1:]))
    with record_function("partrain/tp/all_gather"):  # Megatron-SP: sequence shards over the tp group
        work = dist.all_gather_single(out, shard, group=group, async_op=async_op)
    if async_op:  # the caller transposes back after wait() (the buffer is not filled yet)
        return out, work
    return out.transpose(0, SEQ_DIM).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group, async_op: bool = False):
    """Sum [b, s, h] over the group and keep this rank's [b, s/t, h]; (tensor, work) when async_op."""
    t = dist.get_world_size(group)
    whole = x.transpose(0, SEQ_DIM).contiguous()
    out = whole.new_empty((whole.shape[0] // t, *whole.shape[1:]))
    with record_function("partrain/tp/reduce_scatter"):
        work = dist.reduce_scatter_single(out, whole, group=group, async_op=async_op)
    if async_op:
        return out, work
    return out.transpose(0, SEQ_DIM).contiguous()


class ScatterToSequence(torch.autograd.Function):
    """Keep this rank's sequence chunk of a tensor every rank holds whole; backward all-gathers the
    gradient, so a replicated weight upstream (GPT-2's wpe) gets the same whole gradient on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        n = x.shape[SEQ_DIM] // t
        return x.narrow(SEQ_DIM, r * n, n).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad.contiguous(), ctx.group), None


class ReduceScatterToSequence(torch.autograd.Function):
    """Row-parallel partial sums -> this rank's sequence shard of their sum; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad.contiguous(), ctx.group), None


# ---- the fused gather + column-parallel projections -------------------------------------------------
def _project(full: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], conv: bool) -> torch.Tensor:
    if conv:  # HF Conv1D: y = x @ W + b with W [in, out]
        flat = full.reshape(-1, full.shape[-1])
        out = torch.addmm(b, flat, w) if b is not None else flat @ w
        return out.view(*full.shape[:-1], w.shape[1])
    return torch.nn.functional.linear(full, w, b)


class _GatherColumns(torch.autograd.Function):
    """outs[i] = gather_seq(x) @ W_i (+ b_i), saving only the shard x (see module docstring)."""

    @staticmethod
    def forward(ctx, x, group, conv, has_bias, float8s, *params):
        ctx.group, ctx.conv, ctx.has_bias, ctx.float8s, ctx.dtype = group, conv, has_bias, float8s, x.dtype
        if any(float8s):
            # float8 projections (float8_tp) take the input in the dtype torchao's Float8Linear would.
            x = float8_tp.autocast_input(x)
        elif torch.is_autocast_enabled(x.device.type):
            # Cast once before the gather (autocast would cast the gathered input per projection):
            # half the traffic, and the 16-bit shard is what is kept.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        full = _gather_seq(x, group)
        outs, it = [], iter(params)
        for hb, f8 in zip(has_bias, float8s):
            w = next(it)
            b = next(it) if hb else None
            outs.append(_project(full, w, b, conv) if f8 is None else f8.project(full, w, b))
        ctx.save_for_backward(x, *params)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *params = ctx.saved_tensors
        weights, it = [], iter(params)
        for hb in ctx.has_bias:
            weights.append(next(it))
            if hb:
                next(it)
        full, gather = _gather_seq(x, ctx.group, async_op=True)
        # Input gradient of every projection while the shard is re-gathered.
        flat_grads = [g.reshape(-1, g.shape[-1]) for g in grads]
        grad_in = None
        for g, w, f8 in zip(flat_grads, weights, ctx.float8s):
            if f8 is not None:
                part = f8.grad_input(g, w)
            else:
                w = w.to(g.dtype)
                part = g @ w.t() if ctx.conv else g @ w
            grad_in = part if grad_in is None else grad_in + part
        grad_in = grad_in.view(*grads[0].shape[:-1], grad_in.shape[-1])
        gather.wait()
        full = full.transpose(0, SEQ_DIM)
        grad_x, scatter = _reduce_scatter_seq(grad_in, ctx.group, async_op=True)
        # Weight gradients while the input gradient is reduce-scattered.
        flat_full = full.reshape(-1, full.shape[-1])  # a copy in [b, s] order, like the gradients
        out: List[Optional[torch.Tensor]] = []
        for g, w, hb, f8 in zip(flat_grads, weights, ctx.has_bias, ctx.float8s):
            if f8 is not None:
                gw = f8.grad_weight(g, flat_full)
            else:
                x_in = flat_full.to(g.dtype)
                gw = x_in.t() @ g if ctx.conv else g.t() @ x_in
            out.append(gw.to(w.dtype))
            if hb:
                out.append(g.sum(0).to(w.dtype))
        scatter.wait()
        grad_x = grad_x.transpose(0, SEQ_DIM).contiguous()
        return (grad_x.to(ctx.dtype), None, None, None, None, *out)


class SequenceColumn(nn.Module):
    """A column-parallel projection (nn.Linear or HF Conv1D) whose output its block's pre-hook
    computes from the sequence shard (`_GatherColumns`); parameters keep their HF names."""

    def __init__(self, proj: nn.Module, mesh: DeviceMesh, conv: bool, fused_parts: int = 1) -> None:
        super().__init__()
        self.conv = conv
        if conv:
            self.nf = proj.nf
        else:
            self.in_features, self.out_features = proj.in_features, proj.out_features
        dim = 1 if conv else 0  # output features: Conv1D W [in, out], Linear W [out, in]
        strided = fused_parts > 1
        self.weight = sharded_parameter(
            proj.weight, mesh, _StridedShard(dim, split_factor=fused_parts) if strided else Shard(dim)
        )
        self.group, self.fused_parts = mesh.get_group(), fused_parts
        bias = getattr(proj, "bias", None)
        if bias is not None:  # a fused bias stays whole (tp_layers.local_fused_bias says why)
            self.bias = sharded_parameter(bias, mesh, Replicate() if strided else Shard(0))
        else:
            self.register_parameter("bias", None)
        # float8 matmuls (train.float8: `proj` is a torchao Float8Linear); None otherwise.
        self.float8 = None if conv else float8_tp.for_projection(proj, mesh, float8_tp.COLUMN)
        self._out: Optional[torch.Tensor] = None

    def local_params(self) -> List[torch.Tensor]:
        ps = [self.weight.to_local()]
        if self.bias is not None and self.fused_parts > 1:
            ps.append(local_fused_bias(self.bias, self.group, self.fused_parts))
        elif self.bias is not None:
            ps.append(self.bias.to_local())
        return ps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, self._out = self._out, None
        if out is None:
            raise RuntimeError("SequenceColumn called outside its block (the block's pre-hook computes it)")
        return out


def sharded_parameter(param: nn.Parameter, mesh: DeviceMesh, placement) -> nn.Parameter:
    """`param` as a DTensor parameter of `mesh` with `placement` (meta or real data, nothing sent)."""
    return nn.Parameter(distribute_tensor(param.data, mesh, [placement], src_data_rank=None), param.requires_grad)


def _block_input(args: tuple, kwargs: dict):
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"], True
    return args[0], False


def install_block(block: nn.Module, names: Sequence[str], mesh: DeviceMesh, conv: bool, fused: Dict[str, int]) -> None:
    """Replace `block`'s column-parallel projections `names` (direct children) by SequenceColumns
    fed from one `_GatherColumns` per call, and make the block take sequence shards."""
    group = mesh.get_group()
    t = mesh.size()
    cols = []
    for name in names:
        col = SequenceColumn(getattr(block, name), mesh, conv, fused.get(name, 1))
        setattr(block, name, col)
        cols.append(col)

    def pre_hook(module, args, kwargs):
        x, by_kw = _block_input(args, kwargs)
        if isinstance(x, DTensor):  # a SequenceParallel norm hands over a Shard(1) DTensor
            x = x.to_local()
        params, has_bias = [], []
        for c in cols:
            ps = c.local_params()
            params.extend(ps)
            has_bias.append(len(ps) == 2)
        outs = _GatherColumns_eager(x, group, conv, tuple(has_bias), tuple(c.float8 for c in cols), *params)
        for c, o in zip(cols, outs):
            c._out = o
        shape = list(x.shape)
        shape[SEQ_DIM] *= t
        stand_in = x.new_zeros(()).expand(shape)  # HF reads only the shape of the block input
        kwargs = _whole_row_mask(module, kwargs, stand_in)
        if by_kw:
            return args, {**kwargs, "hidden_states": stand_in}
        return (stand_in, *args[1:]), kwargs

    block.register_forward_pre_hook(pre_hook, with_kwargs=True)


def _whole_row_mask(block: nn.Module, kwargs: dict, stand_in: torch.Tensor) -> dict:
    """`kwargs` with the attention mask of whole rows. HF builds the mask from the embeddings, which are
    sequence shards here: a mask it built (packed examples: block-diagonal from position_ids) covers
    s/t tokens while the attention sees all s. Rebuilt by HF's own builder from the full rows'
    position ids and the full-shape stand-in (a sliding window's builder for windowed layers, as the
    pipeline stages choose), it is the unsplit model's mask."""
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.shape[-1] == stand_in.shape[SEQ_DIM]:
        return kwargs  # no mask (plain causal: SDPA's is_causal) or already whole rows
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    from partrain.parallel.pipeline.stage import _mask_kind

    sliding = _mask_kind(block.config, block.layer_idx) == "sliding_attention"
    build = create_sliding_window_causal_mask if sliding else create_causal_mask
    whole = build(block.config, stand_in, None, None, position_ids=kwargs.get("position_ids"))
    return {**kwargs, "attention_mask": whole}


class SequenceDropout(nn.Module):
    """Dropout on a sequence shard with the masks of the unsplit run: every rank draws the mask of the
    whole [b, s, ...] tensor (same kernel, same generator state on every tp rank) and keeps its chunk.
    Costs a transient full-size mask; keeps runs with dropout > 0 comparable to one process."""

    def __init__(self, p: float, group) -> None:
        super().__init__()
        self.p, self.group = p, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        t, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        shape = list(x.shape)
        n = shape[SEQ_DIM]
        shape[SEQ_DIM] = n * t
        scaled_mask = torch.nn.functional.dropout(x.new_ones(shape), self.p, training=True)
        return x * scaled_mask.narrow(SEQ_DIM, r * n, n)


def sequence_dropouts(module: nn.Module, paths: Sequence[str], mesh: DeviceMesh) -> None:
    """Replace the nn.Dropout modules at `paths` (those present) by SequenceDropout."""
    for path in paths:
        owner_path, _, attr = path.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        drop = getattr(owner, attr, None)
        if isinstance(drop, nn.Dropout):
            setattr(owner, attr, SequenceDropout(drop.p, mesh.get_group()))


def scatter_positions(embedding: nn.Module, mesh: DeviceMesh) -> None:
    """GPT-2's learned positions under SP: the replicated wpe looks up every position, and each rank
    keeps the chunk of its own sequence shard before the add to the (sequence-sharded) token
    embeddings; the gradient of the chunk is all-gathered, so wpe's gradient is whole on every rank."""
    group = mesh.get_group()

    def hook(module, args, out):
        return _ScatterToSequence_eager(out, group)

    embedding.register_forward_hook(hook)


# Run eagerly inside compiled blocks (partrain.parallel.compile.eager: collectives, Python state).
_GatherColumns_eager = eager(_GatherColumns.apply)
reduce_scatter_to_sequence = eager(ReduceScatterToSequence.apply)
_ScatterToSequence_eager = eager(ScatterToSequence.apply)
