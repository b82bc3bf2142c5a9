"""Sequence (context) parallelism: each rank of an sp group trains on a slice of every sequence.

What `parallel.sp > 1` changes, and where:

- data (`SequenceSharded`): every sp rank of a data-parallel replica reads the same rows and keeps
  its slice of each row, inputs and the already shifted labels alike, so the target of a slice's
  last token is the true next token. Ulysses keeps contiguous slice r; ring keeps the zig-zag
  chunks r and 2*sp-1-r of 2*sp chunks (every rank then does equal causal work).
- positions (`SequenceShard.position_ids`): the global positions of the kept tokens, passed to
  the model explicitly, so rotary embeddings (Llama, Qwen2, Mistral) and GPT-2's learned `wpe`
  see the positions the unsplit model would.
- attention (`apply_sp`): HF v5 models call the attention function named by
  `config._attn_implementation` with q/k/v [B, H, S_local, D] after rotary. `apply_sp` selects a
  partrain function (one registry name per mode, registered once in transformers' own registry)
  and tells each attention module its sp group; the function runs `ring_attention` or
  `ulysses_attention` over that group (grouped-query K/V unrepeated). A mask function of the same name
  returns no mask: the causal structure is the ops' business (HF would otherwise read zig-zag
  position_ids as packed documents). sp == 1 leaves the model on SDPA.
- packed examples (`SequenceShard.documents`, data.packing of fine-tuning rows): the batch's position
  ids restart at 0 for each example and are sharded with the tokens; the attention function gets this
  rank's slice of them (HF passes position_ids through to it) and turns them into each query's
  document start (global index - position), so ring and Ulysses attention mask keys outside the
  query's example: block-diagonal causal attention, the same as the unsplit model's.
- loss (`SequenceShard.loss`): each rank returns sp x (its summed token losses) / (the labelled
  tokens of the whole microbatch, summed over the sp group). The sp values add up to sp x the
  unsplit mean, and the gradient average over dp x sp (DDP, FSDP, the pipeline's all-reduce, all
  over the `dp_sp` mesh) divides by sp again: gradients equal the unsplit model's. The trainer
  averages the reported loss over dp x sp for the same reason. Fine-tuning examples (masked labels)
  then weigh each microbatch by its labelled tokens counted over the sp group too (`label_weight`
  with the sp group), so the loss is over the global batch's labelled tokens whatever sp is; the
  batches' `label_share` reaches the trainer through `SequenceSharded`.

No parameter is sharded over sp (weights are replicated on sp ranks like on dp ranks), so
checkpoints do not depend on the sp degree.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partrain.models.chunked_loss import chunked_model_loss
from partrain.models.loss import IGNORE_INDEX
from partrain.parallel import sequence_attention as ops
from partrain.parallel import sequence_split as split

ATTENTION_NAMES = {"ulysses": "partrain_ulysses", "ring": "partrain_ring"}
"""The `config._attn_implementation` name of each sp mode (entries in transformers' registries)."""

log = logging.getLogger("partrain")

SP_ATTR = "partrain_sp"
"""Attribute set on each attention module: the `SequenceShard` its attention runs over."""


@dataclass(frozen=True)
class SequenceShard:
    """This rank's share of the sequence dimension."""

    mode: str
    """ulysses (contiguous slices) or ring (zig-zag chunks)."""
    size: int
    """sp degree."""
    rank: int
    """This rank's coordinate on the sp axis."""
    group: Optional[dist.ProcessGroup]
    """The sp process group."""
    documents: bool = False
    """The rows are packed examples: attention stays inside each (position ids restart at 0 per example)."""

    def positions(self, seq_len: int) -> torch.Tensor:
        """Global positions of this rank's tokens, LongTensor [seq_len // sp]."""
        if self.mode == "ring":
            return ops.zigzag_positions(seq_len, self.size, self.rank)
        return ops.contiguous_positions(seq_len, self.size, self.rank)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of each row of `t` [B, S] (or [B, S, ...])."""
        return t.index_select(1, self.positions(t.shape[1]).to(t.device)).contiguous()

    def position_ids(self, seq_len: int, device=None) -> torch.Tensor:
        """[1, seq_len // sp] position ids for the model; seq_len is the full length."""
        return self.positions(seq_len).to(device).unsqueeze(0)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """sp x this rank's summed token loss / the microbatch's labelled tokens over the sp group.

        Summed over the sp ranks this is sp x the unsplit mean (see the module docstring for why).
        Works on vocabulary-sharded logits inside `loss_parallel()` like `token_loss`.
        """
        total = F.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        return self.scale_sum(total, labels)

    def scale_sum(self, total: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """This rank's summed token loss `total` as its share of the sp-scaled mean (see `loss`)."""
        count = (labels != IGNORE_INDEX).sum().to(torch.float64).reshape(1)
        if self.size > 1:
            dist.all_reduce(count, group=self.group)
        return total * (self.size / max(float(count.item()), 1.0))

    def forward_loss(
        self,
        model: nn.Module,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        head_path: str = "",
        chunk_tokens: int = 0,
    ) -> torch.Tensor:
        """`models.loss.forward_loss` for sequence-sharded rows (already `take`n): the batch's position
        ids (packed examples, `take`n with the tokens) or the global ones, sp loss."""
        seq_len = input_ids.shape[1] * self.size
        if position_ids is None:
            position_ids = self.position_ids(seq_len, input_ids.device)
        if chunk_tokens > 0 and head_path:
            total, _ = chunked_model_loss(
                model, head_path, chunk_tokens, labels, input_ids=input_ids, position_ids=position_ids
            )
            return self.scale_sum(total, labels)
        logits = model(input_ids=input_ids, position_ids=position_ids).logits
        return self.loss(logits, labels)


def sequence_shard(mesh, mode: str, documents: bool = False) -> Optional[SequenceShard]:
    """This rank's `SequenceShard` (documents: the rows are packed examples), or None when the sp axis has size 1."""
    if mesh.size("sp") == 1:
        return None
    if mode not in ATTENTION_NAMES:
        raise ValueError(f"parallel.sp_mode must be one of {sorted(ATTENTION_NAMES)}, not {mode!r}")
    group = mesh["sp"].get_group()
    return SequenceShard(mode=mode, size=mesh.size("sp"), rank=mesh.local("sp"), group=group, documents=documents)


# ---- data -------------------------------------------------------------------------------------


class SequenceSharded:
    """Train or eval batches with each row cut to this rank's tokens (inputs and labels alike).

    Wraps `TokenBatches` / `EvalBatches`: the same rows as the other ranks of the data-parallel
    replica, this rank's positions of them. Data position (state_dict) is the wrapped object's.
    """

    def __init__(self, batches, shard: SequenceShard) -> None:
        self.inner = batches
        self.shard = shard

    def _cut(self, batch):
        """Inputs, labels and (packed examples) position ids: this rank's tokens of each."""
        return tuple(self.shard.take(t) for t in batch)

    def rank_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1):
        return self._cut(self.inner.rank_batch(step, dp_rank, dp_size))

    def eval_batch(self, i: int, dp_rank: int = 0, dp_size: int = 1):
        return self._cut(self.inner.eval_batch(i, dp_rank, dp_size))

    def __getattr__(self, name: str):
        # The rest is the wrapped batches' own: label_share above all (fine-tuning examples normalise
        # by the global batch's labelled tokens whatever the sp degree), steps_per_epoch, padding_share.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state) -> None:
        self.inner.load_state_dict(state)


def shard_batches(batches, evals, shard: Optional[SequenceShard]):
    """(batches, evals) cut to this rank's tokens; unchanged without sequence parallelism."""
    if shard is None:
        return batches, evals
    return SequenceSharded(batches, shard), (SequenceSharded(evals, shard) if evals is not None else None)


# ---- attention --------------------------------------------------------------------------------


def _sp_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
):
    """The attention function HF calls (see `transformers.AttentionInterface`); returns [B, S, H, D]."""
    shard: Optional[SequenceShard] = getattr(module, SP_ATTR, None)
    if shard is None:
        raise RuntimeError(
            f"{type(module).__name__} runs partrain's sequence-parallel attention but apply_sp "
            "did not give it an sp group"
        )
    if attention_mask is not None:
        raise NotImplementedError("sequence-parallel attention supports causal attention without padding masks")
    if dropout and shard.mode == "ring":  # apply_sp refuses such models; never drop it silently
        raise NotImplementedError("ring attention does not implement attention dropout")
    causal = bool(getattr(module, "is_causal", True))
    starts = _document_starts(shard, kwargs.get("position_ids"), query) if shard.documents else None
    # Grouped-query K/V go to the ops unrepeated: the ring moves and keeps only the K/V heads there
    # are, Ulysses repeats them just enough for sp to divide them.
    if shard.mode == "ring":
        out = ops.ring_attention(
            query, key, value, shard.group, causal=causal, zigzag=True, scale=scaling, doc_starts=starts
        )
    else:
        # Each rank sees whole rows after the all-to-all: the document mask of the whole row.
        mask = split.document_mask(split.gather_sequence(starts, shard.group)) if starts is not None else None

        cap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux")

        def full_sequence(q, k, v):
            if cap:  # scores capped by tanh (Gemma 2): SDPA cannot, so the math of HF's eager attention
                return capped_attention(q, k, v, mask, dropout, causal, scaling, cap)
            if sinks is not None:  # a sink logit per head (gpt-oss): this rank's heads are a contiguous slice
                local = q.shape[1]
                start = shard.rank * local
                return sink_attention(q, k, v, mask, dropout, causal, scaling, sinks[start : start + local])
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout,
                is_causal=causal and mask is None,
                scale=scaling,
                enable_gqa=k.shape[1] != q.shape[1],
            )

        out = ops.ulysses_attention(query, key, value, shard.group, full_sequence)
    return out.transpose(1, 2).contiguous(), None


def _eager_scores(q, k, v, mask, causal: bool, scaling):
    """transformers' eager attention up to the softmax: (scaled scores [B, H, S, S], the visible keys or
    None, v with its heads repeated as q's); k and v [B, KV, S, D] with KV dividing H."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(2, 3)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    visible = mask
    if visible is None and causal:
        n = q.shape[2]
        visible = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return scores, visible, v


def capped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    dropout: float,
    causal: bool,
    scaling: Optional[float],
    cap: float,
) -> torch.Tensor:
    """Attention with its scores capped at cap * tanh(scores / cap), in the order of transformers' eager
    attention (scale, cap, mask, fp32 softmax); q [B, H, S, D], k and v [B, KV, S, D] (KV divides H),
    mask a boolean [B, 1, S, S] of visible keys or None."""
    scores, visible, v = _eager_scores(q, k, v, mask, causal, scaling)
    scores = torch.tanh(scores / cap) * cap
    if visible is not None:
        scores = scores.masked_fill(~visible, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Optional[torch.Tensor],
    dropout: float,
    causal: bool,
    scaling: Optional[float],
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention whose softmax also sees one learned logit per head that attends to no value (gpt-oss'
    sinks), in the order of transformers' eager attention for it (scale, mask, sink column, max
    subtracted, softmax, sink dropped); q [B, H, S, D], k and v [B, KV, S, D], sinks [H]."""
    scores, visible, v = _eager_scores(q, k, v, mask, causal, scaling)
    if visible is not None:
        scores = scores + torch.zeros_like(scores).masked_fill(~visible, torch.finfo(scores.dtype).min)
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1).to(scores.dtype)
    logits = torch.cat([scores, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=dropout > 0).to(v.dtype)
    return torch.matmul(probs, v)


def _document_starts(shard: SequenceShard, position_ids: Optional[torch.Tensor], query: torch.Tensor) -> torch.Tensor:
    """[B, local seq]: the global index where each local query's example starts (its global index
    minus its position within the example): keys from there up to the query are visible."""
    if position_ids is None:
        raise RuntimeError(
            "packed examples under sequence parallelism need the model to pass position_ids to attention"
        )
    local = query.shape[2]
    index = shard.positions(local * shard.size).to(query.device)
    return (index.unsqueeze(0) - position_ids.to(query.device)).expand(query.shape[0], local)


def _check_supported(config, mode: str, seq_len: int, sinks: bool = False) -> None:
    """Refuse what the sp attention would silently get wrong: sliding windows shorter than the
    sequence (the ops are plain causal), and attention dropout or sinks under ring attention."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or []
    windowed = "sliding_attention" in types or (
        config.model_type in ("mistral", "mixtral", "phi3", "qwen3_moe") and window
    )
    if windowed and window and window < seq_len:
        raise NotImplementedError(
            f"sequence parallelism runs full causal attention; this {config.model_type} model uses "
            f"a sliding window of {window} < train.seq_len={seq_len}: set "
            "model.config.sliding_window=null or parallel.sp=1"
        )
    if mode == "ring" and getattr(config, "attn_logit_softcapping", None):
        raise NotImplementedError(
            "ring attention does not cap attention scores (model.config.attn_logit_softcapping): use "
            "parallel.sp_mode=ulysses"
        )
    if mode == "ring" and sinks:
        raise NotImplementedError(
            f"ring attention does not add {config.model_type}'s attention sink logits: use parallel.sp_mode=ulysses"
        )
    dropout = max(float(getattr(config, name, 0.0) or 0.0) for name in ("attention_dropout", "attn_pdrop"))
    if mode == "ring" and dropout > 0:
        raise NotImplementedError(
            f"ring attention does not implement attention dropout ({dropout}): set the model's "
            "attention dropout to 0 or use parallel.sp_mode=ulysses"
        )


def _no_mask(*args, **kwargs):
    """Mask function for the sp attention names: causality is handled inside the attention ops."""
    return None


def register_attention() -> None:
    """Add the sp attention names to transformers' attention and mask registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in ATTENTION_NAMES.values():
        AttentionInterface.register(name, _sp_attention)
        AttentionMaskInterface.register(name, _no_mask)


def apply_sp(model: nn.Module, adapter, shard: Optional[SequenceShard], seq_len: int) -> None:
    """Route every attention layer of `model` (an HF model or a pipeline stage) through the sp group.

    Call after tensor parallelism (heads are then the local tp heads; Ulysses splits them again
    over sp) and before recompute and FSDP. Pipeline stages also get their position ids
    (`position_ids` attribute, the stage builds none then). No-op without sequence parallelism.
    """
    if shard is None:
        return
    layers = adapter.layers(model)
    decoder_layers = layers.values() if isinstance(layers, nn.ModuleDict) else layers
    attentions = [adapter.attention(layer) for layer in decoder_layers]
    sinks = any(isinstance(getattr(a, "sinks", None), nn.Parameter) for a in attentions)
    _check_supported(model.config, shard.mode, seq_len, sinks)
    register_attention()
    name = ATTENTION_NAMES[shard.mode]
    for attn in attentions:
        setattr(attn, SP_ATTR, shard)
    found = len(attentions)
    if not found:
        raise ValueError(f"{type(model).__name__} has no decoder layers for sequence parallelism")
    # Every config object the modules read (a pipeline stage deep-copies its layers' config).
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = name
    if "position_ids" in vars(model):  # a PipelineStageModule's plain attribute (never an HF buffer)
        model.position_ids = shard.position_ids(seq_len)
    log.info(
        "sequence parallel %s: sp rank %d of %d, %d attention layers, tokens at positions %s",
        shard.mode,
        shard.rank,
        shard.size,
        found,
        _ranges(shard.positions(seq_len)),
    )


def _ranges(positions: torch.Tensor) -> str:
    """'0-127, 384-511': the runs of consecutive positions (for the log)."""
    p = positions.tolist()
    starts = [i for i in range(len(p)) if i == 0 or p[i] != p[i - 1] + 1]
    return ", ".join(f"{p[a]}-{p[b - 1]}" for a, b in zip(starts, starts[1:] + [len(p)]))
