"""Attention over a sequence split across the ranks of an sp group: ring and Ulysses.

Both ops take and return local tensors `[batch, heads, local_seq, head_dim]` (local_seq = seq/sp)
and are differentiable; the caller owns the projections, rotary embedding and GQA head repeat.

Ring (`ring_attention`): every rank keeps its queries; the K/V blocks travel around the group with
`batch_isend_irecv` (the next block is in flight while the current one is computed). Each block
gives a partial output and the log-sum-exp of its scores; partials are merged in fp32. The backward
is written out (flash-attention style, from the saved output and log-sum-exp): K/V travel the ring
again and each block's dK/dV accumulator travels with it until it reaches its owner, so no autograd
graph spans the sends. With a causal mask a contiguous split gives rank r work for r+1 blocks, so
the zig-zag split cuts the sequence into 2*sp chunks and rank r holds chunks r and 2*sp-1-r: every
rank then computes the same number of query x key pairs at every ring step.

Ulysses (`ulysses_attention`): an all-to-all turns sequence shards into head shards (each rank sees
the whole sequence for heads/sp heads), any attention runs on that, an all-to-all turns the output
back. The backward of each all-to-all is the inverse all-to-all.

Packed documents (`doc_starts`, masks in `sequence_split`): ring attention computes every block with
an explicit document mask (the portable "math" kernel: the fused kernel takes no mask).

Per-block math: torch's fused CPU flash-attention kernel (it returns the log-sum-exp) on CPU, and
plain matmul/softmax in fp32 (fp64 stays fp64) elsewhere, so the same code runs on CUDA/NCCL; the
merge of partial results and the dK/dV accumulators are fp32 whatever the input dtype. Nothing here
is device specific: buffers follow the inputs' device.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from partrain.parallel.compile import eager
from partrain.parallel.sequence_split import (  # noqa: F401 - zigzag/contiguous_positions: part of this API
    MASKED,
    block_masks,
    contiguous_positions,
    zigzag_positions,
)

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------------------
# Ring attention
# ---------------------------------------------------------------------------------------------


def _group_size_rank(group) -> Tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise ValueError("an sp process group was given but torch.distributed is not initialized")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _chunks(rank: int, sp: int, local_seq: int, zigzag: bool) -> List[Tuple[int, int, int]]:
    """(chunk id, local start, local stop) of the chunks a rank holds; ids order the chunks globally."""
    if zigzag:
        h = local_seq // 2
        return [(rank, 0, h), (2 * sp - 1 - rank, h, local_seq)]
    return [(rank, 0, local_seq)]


Block = Tuple[slice, slice, bool]  # (query rows, key rows, needs the within-chunk causal mask)


def _block_plan(q_rank: int, kv_rank: int, sp: int, local_seq: int, zigzag: bool, causal: bool) -> List[Block]:
    """The (query range, key range) blocks to compute when this rank's queries meet kv_rank's K/V.

    Chunks have equal lengths, so with a causal mask a key chunk is fully visible to a query chunk
    with a larger id, invisible to one with a smaller id, and lower-triangular for the same id.
    Adjacent visible key chunks are merged and query chunks with the same key ranges are merged,
    so the zig-zag plan is one block per ring step except on the diagonal step.
    """
    per_q = []
    for qid, q0, q1 in _chunks(q_rank, sp, local_seq, zigzag):
        ranges: List[Tuple[int, int, bool]] = []
        for kid, k0, k1 in _chunks(kv_rank, sp, local_seq, zigzag):
            if causal and kid > qid:
                continue
            diag = causal and kid == qid
            if ranges and ranges[-1][1] == k0 and not diag and not ranges[-1][2]:
                ranges[-1] = (ranges[-1][0], k1, False)
            else:
                ranges.append((k0, k1, diag))
        per_q.append((q0, q1, ranges))
    merged: List[Tuple[int, int, List]] = []
    for q0, q1, ranges in per_q:
        if merged and merged[-1][1] == q0 and merged[-1][2] == ranges and not any(d for _, _, d in ranges):
            merged[-1] = (merged[-1][0], q1, ranges)
        else:
            merged.append((q0, q1, ranges))
    return [(slice(q0, q1), slice(k0, k1), d) for q0, q1, ranges in merged for k0, k1, d in ranges]


def _compute_dtype(t: Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _causal_tril(n: int, device) -> Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _scores(q: Tensor, k: Tensor, scale: float, diag) -> Tensor:
    """Scaled scores [b, kv, g, nq, nk]; diag: True (within-chunk causal), False, or a document mask
    [b, nq, nk] (True = visible)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if isinstance(diag, Tensor):
        return s.masked_fill(~diag[:, None, None], MASKED)
    if diag:
        s = s.masked_fill(~_causal_tril(s.shape[-1], s.device), float("-inf"))
    return s


# A block kernel computes one (query range, key range) block: forward gives the block's output and
# the log-sum-exp of its scaled scores; backward gives the block's dq, dk, dv from the GLOBAL output
# and log-sum-exp (softmax probabilities of the whole row), which makes the block terms add up to
# the full gradient. "math" is portable matmul/softmax in fp32 (fp64 stays fp64); "flash_cpu" is
# torch's fused CPU flash-attention kernel, which returns the log-sum-exp (about 4x faster here).


def _grouped(q: Tensor, kv_heads: int) -> Tensor:
    """[b, h, n, d] -> [b, kv_heads, h / kv_heads, n, d]: query heads grouped by the K/V head they
    share (HF's GQA order: query head i uses K/V head i // (h / kv_heads))."""
    b, h, n, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, n, d)


def _math_fwd(q, k, v, scale, diag):
    cdt = _compute_dtype(q)
    b, h, n, _ = q.shape
    kvh = k.shape[1]
    s = _scores(_grouped(q.to(cdt), kvh), k.to(cdt).unsqueeze(2), scale, diag)  # K/V broadcast over the group
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse[..., None]), v.to(cdt).unsqueeze(2))
    return out.reshape(b, h, n, v.shape[-1]), lse.reshape(b, h, n)


def _math_bwd(do, q, k, v, out, lse, scale, diag):
    cdt = lse.dtype
    b, h, n, _ = q.shape
    kvh = k.shape[1]
    q5, do5, out5 = (_grouped(t.to(cdt), kvh) for t in (q, do, out))
    k5, v5 = k.to(cdt).unsqueeze(2), v.to(cdt).unsqueeze(2)
    p = torch.exp(_scores(q5, k5, scale, diag) - lse.reshape(b, kvh, h // kvh, n)[..., None])
    delta = (do5 * out5).sum(-1, keepdim=True)  # rowsum(dO * O): the softmax backward's correction
    ds = p * (torch.matmul(do5, v5.transpose(-1, -2)) - delta)
    dq = (torch.matmul(ds, k5) * scale).reshape(q.shape)
    dk = (torch.matmul(ds.transpose(-1, -2), q5) * scale).sum(2)  # summed over the query heads sharing it
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(2)
    return dq, dk, dv


def _flash_cpu_fwd(q, k, v, scale, diag):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, diag, scale=scale)


def _flash_cpu_bwd(do, q, k, v, out, lse, scale, diag):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.to(q.dtype).contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, diag, scale=scale
    )


_KERNELS = {"math": (_math_fwd, _math_bwd), "flash_cpu": (_flash_cpu_fwd, _flash_cpu_bwd)}


def _pick_kernel(name: str, q: Tensor, v: Tensor) -> str:
    if name == "auto":
        fused = q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        # The fused kernel wants one head width; latent attention's values are narrower than its keys.
        return "flash_cpu" if fused and v.shape[-1] == q.shape[-1] else "math"
    if name not in _KERNELS:
        raise ValueError(f"block_kernel={name!r}: choose auto, math or flash_cpu")
    if name == "flash_cpu" and q.device.type != "cpu":
        raise ValueError(f"block_kernel=flash_cpu runs on CPU tensors only; these are on {q.device}")
    return name


class _Ring:
    """Point-to-point exchange with the ring neighbours: send to rank+1, receive from rank-1."""

    def __init__(self, group, sp: int, rank: int):
        self.group = group
        self.nxt = dist.get_global_rank(group, (rank + 1) % sp) if group is not None else (rank + 1) % sp
        self.prv = dist.get_global_rank(group, (rank - 1) % sp) if group is not None else (rank - 1) % sp

    def start(self, send: Tensor, tag: int) -> Tuple[Tensor, list]:
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.nxt, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prv, self.group, tag),
        ]
        with record_function("partrain/sp/ring_post"):  # overlaps the attention block; waited for in finish()
            return recv, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(reqs: list) -> None:
        with record_function("partrain/sp/ring_wait"):
            for r in reqs:
                r.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, sp, rank, causal, zigzag, scale, kernel, doc_starts=None):
        block_fwd = _KERNELS[kernel][0]
        cdt = _compute_dtype(q)
        b, h, n, _ = q.shape
        # [b, n, h, d] in memory: the caller's transpose(1, 2).contiguous() (HF attention does it
        # before o_proj) is then free and o_proj saves the very storage saved here.
        out = torch.zeros(b, n, h, v.shape[-1], dtype=cdt, device=q.device).transpose(1, 2)
        lse = torch.full((b, h, n), float("-inf"), dtype=cdt, device=q.device)
        ring = _Ring(group, sp, rank) if sp > 1 else None
        kv = torch.stack([k, v]) if k.shape == v.shape else None  # one message per step when shapes allow
        cur_k, cur_v = k, v
        for step in range(sp):
            src = (rank - step) % sp
            if step < sp - 1:  # the next block travels while this one is computed
                if kv is not None:
                    nxt_kv, reqs = ring.start(kv, 0)
                else:
                    nxt_k, reqs_k = ring.start(cur_k.contiguous(), 0)
                    nxt_v, reqs_v = ring.start(cur_v.contiguous(), 1)
                    reqs = reqs_k + reqs_v
            kc, vc = (kv[0], kv[1]) if kv is not None else (cur_k, cur_v)
            doc_mask = block_masks(doc_starts, rank, src, sp, n, zigzag)
            for qs, ks, diag in _block_plan(rank, src, sp, n, zigzag, causal):
                mask = doc_mask(qs, ks)
                blk_out, blk_lse = block_fwd(
                    q[:, :, qs], kc[:, :, ks], vc[:, :, ks], scale, diag if mask is None else mask
                )
                blk_out, blk_lse = blk_out.to(cdt), blk_lse.to(cdt)
                old = lse[:, :, qs]
                new = torch.logaddexp(old, blk_lse)
                out[:, :, qs] = (
                    out[:, :, qs] * torch.exp(old - new)[..., None] + blk_out * torch.exp(blk_lse - new)[..., None]
                )
                lse[:, :, qs] = new
            if step < sp - 1:
                _Ring.finish(reqs)
                if kv is not None:
                    kv = nxt_kv
                else:
                    cur_k, cur_v = nxt_k, nxt_v
        result = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, result, lse)  # output kept in the inputs' dtype, as flash attention does
        ctx.cfg = (group, sp, rank, causal, zigzag, scale, kernel)
        ctx.doc_starts = doc_starts  # integers, no gradient: kept beside the saved tensors
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout, q, k, v, out, lse)

    @staticmethod
    def _backward(ctx, dout, q, k, v, out, lse):
        group, sp, rank, causal, zigzag, scale, kernel = ctx.cfg
        block_bwd = _KERNELS[kernel][1]
        cdt = lse.dtype
        n = q.shape[2]
        dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
        ring = _Ring(group, sp, rank) if sp > 1 else None
        kv = torch.stack([k, v]) if k.shape == v.shape else None
        cur_k, cur_v = k, v
        dkv_in, dreqs = None, []  # the dK/dV accumulator in flight: sent at the end of a step, used by the next
        for step in range(sp):
            src = (rank - step) % sp
            if step < sp - 1:
                if kv is not None:
                    nxt_kv, reqs = ring.start(kv, 0)
                else:
                    nxt_k, reqs_k = ring.start(cur_k.contiguous(), 0)
                    nxt_v, reqs_v = ring.start(cur_v.contiguous(), 1)
                    reqs = reqs_k + reqs_v
            kc, vc = (kv[0], kv[1]) if kv is not None else (cur_k, cur_v)
            dk_blk = torch.zeros(kc.shape, dtype=cdt, device=q.device)
            dv_blk = torch.zeros(vc.shape, dtype=cdt, device=q.device)
            doc_mask = block_masks(ctx.doc_starts, rank, src, sp, n, zigzag)
            for qs, ks, diag in _block_plan(rank, src, sp, n, zigzag, causal):
                mask = doc_mask(qs, ks)
                gq, gk, gv = block_bwd(
                    dout[:, :, qs],
                    q[:, :, qs],
                    kc[:, :, ks],
                    vc[:, :, ks],
                    out[:, :, qs],
                    lse[:, :, qs],
                    scale,
                    diag if mask is None else mask,
                )
                dq[:, :, qs] += gq
                dk_blk[:, :, ks] += gk
                dv_blk[:, :, ks] += gv
            if step > 0:  # the fp32 dK/dV accumulator of this block arrives from the previous rank
                _Ring.finish(dreqs)
                dk_blk += dkv_in[0]
                dv_blk += dkv_in[1]
            dkv = (dk_blk, dv_blk)
            if sp > 1:  # pass it on with the block; after the last step it lands on the block's owner
                if dk_blk.shape == dv_blk.shape:
                    dkv_in, dreqs = ring.start(torch.stack(dkv), 2)
                else:
                    rk, rq_k = ring.start(dk_blk, 2)
                    rv, rq_v = ring.start(dv_blk, 3)
                    dkv_in, dreqs = (rk, rv), rq_k + rq_v
            if step < sp - 1:
                _Ring.finish(reqs)
                if kv is not None:
                    kv = nxt_kv
                else:
                    cur_k, cur_v = nxt_k, nxt_v
        if sp > 1:
            _Ring.finish(dreqs)
            dk, dv = dkv_in[0], dkv_in[1]
        else:
            dk, dv = dkv
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None, None


def _autocast_inputs(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Under torch.autocast, q, k, v in the autocast dtype, as SDPA would take them (Llama's rotary
    gives fp32 q and k beside a 16-bit v); outside it, they must share a dtype, as SDPA requires."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return q.to(dtype), k.to(dtype), v.to(dtype)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    return q, k, v


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [batch, heads, local_seq, head_dim]; got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}"
        )
    if (
        (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3])
        or v.shape[:3] != k.shape[:3]
        or k.shape[1] == 0
        or q.shape[1] % k.shape[1]
    ):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must agree in batch and local "
            "length, k in head_dim, and the K/V heads must divide the query heads (GQA)"
        )


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group,
    *,
    causal: bool,
    zigzag: bool,
    scale: Optional[float] = None,
    block_kernel: str = "auto",
    doc_starts: Optional[Tensor] = None,
) -> Tensor:
    """Attention of the local queries over the whole sequence, K/V passed around the sp group.

    q: [batch, heads, local_seq, head_dim]; k, v: [batch, kv_heads, local_seq, head_dim] with
    kv_heads dividing heads (GQA, HF's head order; equal counts when the caller repeated them).
    Unrepeated K/V are better: the ring then moves and saves kv_heads, not heads. With zigzag=True
    the local tokens are `zigzag_positions` order, else contiguous slice sp_rank. Returns [batch,
    heads, local_seq, head_dim] in q's dtype. Group of size 1 (or None without torch.distributed):
    plain attention. doc_starts [batch, local_seq] (packed documents, needs causal): the global index
    where each local query's document starts; keys before it are hidden too (math kernel).
    """
    _check_qkv(q, k, v)
    n = q.shape[2]
    if zigzag and n % 2:
        raise ValueError(
            f"zig-zag ring attention needs an even local sequence length (two chunks per rank); "
            f"got local_seq={n}: make the sequence length a multiple of 2*sp"
        )
    sp, rank = _group_size_rank(group)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if doc_starts is not None and not causal:
        raise ValueError("document masks (doc_starts) are for causal attention")
    kernel = _pick_kernel("math" if doc_starts is not None else block_kernel, q, v)
    q, k, v = _autocast_inputs(q, k, v)
    with torch.autocast(q.device.type, enabled=False):  # the block math picks its own precision
        return _RingAttention_eager(
            q, k, v, group, sp, rank, bool(causal), bool(zigzag), float(scale), kernel, doc_starts
        )


# ---------------------------------------------------------------------------------------------
# Ulysses
# ---------------------------------------------------------------------------------------------


def _seq_to_head(x: Tensor, group, sp: int) -> Tensor:
    """[b, h, n, d] sequence shard -> [b, h/sp, sp*n, d] head shard (all-to-all)."""
    b, h, n, d = x.shape
    send = x.reshape(b, sp, h // sp, n, d).permute(1, 0, 2, 3, 4).contiguous()  # dim 0: destination rank
    recv = torch.empty_like(send)  # dim 0: source rank = which sequence slice
    with record_function("partrain/sp/all_to_all"):
        dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * n, d)


def _head_to_seq(x: Tensor, group, sp: int) -> Tensor:
    """[b, h/sp, sp*n, d] head shard -> [b, h, n, d] sequence shard (the inverse all-to-all)."""
    b, hl, s, d = x.shape
    n = s // sp
    send = x.reshape(b, hl, sp, n, d).permute(2, 0, 1, 3, 4).contiguous()  # dim 0: destination = slice
    recv = torch.empty_like(send)  # dim 0: source rank = which head group
    with record_function("partrain/sp/all_to_all"):
        dist.all_to_all_single(recv, send, group=group)
    # Laid out [b, n, h, d] in memory, so the caller's transpose(1, 2).contiguous() before the output
    # projection is free.
    return recv.permute(1, 3, 0, 2, 4).reshape(b, n, hl * sp, d).transpose(1, 2)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sp):
        ctx.group, ctx.sp = group, sp
        return _seq_to_head(x, group, sp)

    @staticmethod
    def backward(ctx, g):
        return _head_to_seq(g, ctx.group, ctx.sp), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, sp):
        ctx.group, ctx.sp = group, sp
        return _head_to_seq(x, group, sp)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_head(g, ctx.group, ctx.sp), None, None


def _kv_repeat_for(heads: int, kv_heads: int, sp: int) -> int:
    """Smallest repeat r of the K/V heads (r divides heads / kv_heads) with kv_heads * r divisible by sp."""
    group = heads // kv_heads
    return next(r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % sp == 0)


def _repeat_heads(t: Tensor, r: int) -> Tensor:
    """[b, kv, n, d] -> [b, kv * r, n, d], each head repeated r times in place (HF's repeat_kv order)."""
    if r == 1:
        return t
    b, kv, n, d = t.shape
    return t[:, :, None].expand(b, kv, r, n, d).reshape(b, kv * r, n, d)


def ulysses_attention(
    q: Tensor, k: Tensor, v: Tensor, group, attention_fn: Callable[[Tensor, Tensor, Tensor], Tensor]
) -> Tensor:
    """Sequence-sharded q, k, v -> head-sharded full sequences -> attention_fn -> back.

    q: [batch, heads, local_seq, head_dim], k, v: [batch, kv_heads, local_seq, head_dim] (kv_heads
    divides heads; equal when the caller repeated them), contiguous sequence slices in sp-rank order.
    attention_fn gets q [batch, heads/sp, seq, head_dim] and k, v [batch, kv_heads'/sp, seq, head_dim]
    (causal masking is its business) and returns [batch, heads/sp, seq, head_dim]. kv_heads' =
    kv_heads when sp divides it (the all-to-all moves only the K/V heads there are), else the K/V
    heads are first repeated just enough for sp to divide them; with kv_heads' < heads,
    attention_fn must do grouped-query attention (SDPA: enable_gqa=True).
    Returns [batch, heads, local_seq, head_dim].
    """
    _check_qkv(q, k, v)
    sp, _ = _group_size_rank(group)
    if sp == 1:
        return attention_fn(q, k, v)
    heads = q.shape[1]
    if heads % sp:
        raise ValueError(
            f"Ulysses attention needs the head count divisible by sp: {heads} heads, sp={sp} "
            f"(use sp_mode=ring or an sp that divides {heads})"
        )
    q, k, v = _autocast_inputs(q, k, v)  # also halves the all-to-all bytes of fp32 rotary outputs
    r = _kv_repeat_for(heads, k.shape[1], sp)
    k, v = _repeat_heads(k, r), _repeat_heads(v, r)
    qh, kh, vh = (_SeqToHead_eager(t, group, sp) for t in (q, k, v))
    out = attention_fn(qh, kh, vh)
    return _HeadToSeq_eager(out, group, sp)


# Run eagerly inside compiled blocks (partrain.parallel.compile.eager: collectives, Python state).
_RingAttention_eager = eager(_RingAttention.apply)
_SeqToHead_eager = eager(_SeqToHead.apply)
_HeadToSeq_eager = eager(_HeadToSeq.apply)
