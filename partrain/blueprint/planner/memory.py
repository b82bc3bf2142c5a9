"""Memory per rank: model states (parameters, gradients, optimizer) and activations.

Published formulas (reproduced exactly; tests check the papers' numbers):

- `zero_model_state_bytes`: Rajbhandari et al. 2019 (ZeRO), mixed-precision Adam, K = 12:
  baseline (2+2+K)Psi, P_os 4Psi + K Psi/N, P_os+g 2Psi + (2+K)Psi/N, P_os+g+p (2+2+K)Psi/N.
- `korthikanti_layer_bytes`: Korthikanti et al. 2022, activation bytes of one GPT layer (16-bit
  activations, 1-byte dropout masks, attention scores stored): sbh(34 + 5as/h) without parallelism;
  TP t: sbh(10 + 24/t + 5as/(ht)); TP + sequence parallel: sbh/t (34 + 5as/h); selective
  recompute drops the 5as/h term; full recompute keeps the layer input, 2sbh (2sbh/t with SP).

What partrain really holds:

- `model_state_elements` / `model_state_bytes_per_rank`: per tensor, after TP (dims listed in
  params.py), expert parallelism, the pipeline split (the last chunk holds its own copy of a tied
  embedding) and ZeRO: stage 0 = DDP (all replicated); stage 1 = partrain's ShardedOptimizer
  (parameters and gradients whole; Adam state of each parameter group - decayed >= 2-D tensors and
  the rest - flattened and cut into N equal slices of ceil(numel/N)); stages 2/3 = FSDP2, measured
  at rest after the optimizer step: every tensor cut on dim 0 as torch.chunk does (ceil(d0/N) rows
  per rank, the last ranks fewer or none), gradients and Adam state shaped like the local shard.
- `LayerActivations`: saved-for-backward bytes of one decoder layer of the HF module as autograd
  really keeps it (each tensor counted once by storage, weights excluded), checked against
  `torch.autograd.graph.saved_tensors_hooks` on the tiny models. For GPT-style layers under the
  paper's assumptions (fused GeLU, 16-bit, dropout, scores stored) it reduces to Korthikanti's
  34sbh + 5as^2b, plus the small fp32 statistics (layer-norm mean/rstd, softmax logsumexp) the
  paper neglects. The device changes what autocast keeps (`device_rules.py`: on CUDA, GPT-2's
  tanh-GELU keeps fp32 tensors); checked against H200 measurements (tests/fixtures/gpu_h200_calib.jsonl).
- Megatron-SP (`tp_sp`): norms and the residual stream per sequence shard (/tp), and the inputs
  of each block's column-parallel projections kept once as a compute-dtype sequence shard
  (`seq_inputs`, /tp: partrain.parallel.megatron_sp re-gathers them in backward); a MoE block still
  saves its gathered input. So a dense layer keeps its tp=1 bytes / tp (tests: GPT-3 175B at tp8,
  and hooks on the tiny models at tp2).
- Selective recompute: Korthikanti's attention core is recomputed (partrain.parallel.recompute),
  so the core's own saves (`scores`: eager scores and probabilities, or SDPA's log-sum-exp) are
  dropped; q, k, v stay (the core's inputs).
- Sequence/context parallelism (sp > 1): every per-token term above for the rank's seq/sp tokens,
  rotary tables and position ids of the local positions, and what the ring / Ulysses attention
  keeps instead of SDPA (`sp_attention_saved`: K/V width as the wiring passes them, Ulysses' second
  copy of the attention output) plus its transient buffers (`sp_attention_transient`); checked
  against saved-tensor hooks in real sp processes by benchmarks/sp.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple

from partrain.blueprint.families import family
from partrain.blueprint.model_facts import ModelFacts
from partrain.blueprint.planner.device_rules import cuda_autocast, gelu_saved_per_element
from partrain.blueprint.planner.moe import kept_fraction
from partrain.blueprint.planner.params import TensorSpec, layer_is_sparse, layer_tensors
from partrain.blueprint.planner.spec import ModelExtras, PlanSpec

# ---- published formulas ---------------------------------------------------------------------------


def zero_model_state_bytes(psi: float, n_d: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per device of ZeRO stage `stage` (0 = baseline data parallel, 1 = P_os,
    2 = P_os+g, 3 = P_os+g+p) for Psi parameters over N_d devices, mixed-precision Adam (K=12)."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / n_d
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n_d
    if stage == 3:
        return (2 + 2 + k) * psi / n_d
    raise ValueError(f"ZeRO stage must be 0..3, got {stage}")


def korthikanti_layer_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes of one transformer layer (Korthikanti et al. 2022, section 4 and their table of
    per-layer activation memory for each technique)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    attn = 0.0 if recompute == "selective" else 5 * a * s / h
    if t == 1:
        return s * b * h * (34 + attn)
    if sequence_parallel:
        return s * b * h / t * (34 + attn)
    return s * b * h * (10 + 24 / t + attn / t)


def korthikanti_first_stage_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    layers: int,
    t: int = 1,
    p: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
    v: int = 1,
) -> float:
    """Activation bytes of the first pipeline stage with 1F1B (it holds p microbatches of L/p
    layers = L layers' worth), times 1 + (p-1)/(p v) for the interleaved schedule (Korthikanti et al.)."""
    factor = 1 + (p - 1) / (p * v) if v > 1 else 1.0
    return korthikanti_layer_bytes(s, b, h, a, t, sequence_parallel, recompute) * layers * factor


# ---- bytes per element ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Dtypes:
    param: int
    grad: int
    optim: int
    """Optimizer bytes per parameter (Adam m + v, plus an fp32 master copy when params are 16-bit)."""
    compute: int
    """Activations that feed matmuls (16-bit under mixed precision)."""
    resid: int
    """Residual stream and norm inputs (fp32 under autocast)."""
    autocast_copies: bool
    """torch.autocast keeps a 16-bit copy of every weight per in-flight microbatch."""
    zero1_reduce_scatter: bool = False
    """ZeRO-1 reduce-scatters the gradients (the paper's accounting) instead of all-reducing them."""


def dtypes(precision: str, mixed: str = "autocast") -> Dtypes:
    if precision == "fp32":
        return Dtypes(4, 4, 8, 4, 4, False)
    if mixed == "autocast":
        return Dtypes(4, 4, 8, 2, 4, True)
    if mixed == "master":  # 16-bit params, fp32 gradient buffer, fp32 master + Adam (master_weights.py)
        return Dtypes(2, 4, 12, 2, 2, False)
    return Dtypes(2, 2, 12, 2, 2, False, True)


# ---- model states -----------------------------------------------------------------------------------


def tensor_state_elements(
    tensors: Sequence[TensorSpec],
    tp: int,
    ep: int,
    n_dense: int,
    n_expert: int,
    zero_stage: int,
    shard_index: int = 0,
    expert_index: int = -1,
) -> Tuple[int, int, int, int]:
    """(parameter elements, FSDP optimizer elements, ZeRO-1 group of >= 2-D tensors, ZeRO-1 group of
    the rest, gradient elements) that the rank at position `shard_index` of its shard group holds of
    `tensors`.

    Gradients have the trainable parameters' shape; a frozen tensor (LoRA's base) has neither a
    gradient nor optimizer state. Optimizer elements count Adam's moments once (multiply by
    the optimizer bytes per parameter); for ZeRO 0/1 they follow from the two groups
    (`zero1_optimizer_elements`). FSDP (ZeRO 2/3) cuts dim 0 of each local tensor as torch.chunk does;
    position 0 holds the largest shards (the worst rank); experts shard over n_expert ranks (their
    edp group), where the rank sits at `expert_index` (-1: the same position as shard_index).
    """
    params = optim = group2 = group1 = grads = 0
    for t in tensors:
        shape = t.local_shape(tp, ep)
        numel = math.prod(shape)
        if zero_stage >= 2:
            n = n_expert if t.expert else n_dense
            index = expert_index if t.expert and expert_index >= 0 else shard_index
            local = numel // shape[0] * _chunk_rows(shape[0], n, index % n) if shape[0] else 0
            params += local
            optim += local if t.trainable else 0
            grads += local if t.trainable else 0
        else:
            params += numel
            grads += numel if t.trainable else 0
            if not t.trainable:
                continue
            if len(shape) >= 2:
                group2 += numel
            else:
                group1 += numel
    return params, optim, group2, group1, grads


def zero1_optimizer_elements(group2: int, group1: int, n: int, zero_stage: int) -> int:
    """Adam state elements of ZeRO 0 (everything) or partrain's ZeRO-1 (each parameter group - decayed
    >= 2-D tensors, and the rest - flattened and cut into n equal slices of ceil(numel / n))."""
    if zero_stage == 1 and n > 1:
        return sum(-(-g // n) for g in (group2, group1) if g)
    return group2 + group1


def _chunk_rows(d0: int, n: int, index: int) -> int:
    """Rows of dim 0 that rank `index` of n holds under torch.chunk (FSDP2's split)."""
    per = -(-d0 // n)
    return max(0, min(per, d0 - index * per))


# ---- activations --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LayerActivations:
    """Saved bytes of one decoder layer for one microbatch, split by how TP/SP divides them."""

    resid: float
    """Residual stream / norm internals: divided by tp only with Megatron sequence parallelism."""
    gathered: float
    """Inputs of column-parallel projections: the whole (all-gathered) tensor on every TP rank."""
    seq_inputs: float
    """Inputs of column-parallel projections under Megatron-SP (`parallel.megatron_sp`): each rank
    keeps its sequence shard (re-gathered in backward), divided by tp."""
    sharded: float
    """Per-head and MLP-intermediate tensors: divided by tp."""
    replicated: float
    """MoE routers/experts (replicated over TP): never divided by tp."""
    scores: float
    """Attention-core tensors a selective recompute drops (s x s scores when stored; logsumexp)."""
    weights: float
    """16-bit weight copies autocast saves (already per-rank after TP/EP)."""
    layer_input: float
    """What a fully recomputed layer keeps: its input (residual dtype)."""

    def per_rank(self, tp: int, tp_sp: bool, recompute: str) -> float:
        if recompute == "full":
            return self.layer_input / (tp if tp_sp else 1)
        keep_scores = 0.0 if recompute == "selective" else self.scores / tp
        return (
            self.resid / (tp if tp_sp else 1)
            + self.gathered
            + self.seq_inputs / (tp if tp_sp else 1)
            + self.sharded / tp
            + self.replicated
            + keep_scores
            + self.weights
        )


def _moe_saved(spec: PlanSpec, tokens: float, c: int) -> float:
    """Saved bytes of a MoE block's router and experts (replicated over TP) for `tokens` tokens."""
    f, x, fam = spec.facts, spec.extras, family(spec.facts.arch)
    h, k, e, ffn = f.hidden, f.experts_per_token, f.n_experts, f.ffn
    router = e * 4 + k * 8 + (4 + k * 4 if x.norm_topk_prob else 0)  # fp32 softmax, top-k ids, renormalisation
    # Per (token, expert) pair: input, gate|up, act, product, down output in compute dtype;
    # the routing-weighted output in fp32; the weight; two int64 indices.
    per_assign = (2 * h + 4 * ffn) * c + h * 4 + (c if fam.routing_weights_in_compute_dtype else 4) + 16
    # A capacity factor below 1 drops pairs before the experts (balanced routing: planner/moe.py).
    saved = tokens * (router + k * kept_fraction(spec, tokens) * per_assign)
    if fam.shared_expert and f.shared_expert_ffn:
        saved += tokens * ((4 * f.shared_expert_ffn + h + 1) * c)
    return saved


def layer_activations(spec: PlanSpec, sparse: bool, tokens: float, seq: int, dt=None) -> LayerActivations:
    """Counted saved bytes of one decoder layer (see module docstring), for `tokens` tokens of
    sequences of length `seq` on this rank (before TP; after sequence/context parallel)."""
    f, x = spec.facts, spec.extras
    d = dt or dtypes(spec.precision, spec.style)
    c, r = d.compute, d.resid
    h, a = f.hidden, f.heads
    q, kv = f.heads * f.head_dim, f.kv_heads * f.head_dim
    sp_attn = sp_attention_saved(spec)
    eager = x.attn_impl == "eager" and not sp_attn  # sp > 1 replaces the attention function
    mask = 1 if x.resid_dropout else 0
    seq_inputs = 0.0
    fam = family(f.arch)
    if fam.block == "gpt2":
        resid = tokens * (2 * h * r + 4 * 4 + 2 * h * mask)  # ln inputs + mean/rstd; residual dropout masks
        gathered = tokens * 2 * h * c  # c_attn and c_fc inputs (one fused projection each)
        if spec.tp_sp:  # Megatron-SP keeps each block's input as a 16-bit (compute dtype) sequence shard
            seq_inputs, gathered = gathered, 0.0
        # qkv, attention output (compute dtype), MLP intermediates (fp32 in part under CUDA autocast)
        on_cuda = cuda_autocast(spec.cluster.device, d.autocast_copies)
        sharded = tokens * ((3 * h + h) * c + f.ffn * gelu_saved_per_element(x.activation, c, on_cuda))
        if sp_attn:
            sharded += tokens * h * c * sp_attn["extra_outputs"]
    else:
        resid = tokens * fam.residual_norms * (2 * h * r + 4)  # each RMSNorm: input and normalised, rsqrt
        # Attention and MLP inputs. Under autocast every projection casts its input on its own, so
        # q, k, v (and gate, up; router and shared expert) each keep a 16-bit copy.
        if d.autocast_copies:
            mlp_casts = fam.moe_input_casts if sparse else 2
            gathered = tokens * (3 + mlp_casts) * h * c
        else:
            gathered = tokens * 2 * h * c
        if spec.tp_sp:
            # Megatron-SP: attention (and dense MLP) inputs kept once per block as a compute-dtype
            # sequence shard; a MoE block still sees (and saves) the gathered sequence.
            seq_inputs = tokens * (1 if sparse else 2) * h * c
            gathered = tokens * (mlp_casts if d.autocast_copies else 1) * h * c if sparse else 0.0
        k_saved = sp_attn["kv_width"] if sp_attn else (q if eager else kv)  # eager repeats the KV heads first
        sharded = tokens * (q + 2 * k_saved + q) * c  # q, k, v (after rotary), attention output
        if fam.qk_norm:
            # q_norm / k_norm (per head): the fp32 input, the normalised input in compute dtype, rsqrt.
            sharded += tokens * ((q + kv) * (4 + c) + (f.heads + f.kv_heads) * 4)
        if sp_attn:
            sharded += tokens * q * c * sp_attn["extra_outputs"]
    scores = 0.0
    if eager:
        per_score = c + ((1 + c) if x.attn_dropout else 0)
        scores = tokens * a * seq * per_score
    else:
        scores = tokens * a * 4  # fp32 logsumexp of the fused kernel
    replicated = 0.0
    if fam.block != "gpt2":
        if sparse:
            replicated = _moe_saved(spec, tokens, c)
        else:
            sharded += tokens * 4 * (x.dense_ffn or f.ffn) * c  # gate, up, act(gate), product
    weights = 0.0
    # FSDP (zero 2/3) runs 16-bit training with a MixedPrecisionPolicy: its layers compute with
    # 16-bit parameters, so autocast has no weight copies to keep.
    if d.autocast_copies and spec.zero_stage < 2:
        tensors = layer_tensors(f, x, 0 if not sparse else _sparse_index(f, x))
        weights = sum(_local_numel(t, spec.tp, spec.ep) for t in tensors if len(t.shape) >= 2) * c
    return LayerActivations(
        resid=resid,
        gathered=gathered,
        seq_inputs=seq_inputs,
        sharded=sharded,
        replicated=replicated,
        scores=scores,
        weights=weights,
        layer_input=tokens * h * r,
    )


SP_REPEATS_KV = False
"""Whether partrain's sp attention (`context_parallel._sp_attention`) repeats the K/V heads to the
query count before the ring / Ulysses ops. It does not: grouped-query K/V reach the ops unrepeated,
the ring moves and keeps only the K/V heads there are, Ulysses repeats them just enough for sp to
divide them. (True describes the earlier wiring; the tests check the byte counts both ways.)"""


def sp_kv_width(spec: PlanSpec) -> float:
    """Elements per local token of K (and of V) that the sp attention moves and keeps, per TP rank."""
    f = spec.facts
    heads, kv_heads = f.heads / spec.tp, f.kv_heads / spec.tp
    if SP_REPEATS_KV or family(f.arch).block == "gpt2":
        return heads * f.head_dim
    if spec.sp_mode == "ring":
        return kv_heads * f.head_dim
    # Ulysses repeats the K/V heads just enough for sp to divide them (sequence_attention._kv_repeat_for).
    group = int(heads // kv_heads)
    r = next((r for r in range(1, group + 1) if group % r == 0 and (kv_heads * r) % spec.sp == 0), group)
    return kv_heads * r * f.head_dim


def sp_attention_saved(spec: PlanSpec) -> Dict[str, float]:
    """What partrain's sequence-parallel attention (`partrain.parallel.sequence_attention`, wired by
    `context_parallel.apply_sp`) keeps per layer; {} when sp == 1.

    "kv_width": elements per token of each of K and V it keeps (`sp_kv_width`, before TP), whatever
    the model's attn_implementation (eager is replaced). "extra_outputs": outputs kept beyond SDPA's
    set of q, k, v, output and fp32 log-sum-exp:
    - ring: none (the output is laid out so that the o_proj input is the same storage);
    - ulysses: SDPA on the head-sharded full sequence keeps q, k, v, its output and log-sum-exp
      (1/sp of the heads x sp times the tokens = the same bytes per local token); the all-to-all
      back makes the o_proj input a second copy of the output: one extra output per layer.
    """
    if spec.sp <= 1:
        return {}
    return {"kv_width": sp_kv_width(spec) * spec.tp, "extra_outputs": 1 if spec.sp_mode == "ulysses" else 0}


def sp_attention_transient(spec: PlanSpec, tokens: float, dt=None) -> float:
    """Bytes the sp attention of one layer holds only while it runs (not saved for backward), per
    rank, for `tokens` local tokens; the largest moment is the backward.

    - ring: the K/V pair being computed with and the pair arriving (input dtype), the fp32 dK/dV of
      the held block, the one being sent and the one arriving, the fp32 dq;
    - ulysses: the send and receive buffers of one all-to-all of q, k and v (input dtype).
    """
    if spec.sp <= 1:
        return 0.0
    d = dt or dtypes(spec.precision, spec.style)
    q = spec.facts.heads * spec.facts.head_dim / spec.tp
    kvw = sp_kv_width(spec)
    if spec.sp_mode == "ring":
        return tokens * (2 * 2 * kvw * d.compute + 3 * 2 * kvw * 4 + q * 4)
    return tokens * (q + 2 * kvw) * 2 * d.compute


def _sparse_index(f: ModelFacts, x: ModelExtras) -> int:
    for i in range(f.n_layers):
        if layer_is_sparse(f, x, i):
            return i
    return 0


def _local_numel(t: TensorSpec, tp: int, ep: int) -> int:
    n = 1
    for d in t.local_shape(tp, ep):
        n *= d
    return n


def end_activations(spec: PlanSpec, first: bool, last: bool, tokens: float, seq: int, b: float, dt=None) -> float:
    """Saved bytes outside the decoder layers for one microbatch on one rank: token ids (and GPT-2
    positions, embedding dropout mask) on the first chunk; rotary cos/sin on every chunk (Llama);
    final norm, head input, fp32 log-softmax of the logits (vocabulary-parallel: /tp) and labels on
    the last chunk; with the chunked loss (`spec.loss_chunked`) only the final norm and the labels."""
    f, x = spec.facts, spec.extras
    d = dt or dtypes(spec.precision, spec.style)
    h, tp = f.hidden, spec.tp
    out = 0.0
    local_seq = seq / max(1, spec.sp)  # sp ranks get the position ids of their own tokens
    gpt2 = family(f.arch).block == "gpt2"
    if not gpt2:
        out += 2 * local_seq * f.head_dim * d.resid
    if first:
        out += tokens * 8
        if gpt2:
            out += local_seq * 8 + (tokens * h if x.embd_dropout else 0)
    if last:
        div = tp if spec.tp_sp else 1
        if gpt2:
            out += tokens * (h * d.resid + 8) / div
        else:
            out += tokens * (2 * h * d.resid + 4) / div
        if spec.loss_chunked(tokens):  # checkpointed chunks keep only the head input (counted above)
            out += tokens * 8 + 4
        else:
            out += tokens * h * d.compute + tokens * f.vocab / tp * 4 + tokens * 8 + 4
        if d.autocast_copies and spec.zero_stage < 2:
            out += f.vocab / tp * h * d.compute  # autocast's 16-bit copy of the head weight
    return out
