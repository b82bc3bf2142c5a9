"""The output head and its cross-entropy computed over sequence chunks, so the [tokens x vocab] fp32
logits are never whole in memory (issue 16, part 3).

The model runs with its head swapped for a passthrough (`head_detached`), so its forward returns the
final-norm output; `head_loss_sum` then applies the real head module chunk by chunk. Each chunk runs
under non-reentrant activation checkpointing: its forward frees the chunk's logits at once and its
backward recomputes them one chunk at a time, so neither pass holds more than one chunk of logits
(the price: the head's matmul runs once more per chunk, about 1/3 of the head's FLOPs).

The head module itself is called (not its weight), so tensor parallelism keeps working: its
ColwiseParallel hooks shard the vocabulary and `loss_parallel()` reduces the sharded cross-entropy.
FSDP keeps the root's parameters gathered after forward (its root does not reshard after forward),
and the head belongs to the root unit, so the head's weight is the gathered one here.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from partrain.models.logits import cap_lifted, softcapped

IGNORE_INDEX = -100
"""Label value that contributes nothing to the loss (padding, document ends)."""


class _Passthrough(nn.Module):
    """Stands in for the head during the model's forward: HF's `logits` become the final hidden states."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


@contextlib.contextmanager
def head_detached(model: nn.Module, head_path: str) -> Iterator[nn.Module]:
    """Within the block, `model`'s head is a passthrough; yields the real head module."""
    parent_path, _, name = head_path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    head = parent._modules[name]
    parent._modules[name] = _Passthrough()
    try:
        yield head
    finally:
        parent._modules[name] = head


def _chunk_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    logits = softcapped(head(hidden), cap)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _replicated(hidden: torch.Tensor) -> torch.Tensor:
    """Sequence-sharded DTensor hidden states (Megatron-SP) gathered once, as the head would gather them."""
    placements = getattr(hidden, "placements", None)
    if placements is None or all(p.is_replicate() for p in placements):
        return hidden
    from torch.distributed.tensor import Replicate

    return hidden.redistribute(placements=[Replicate()] * len(placements))


def head_loss_sum(
    head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, cap: Optional[float] = None
) -> torch.Tensor:
    """Summed fp32 cross-entropy of `head(hidden)` [B, S, V] (capped at `cap`: models/logits.py) against
    labels [B, S] (-100 ignored).

    The sequence is cut into chunks of about `chunk_tokens` tokens (chunk_tokens // B positions);
    with one chunk the head runs plainly (nothing to bound, no recompute).
    """
    hidden = _replicated(hidden)
    positions = max(1, chunk_tokens // max(1, hidden.shape[0]))
    seq = hidden.shape[1]
    if seq <= positions:
        return _chunk_sum(head, hidden, labels, cap)
    total = None
    for start in range(0, seq, positions):
        end = min(seq, start + positions)
        part = checkpoint(_chunk_sum, head, hidden[:, start:end], labels[:, start:end], cap, use_reentrant=False)
        total = part if total is None else total + part
    return total


def labelled_count(labels: torch.Tensor) -> torch.Tensor:
    """Tokens that carry a label, as fp32 (at least 1, so an all-padding batch gives loss 0, not NaN)."""
    return (labels != IGNORE_INDEX).sum().clamp(min=1).to(torch.float32)


def chunked_model_loss(
    model: nn.Module, head_path: str, chunk_tokens: int, labels: torch.Tensor, **inputs
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(summed loss, labelled tokens) of `model(**inputs)` with the head applied in chunks.
    `model` may be a DDP wrapper: the head is found on the module it wraps."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    with head_detached(inner, head_path) as head, cap_lifted(inner.config) as cap:
        hidden = model(**inputs).logits
    return head_loss_sum(head, hidden, labels, chunk_tokens, cap), labelled_count(labels)
