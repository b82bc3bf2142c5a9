"""Which tokens of a sequence an sp rank holds, and the document masks of packed rows.

Positions: Ulysses keeps contiguous slice r of sp; ring keeps the zig-zag chunks r and 2*sp-1-r of
2*sp chunks (`partrain.parallel.sequence_attention`). Document masks: packed fine-tuning rows hold
several examples; each query gets the global index where its example starts (`doc_starts`, from
position ids that restart at 0 per example) and sees only the keys from there up to itself, the
block-diagonal causal mask of the unsplit row (`block_masks` for ring attention's blocks,
`document_mask` of whole rows for Ulysses, after `gather_sequence`). A query row that sees nothing
in one of ring attention's blocks gets a finite score (MASKED), so the block's weight in the merge is
exp(MASKED - lse) = 0 instead of the NaN of an all -inf row; every query sees itself, so its final
log-sum-exp is finite.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from partrain.parallel.compile import eager

Tensor = torch.Tensor


def _check_split(seq_len: int, parts: int, what: str) -> None:
    if seq_len <= 0 or parts <= 0 or seq_len % parts:
        raise ValueError(f"{what}: sequence length {seq_len} must be a positive multiple of {parts}")


def zigzag_positions(seq_len: int, sp: int, sp_rank: int) -> Tensor:
    """LongTensor [seq_len // sp]: the global token positions this rank holds, chunk r then chunk 2*sp-1-r."""
    _check_split(seq_len, 2 * sp, f"zig-zag split over sp={sp} (2*sp chunks)")
    if not 0 <= sp_rank < sp:
        raise ValueError(f"sp_rank {sp_rank} is outside 0..{sp - 1}")
    c = seq_len // (2 * sp)
    first, second = sp_rank, 2 * sp - 1 - sp_rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def contiguous_positions(seq_len: int, sp: int, sp_rank: int) -> Tensor:
    """LongTensor [seq_len // sp]: the global token positions of contiguous slice `sp_rank`."""
    _check_split(seq_len, sp, f"contiguous split over sp={sp}")
    if not 0 <= sp_rank < sp:
        raise ValueError(f"sp_rank {sp_rank} is outside 0..{sp - 1}")
    n = seq_len // sp
    return torch.arange(sp_rank * n, (sp_rank + 1) * n)


MASKED = -1e30
"""Score of a key a document mask hides: finite, so a row hidden from a whole block gives no NaN."""


def _global_index(rank: int, sp: int, local_seq: int, zigzag: bool, device) -> Tensor:
    """Global positions of a rank's local tokens."""
    split = zigzag_positions if zigzag else contiguous_positions
    return split(local_seq * sp, sp, rank).to(device)


def block_masks(doc_starts: Optional[Tensor], q_rank: int, kv_rank: int, sp: int, n: int, zigzag: bool):
    """block (qs, ks) -> document mask [b, nq, nk] (None without documents): keys from the query's
    document start up to the query itself."""
    if doc_starts is None:
        return lambda qs, ks: None
    qg = _global_index(q_rank, sp, n, zigzag, doc_starts.device)
    kg = _global_index(kv_rank, sp, n, zigzag, doc_starts.device)

    def mask(qs: slice, ks: slice) -> Tensor:
        k = kg[ks][None, None, :]
        return (k <= qg[qs][None, :, None]) & (k >= doc_starts[:, qs, None])

    return mask


def document_mask(doc_starts: Tensor) -> Tensor:
    """Boolean SDPA mask [batch, 1, seq, seq] of whole rows: query i sees keys doc_starts[i]..i."""
    seq = doc_starts.shape[1]
    index = torch.arange(seq, device=doc_starts.device)
    return ((index[None, None, :] <= index[None, :, None]) & (index[None, None, :] >= doc_starts[:, :, None]))[:, None]


def _gather_sequence(t: Tensor, group) -> Tensor:
    sp = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if sp == 1:
        return t
    parts = torch.empty((sp * t.shape[0], t.shape[1]), dtype=t.dtype, device=t.device)  # ranks along dim 0
    dist.all_gather_into_tensor(parts, t.contiguous(), group=group)
    return parts.view(sp, *t.shape).permute(1, 0, 2).reshape(t.shape[0], sp * t.shape[1])


def gather_sequence(t: Tensor, group) -> Tensor:
    """[batch, local_seq] contiguous slices (no gradient) -> [batch, seq] whole rows, in sp-rank order."""
    return _gather_sequence_eager(t, group)


_gather_sequence_eager = eager(_gather_sequence)  # a collective: run eagerly inside compiled blocks
