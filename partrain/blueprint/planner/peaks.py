"""Transient bytes of a rank's step beyond its saved activations: the forward's peak and the
backward's, of which the rank's memory counts the larger (estimate._rank_memory adds what both
phases hold: sp attention buffers, FSDP's gathered parameters and unsharded gradients).

partrain's microbatch (train.engine): forward and loss under torch.autocast, then the backward
outside it. The loss (`models.loss.token_loss`) is cross-entropy on `logits.float()`, i.e.
log_softmax (its fp32 output is saved: `memory.end_activations`) and nll_loss. With the chunked
loss (`train.loss_chunk_tokens`, `models.chunked_loss`) every figure below is one chunk's, and the
chunk's log-softmax output is transient: each chunk is checkpointed and recomputed in backward.

- Forward, last rank: the logits in the compute dtype and their fp32 copy, alive while log_softmax
  writes its output.
- Forward, full recompute under autocast: autocast caches the 16-bit copy of every weight it casts
  until the autocast region exits (at the end of the forward, on CPU and CUDA alike), so the copies
  of all the rank's recomputed layers are alive at the forward's end although no layer saves them.
- Backward, last rank: nll_loss's gradient (dense, fp32, the logits' shape) and log_softmax's
  gradient of the fp32 logits, while the saved log-softmax output is still held: 2 x 4 bytes per
  logit. They are freed once the head's backward has run; a fully recomputed layer then holds its
  whole activations (`memory.LayerActivations` with recompute none): the larger of the two counts.

Checked against torch.cuda.max_memory_allocated on an H200 (the forward's peak of a 2-layer model:
tests/test_planner_gpu_calibration.py).
"""

from __future__ import annotations

from partrain.blueprint.planner.memory import layer_activations
from partrain.blueprint.planner.rank_state import PipelineRank
from partrain.blueprint.planner.spec import PlanSpec


def loss_forward_bytes(spec: PlanSpec, tokens: float, compute: int) -> float:
    """Logits in the compute dtype plus their fp32 copy (none when they already are fp32), per rank
    (vocabulary-parallel logits: /tp). Chunked loss: one chunk's, plus its log-softmax output
    (freed with the chunk instead of being saved, `memory.end_activations`)."""
    per_logit = compute + (4 if compute != 4 else 0)
    if spec.loss_chunked(tokens):
        return spec.loss_chunk(tokens) * spec.facts.vocab / spec.tp * (per_logit + 4)
    return tokens * spec.facts.vocab / spec.tp * per_logit


def loss_backward_bytes(spec: PlanSpec, tokens: float, compute: int = 4) -> float:
    """fp32 gradients of the log-softmax output and of the logits, per rank. Chunked loss: one
    chunk's, while that chunk's recomputed logits, fp32 copy and log-softmax output are held."""
    if spec.loss_chunked(tokens):
        per_logit = compute + (4 if compute != 4 else 0) + 4 + 2 * 4
        return spec.loss_chunk(tokens) * spec.facts.vocab / spec.tp * per_logit
    return tokens * spec.facts.vocab / spec.tp * 2 * 4


def _weight_copies(spec: PlanSpec, r: PipelineRank, s) -> float:
    """16-bit autocast copies of all the rank's layer weights (0 when there are none to make)."""
    if not s.dt.autocast_copies or spec.zero_stage >= 2 or not r.layers:
        return 0.0
    dense = r.layers - r.sparse
    out = layer_activations(spec, False, s.tokens, spec.seq, s.dt).weights * dense
    if r.sparse:
        out += layer_activations(spec, True, s.tokens, spec.seq, s.dt).weights * r.sparse
    return out


def autocast_cache_bytes(spec: PlanSpec, r: PipelineRank, s) -> float:
    """16-bit weight copies of the rank's fully recomputed layers held by autocast's cast cache
    until the forward ends (16-bit FSDP parameters need no copies). A pipeline's copies are counted
    as resident for the whole step instead (`pipeline_copies_correction`)."""
    if spec.recompute != "full" or spec.pp > 1:
        return 0.0
    return _weight_copies(spec, r, s) / max(1, spec.recompute_every)


def pipeline_copies_correction(spec: PlanSpec, r: PipelineRank, s, in_flight: int) -> float:
    """Bytes to add to a pipeline rank's saved activations (negative: fewer) for autocast's copies.

    The per-layer count saves each layer's 16-bit weight copy once per in-flight microbatch, as
    separate autocast regions do (one per microbatch without a pipeline). A pipeline runs its whole
    schedule in one autocast region (train.engine.PipelineEngine), so the cast cache makes one copy
    per weight, shared by every microbatch and alive for the whole step, recomputed layers included."""
    if spec.pp == 1:
        return 0.0
    every = _weight_copies(spec, r, s)
    if not every:
        return 0.0
    kept_share = (1 - 1 / max(1, spec.recompute_every)) if spec.recompute == "full" else 1.0
    counted = in_flight * (r.layers / len(r.chunks)) * (every / r.layers) * kept_share
    return every - counted


def forward_transient(spec: PlanSpec, r: PipelineRank, s) -> float:
    """Bytes beyond the saved activations at the forward's peak (the loss, on the last rank)."""
    out = autocast_cache_bytes(spec, r, s)
    if r.last:
        out += loss_forward_bytes(spec, s.tokens, s.dt.compute)
    return out


def backward_transient(spec: PlanSpec, r: PipelineRank, s) -> float:
    """Bytes beyond the saved activations at the backward's peak: the loss gradients (last rank)
    or, later, one fully recomputed layer's activations (the loss gradients are freed by then)."""
    recomputed = max(s.acts[k][1] for k in s.acts) if spec.recompute == "full" and r.layers else 0.0
    return max(recomputed, loss_backward_bytes(spec, s.tokens, s.dt.compute) if r.last else 0.0)


def phase_transient(spec: PlanSpec, r: PipelineRank, s) -> float:
    """The larger of the forward's and the backward's transient peak."""
    return max(forward_transient(spec, r, s), backward_transient(spec, r, s))
