"""The training loss of a causal LM, computed by partrain rather than by HF.

The data pipeline already shifts labels (labels[t] is the token after input_ids[t], -100 where
there is none), so no shift happens here; HF's built-in loss would shift a second time.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

from partrain.models.chunked_loss import IGNORE_INDEX, chunked_model_loss

# IGNORE_INDEX (-100, defined beside the chunked loss): the label value that contributes nothing
# to the loss (padding, document ends).
__all__ = ["IGNORE_INDEX", "forward_loss", "label_weight", "token_loss"]


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the labelled tokens; logits [B, S, V], labels [B, S].

    Computed in fp32 whatever the compute dtype. Vocabulary-sharded (DTensor) logits work inside
    `torch.distributed.tensor.parallel.loss_parallel()`. Pipeline last stages call this directly.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)


def forward_loss(
    model: nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: Optional[torch.Tensor] = None,
    head_path: str = "",
    chunk_tokens: int = 0,
) -> torch.Tensor:
    """Run `model` on `input_ids` and return `token_loss` of its logits against `labels`.

    position_ids default to arange(seq_len) and are always passed explicitly: with sequence
    parallelism HF would otherwise derive positions from the local (sharded) length. Context
    parallel code passes its own offsets. With `chunk_tokens` > 0 the head at `head_path` and the
    loss run over sequence chunks (`chunked_loss`): no [tokens x vocab] fp32 logits are ever whole.
    """
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
    if chunk_tokens > 0 and head_path:
        total, count = chunked_model_loss(
            model, head_path, chunk_tokens, labels, input_ids=input_ids, position_ids=position_ids
        )
        return total / count
    logits = model(input_ids=input_ids, position_ids=position_ids).logits
    return token_loss(logits, labels)


def label_weight(labels: torch.Tensor, label_share: Optional[float], group=None) -> float:
    """What a microbatch's mean loss is multiplied by so that the engines' averaging (over
    microbatches and dp ranks, each weighing 1) yields sum(token losses) / (global labelled tokens):
    its labelled tokens over the global batch's average per microbatch (label_share x rows). 1.0 when
    every label counts (label_share None), and exactly 1.0 when no label is masked, so pretraining
    losses are bit-identical to a plain mean of means.

    `group`: the sp group when `labels` are this rank's sequence slice. The microbatch's mean loss is
    then over the labels of all its slices (context_parallel.SequenceShard.scale_sum), so the count
    is summed over the group too (a collective: every sp rank calls this in the same order)."""
    if label_share is None:
        return 1.0
    count = (labels != IGNORE_INDEX).sum()
    if group is not None:
        count = count.to(torch.float64).reshape(1)
        if torch.distributed.get_backend(group) == "nccl" and count.device.type != "cuda":
            count = count.cuda()  # host-side labels (DirectEngine): NCCL reduces device tensors only
        torch.distributed.all_reduce(count, group=group)
    return int(count.item()) / (label_share * labels.shape[0])
