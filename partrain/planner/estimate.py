"""Per-rank memory, FLOPs, communication, pipeline bubble and step time of one layout.

`estimate(v)` takes a `ValidatedRun` and returns the JSON-able "estimate" of the plan report;
`estimate_spec(spec)` does the same from a `PlanSpec` (the search calls it thousands of times).

Step-time model (documented in every report's "assumptions"):

    t_mb(r)   = compute(r) + TP + SP + EP collectives + pipeline sends + exposed FSDP traffic
                (one microbatch's forward + backward through pipeline rank r's layers)
    step time = (m + bubble units) * max_r t_mb(r) + exposed data-parallel traffic

- compute = FLOPs executed (3 passes; + the recomputed forward) / (peak FLOP/s * efficiency).
  Efficiency on GPUs: 0.70 * h / (h + 900) (achieved matmul throughput grows with the hidden size;
  fitted to the achieved TFLOP/s of Narayanan et al. 2021, Table 1, A100: 0.50 at h=2304 ... 0.68 at
  h=25600); on CPUs 0.5 of the stated peak.
- TP: per layer 2 all-reduces of the activations forward and 2 backward (Megatron's f and g; with
  sequence parallelism the same bytes as all-gather + reduce-scatter; MoE layers 1 + 1 since their
  experts are replicated over TP), 2 more forward with full recompute, plus the vocabulary-parallel
  embedding (forward) and head (backward); never overlapped (as in Megatron-LM 2021).
- SP (context parallel, `_sp_comm`): Ulysses all-to-all of q, k, v and the attention output,
  forward and backward, not overlapped; ring passes K and V around the ring (backward also their
  fp32 gradients), each step's transfer hidden behind that step's attention block where the block
  is long enough. K/V at the width partrain's sp attention moves them (memory.sp_kv_width).
- EP: dispatch and combine all-to-all per MoE layer, forward and backward.
- PP: each chunk sends its output forward and its input gradient backward per microbatch, 1/tp of
  the activation per TP rank (sequence parallel shards, or Megatron's scatter/gather), not overlapped.
- DP: ZeRO 0 all-reduces the gradients once per step, overlapped with the last microbatch's
  backward (dp_overlap=False: after it, as Megatron-LM 2021's local DDP did); ZeRO 1 reduce-scatters
  the gradients (mixed="zero"; partrain's fp32/autocast runtime all-reduces them) and all-gathers
  the updated parameters after the step (not overlapped); ZeRO 2 (FSDP2, parameters kept from forward
  to backward) all-gathers parameters and reduce-scatters gradients every microbatch, ZeRO 3
  all-gathers twice; overlapped with that microbatch's compute. Hybrid sharding adds an all-reduce
  of the shards across replicas.
- Links: TP at intra-node bandwidth when the group is inside a node; every group at the slowest
  link it spans (see comm.py). The optimizer update itself is not timed.
- Bandwidths: the cluster's nominal link speeds, or with `cluster.comm_profile` the bus bandwidth
  `partrain bench comm` measured for each op on that link class: TP all-reduce (Megatron-SP:
  all-gather + reduce-scatter), Ulysses and EP all-to-all, ring attention and PP send/recv, DP
  all-reduce / all-gather / reduce-scatter by ZeRO stage (one bandwidth per step, weighted by the
  collectives' rough volume shares). "bandwidth_source" in the report says which.

Reported communication (`comm_bytes_per_step`) is the volume one rank moves per step in each group
family (ring volumes, see comm.py), for the busiest pipeline rank; "dp" includes ZeRO/FSDP traffic.

Memory of a rank = model states at rest (params, grads, optimizer: memory.py) + saved activations
of the microbatches in flight (pipeline.py) + transients: the all-gathered parameters FSDP holds
(ZeRO 2: the rank's whole unsharded model from forward to backward; ZeRO 3: the root - embeddings,
final norm, head - plus two layers), one layer's full activations while it is recomputed, and the
fp32 gradient of the logits on the last stage. It fits when the total is at most
USABLE_MEMORY_FRACTION of the device memory (the rest: CUDA context, allocator fragmentation,
communication buffers).
"""

from __future__ import annotations

import functools
import math
from typing import Dict, List, Sequence, Tuple

from .comm import COMM_OPS, all_gather_bytes, all_reduce_bytes, all_to_all_bytes, bandwidth, family_groups, link_of
from .flops import head_forward_flops, layer_forward_flops, step_flops
from .memory import (LayerActivations, dtypes, end_activations, korthikanti_layer_bytes, layer_activations, sp_attention_transient,
                     sp_kv_width, tensor_state_elements, zero1_optimizer_elements)
from .params import TensorSpec, embed_tensors, final_tensors, layer_is_sparse, layer_tensors, param_count, tied_head_copy
from .pipeline import bubble_fraction, bubble_overhead, bubble_units, chunk_layer_counts, in_flight, rank_chunks
from .spec import GB, GIB, PlanSpec, spec_from_validated

USABLE_MEMORY_FRACTION = 0.95
"""Share of device memory the estimate may fill and still call the layout fitting."""


def matmul_efficiency(spec: PlanSpec) -> float:
    """Achieved fraction of peak FLOP/s for the model's matmuls (see module docstring)."""
    if spec.cluster.device != "cuda":
        return 0.5
    h = spec.facts.hidden
    return 0.70 * h / (h + 900)


# ---- model states, aggregated by kind of tensor group ----------------------------------------------


@functools.lru_cache(maxsize=65536)
def _group_parts(spec_key: Tuple, kind: Tuple, shard_index: int) -> Tuple[int, int, int, int]:
    """tensor_state_elements of one kind of tensor group (a dense or MoE layer, embeddings, ...)."""
    facts, extras, tp, ep, n_dense, n_exp, zero = spec_key
    return tensor_state_elements(_kind_tensors(facts, extras, kind), tp, ep, n_dense, n_exp, zero, shard_index)


@functools.lru_cache(maxsize=4096)
def _kind_tensors(facts, extras, kind: Tuple) -> List[TensorSpec]:
    if kind[0] == "layer":
        sparse = kind[1]
        index = next((i for i in range(facts.n_layers) if layer_is_sparse(facts, extras, i) == sparse), 0)
        return layer_tensors(facts, extras, index)
    if kind[0] == "embed":
        return embed_tensors(facts)
    if kind[0] == "final":
        return final_tensors(facts)
    if kind[0] == "tied":
        return [tied_head_copy(facts)]
    raise ValueError(kind)


def _spec_key(spec: PlanSpec) -> Tuple:
    n_dense = spec.shard
    n_exp = max(1, n_dense // math.gcd(n_dense, spec.ep))
    return (spec.facts, spec.extras, spec.tp, spec.ep, n_dense, n_exp, spec.zero_stage)


@functools.lru_cache(maxsize=1024)
def _sparse_prefix(facts, extras) -> Tuple[int, ...]:
    out = [0]
    for i in range(facts.n_layers):
        out.append(out[-1] + (1 if layer_is_sparse(facts, extras, i) else 0))
    return tuple(out)


class _Rank:
    """What one pipeline rank holds: its chunks, layer counts (dense / sparse), first/last chunk."""

    __slots__ = ("pp_rank", "chunks", "layers", "sparse", "first", "last", "n_chunks")

    def __init__(self, prefix: Sequence[int], n_chunks: int, pp_rank: int, chunks: Sequence[int], counts: Sequence[int],
                 starts: Sequence[int]):
        self.pp_rank = pp_rank
        self.chunks = list(chunks)
        self.n_chunks = n_chunks
        self.layers = sum(counts[c] for c in chunks)
        self.sparse = sum(prefix[starts[c] + counts[c]] - prefix[starts[c]] for c in chunks)
        self.first = 0 in chunks
        self.last = self.n_chunks - 1 in chunks

    def kinds(self, spec: PlanSpec) -> List[Tuple[Tuple, int]]:
        out: List[Tuple[Tuple, int]] = []
        if self.layers - self.sparse:
            out.append((("layer", False), self.layers - self.sparse))
        if self.sparse:
            out.append((("layer", True), self.sparse))
        if self.first:
            out.append((("embed",), 1))
        if self.last:
            out.append((("final",), 1))
            if spec.facts.tied_embeddings and self.n_chunks > 1:
                out.append((("tied",), 1))
        return out


def rank_state_elements(spec: PlanSpec, rank: _Rank, shard_index: int = 0) -> Tuple[int, int, int, int]:
    """(params, grads, optimizer, unsharded local params) elements of one rank."""
    key = _spec_key(spec)
    p = o = g2 = g1 = 0
    for kind, count in rank.kinds(spec):
        pp_, oo, a2, a1 = _group_parts(key, kind, shard_index)
        p += pp_ * count
        o += oo * count
        g2 += a2 * count
        g1 += a1 * count
    if spec.zero_stage >= 2:
        unsharded = sum(_group_parts(key[:-1] + (0,), kind, 0)[0] * count for kind, count in rank.kinds(spec))
        return p, p, o, unsharded
    return p, p, zero1_optimizer_elements(g2, g1, spec.shard, spec.zero_stage), p


def _ranks(spec: PlanSpec) -> List[_Rank]:
    return _ranks_cached(spec.facts, spec.extras, spec.pp, spec.v, spec.seq, spec.layers_per_chunk, spec.schedule)


@functools.lru_cache(maxsize=1024)
def _ranks_cached(facts, extras, pp, v, seq, layers_per_chunk, schedule) -> List[_Rank]:
    counts = chunk_layer_counts(facts, pp, v, seq, layers_per_chunk)
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    prefix = _sparse_prefix(facts, extras)
    return [_Rank(prefix, pp * v, r, chunks, counts, starts) for r, chunks in enumerate(rank_chunks(pp, v, schedule))]


def model_state_bytes_per_rank(v, mixed: str = "autocast") -> List[int]:
    """Predicted parameter + gradient + optimizer-state bytes of every rank (index = global rank),
    at rest after the first optimizer step, exactly as partrain's runtime holds them
    (`partrain.train.loop.model_state_bytes` sums the same local shards). `mixed="autocast"` is the
    runtime's 16-bit mode (fp32 weights); fp32 runs are the same in both modes."""
    spec = spec_from_validated(v, mixed=mixed)
    d = dtypes(spec.precision, spec.mixed)
    lay = v.layout
    out: List[int] = []
    cache: Dict[Tuple[int, int], int] = {}
    for rank in range(lay.world_size):
        key = (lay.base_coords(rank)["pp"], _shard_index(lay, rank))
        if key not in cache:
            p, g, o = predicted_rank_elements(spec, lay, rank)
            cache[key] = p * d.param + g * d.grad + o * d.optim
        out.append(cache[key])
    return out


def _shard_index(lay, rank: int) -> int:
    """Position of `rank` in its FSDP shard group (dp_shard x sp, in the order the axes have)."""
    c = lay.base_coords(rank)
    dp_shard_index = c["dp"] % lay.dp_shard
    if lay.order.index("dp") < lay.order.index("sp"):
        return dp_shard_index + lay.dp_shard * c["sp"]
    return c["sp"] + lay.sp * dp_shard_index


def predicted_rank_elements(spec: PlanSpec, lay, rank: int) -> Tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) elements that global `rank` of layout `lay` holds;
    optimizer elements count each Adam moment's element once (multiply by the optimizer bytes)."""
    p, g, o, _ = rank_state_elements(spec, _ranks(spec)[lay.base_coords(rank)["pp"]], _shard_index(lay, rank))
    return p, g, o


# ---- the estimate -------------------------------------------------------------------------------------


def _layer_flops_per_rank(spec: PlanSpec, sparse: bool, tokens: float) -> Tuple[float, float]:
    """(forward FLOPs of one layer on one rank, of which attention core) for one microbatch."""
    f, x, tp = spec.facts, spec.extras, spec.tp
    parts = layer_forward_flops(f, x, tokens, spec.seq, sparse)
    # A MoE block (router, experts, shared expert) is replicated over TP: every TP rank runs all of
    # it for its tokens; with expert parallelism a rank runs its experts for the tokens routed to
    # them, on average the same amount.
    mlp = parts["mlp"] if sparse else parts["mlp"] / tp
    core = parts["attn_core"] / tp
    return parts["attn_proj"] / tp + core + mlp, core


def _activation_terms(spec: PlanSpec, tokens: float, b: float, dt) -> Dict[bool, Tuple[float, float]]:
    """For dense and sparse layers: (saved bytes per layer per microbatch on a rank with the run's
    recompute policy, saved bytes without recompute)."""
    out = {}
    k = max(1, spec.recompute_every)
    for sparse in (False, True):
        if sparse and not spec.facts.is_moe:
            continue
        la: LayerActivations = layer_activations(spec, sparse, tokens, spec.seq, dt)
        none = la.per_rank(spec.tp, spec.tp_sp, "none")
        if spec.recompute == "none":
            kept = none
        else:
            policy = la.per_rank(spec.tp, spec.tp_sp, spec.recompute)
            kept = policy / k + none * (1 - 1 / k)
        out[sparse] = (kept, none)
    return out


@functools.lru_cache(maxsize=4096)
def _bandwidths(cl, order, tp: int, sp: int, dp: int, pp: int, ep: int, dp_shard: int) -> Dict[str, float]:
    """Bytes/s of each group family: "tp" (its all-reduce) and "tp/<op>" for every op (these differ
    only with a measured comm profile)."""
    groups = family_groups(order, {"tp": tp, "sp": sp, "dp": dp, "pp": pp}, ep, dp_shard)
    out = {name: bandwidth(cl, members) for name, members in groups.items()}
    out.update({f"{name}/{op}": bandwidth(cl, members, op) for name, members in groups.items() for op in COMM_OPS})
    return out


def _mixed_bw(bw: Dict[str, float], family: str, volumes: Dict[str, float]) -> float:
    """Bandwidth of traffic split over ops in these volume proportions: total / sum(volume / bw)."""
    rates = {op: bw[f"{family}/{op}"] for op in volumes}
    if len(set(rates.values())) == 1:  # nominal speeds: one bandwidth for every op
        return next(iter(rates.values()))
    return sum(volumes.values()) / sum(vol / rates[op] for op, vol in volumes.items())


def _dp_volumes(spec: PlanSpec, reduce_scatter: bool) -> Dict[str, float]:
    """Rough volume shares of the data-parallel collectives (ring volumes, per parameter)."""
    if spec.zero_stage == 0:
        return {"all_reduce": 1.0}
    if spec.zero_stage == 1:
        return {"reduce_scatter": 1.0, "all_gather": 1.0} if reduce_scatter else {"all_reduce": 2.0, "all_gather": 1.0}
    return {"all_gather": 1.0 if spec.zero_stage == 2 else 2.0, "reduce_scatter": 1.0}


def _sp_comm(spec: PlanSpec, layers: int, tokens: float, t_core: float, bw: Dict[str, float], act_bytes: int) -> Tuple[float, float]:
    """(bytes one rank sends, exposed seconds) of the sp attention of `layers` layers for one
    microbatch (forward, backward, and the recomputed forward under full recompute).

    Tensors per local token and TP rank: qw = heads x head_dim / tp (q, the output) and kvw (each
    of K and V: `memory.sp_kv_width`, the query width while partrain repeats the K/V heads).
    - ulysses: 4 all-to-alls forward (q, k, v to head shards, the output back), the same 4
      backward (the output's gradient in, the q, k, v gradients back); each moves (sp-1)/sp of
      its tensor; on the critical path (attention needs all of q, k, v).
    - ring: forward, sp-1 steps each pass the K/V pair on (input dtype); backward, the K/V pair
      again at sp-1 steps plus the fp32 dK/dV accumulators at all sp steps. A step's transfer
      overlaps that step's block of attention (t_core / sp forward, twice that backward); only
      what exceeds it shows, and the last dK/dV hop, which nothing overlaps.
    """
    f = spec.facts
    sp = spec.sp
    qt = tokens * f.heads * f.head_dim / spec.tp
    kvt = tokens * sp_kv_width(spec)
    # Full and selective recompute (partrain re-runs the whole attention block) repeat the forward.
    forwards = 1.0 + (1.0 / max(1, spec.recompute_every) if spec.recompute != "none" else 0.0)
    if spec.sp_mode == "ulysses":
        per_pass = all_to_all_bytes((2 * qt + 2 * kvt) * act_bytes, sp)
        sent = layers * per_pass * (forwards + 1)
        return sent, sent / bw["sp/all_to_all"]
    link = bw["sp/send_recv"]
    kv, dkv = 2 * kvt * act_bytes, 2 * kvt * 4
    t_kv, t_dkv, t_blk = kv / link, dkv / link, t_core / sp
    sent = layers * ((sp - 1) * kv * (forwards + 1) + sp * dkv)
    exposed_fwd = (sp - 1) * max(0.0, t_kv - t_blk)
    exposed_bwd = (sp - 1) * max(0.0, t_kv + t_dkv - 2 * t_blk) + t_dkv
    return sent, layers * (exposed_fwd * forwards + exposed_bwd)


def estimate_spec(spec: PlanSpec, detail: bool = True) -> dict:
    f, x, cl = spec.facts, spec.extras, spec.cluster
    dt = dtypes(spec.precision, spec.mixed)
    m = spec.microbatches
    tp, pp, sp, v = spec.tp, spec.pp, spec.sp, spec.v
    b = spec.mbs
    tokens = b * spec.seq / sp  # tokens of one microbatch on one rank (TP ranks share them)
    eff = matmul_efficiency(spec)
    rate = cl.peak_flops * eff

    bw = _bandwidths(cl, spec.order, tp, sp, spec.dp, pp, spec.ep, spec.dp_shard or spec.dp)
    # Megatron-SP moves the all-reduce's bytes as all-gather + reduce-scatter, half each.
    tp_bw = _mixed_bw(bw, "tp", {"all_gather": 1.0, "reduce_scatter": 1.0}) if spec.tp_sp else bw["tp"]
    dp_ops = _dp_volumes(spec, spec.zero_stage == 1 and not dt.autocast_copies and spec.precision != "fp32")

    ranks = _ranks(spec)
    if not detail and pp > 2:
        most = max(ranks, key=lambda r: r.layers)
        ranks = [ranks[0], ranks[-1]] + ([most] if most not in (ranks[0], ranks[-1]) else [])
    acts = _activation_terms(spec, tokens, b, dt)
    layer_flops = {s: _layer_flops_per_rank(spec, s, tokens) for s in acts}

    act_bytes = dt.compute
    ar_size = tokens * f.hidden * act_bytes  # one activation tensor of a microbatch on a rank
    passes_extra = 1.0 / max(1, spec.recompute_every)
    per_rank = []
    for r in ranks:
        dense_layers = r.layers - r.sparse
        # ---- memory
        p, g, o, unsharded = rank_state_elements(spec, r)
        n_if = in_flight(spec.schedule, pp, v, m, r.pp_rank)
        per_chunk = r.layers / len(r.chunks)
        avg_kept = (dense_layers * acts[False][0] + r.sparse * acts.get(True, (0, 0))[0]) / max(1, r.layers)
        saved = n_if * per_chunk * avg_kept
        chunk_mbs = max(1.0, n_if / len(r.chunks))  # microbatches in flight per chunk
        ends = end_activations(spec, r.first, r.last, tokens, spec.seq, b, dt)
        rotary_extra = 0.0
        if f.arch != "gpt2" and len(r.chunks) > 1:
            rotary_extra = (len(r.chunks) - 1) * 2 * spec.seq / sp * f.head_dim * dt.resid
        activations = saved + chunk_mbs * (ends + rotary_extra)
        transient = 0.0
        if spec.recompute == "full":
            transient += max(acts[s][1] for s in acts)
        if r.last:
            transient += tokens * f.vocab / tp * 4  # fp32 gradient of the logits
        if r.layers:
            transient += sp_attention_transient(spec, tokens, dt)  # one layer's ring blocks / all-to-all buffers
        param_bytes_gathered = 4 if spec.precision == "fp32" else 2  # FSDP gathers 16-bit params (MixedPrecisionPolicy)
        if spec.zero_stage == 2:
            transient += (unsharded - p) * param_bytes_gathered
        elif spec.zero_stage == 3:
            key = _spec_key(spec)
            full_key = key[:-1] + (0,)
            root = sum(_group_parts(full_key, kind, 0)[0] for kind, _ in r.kinds(spec) if kind[0] != "layer")
            layer_max = max(_group_parts(full_key, kind, 0)[0] for kind, _ in r.kinds(spec) if kind[0] == "layer") \
                if r.layers else 0
            transient += (root + 2 * layer_max) * param_bytes_gathered * (1 - 1 / spec.shard)
        if spec.fsdp_sync_once:
            transient += (unsharded - p) * dt.grad  # gradients accumulated unsharded until the last microbatch
        states = {"params": p * dt.param, "grads": g * dt.grad, "optimizer": o * dt.optim}
        total = sum(states.values()) + activations + transient
        # ---- compute per microbatch (forward + backward [+ recompute])
        fwd = dense_layers * layer_flops[False][0] + (r.sparse * layer_flops[True][0] if r.sparse else 0.0)
        core = dense_layers * layer_flops[False][1] + (r.sparse * layer_flops[True][1] if r.sparse else 0.0)
        head = head_forward_flops(f, tokens) / tp if r.last else 0.0
        hw = 3 * (fwd + head)
        if spec.recompute == "full":
            hw += fwd * passes_extra
        elif spec.recompute == "selective":
            hw += core * passes_extra
        t_compute = hw / rate
        # ---- TP
        tp_bytes = 0.0
        if tp > 1:
            per_layer = 4 + (2 * passes_extra if spec.recompute == "full" else 0)
            per_moe = 2 + (1 * passes_extra if spec.recompute == "full" else 0)
            n_ar = dense_layers * per_layer + r.sparse * per_moe + (1 if r.first else 0) + (1 if r.last else 0)
            tp_bytes = n_ar * all_reduce_bytes(ar_size, tp)
        t_tp = tp_bytes / tp_bw if tp_bytes else 0.0
        # ---- SP (context parallel)
        sp_bytes = t_sp = 0.0
        if sp > 1:
            sp_bytes, t_sp = _sp_comm(spec, r.layers, tokens, core / max(1, r.layers) / rate, bw, act_bytes)
        # ---- EP
        ep_bytes = t_ep = 0.0
        if spec.ep > 1 and r.sparse:
            per_tok = tokens / (tp if spec.tp_sp else 1) * f.experts_per_token * f.hidden * act_bytes
            rec = passes_extra if spec.recompute == "full" else 0.0
            ep_bytes = r.sparse * (4 + 2 * rec) * all_to_all_bytes(per_tok, spec.ep)
            t_ep = ep_bytes / bw["ep/all_to_all"]
        # ---- PP point-to-point
        pp_bytes = t_pp = 0.0
        if pp > 1:
            sends = sum((0 if c == r.n_chunks - 1 else 1) + (0 if c == 0 else 1) for c in r.chunks)
            pp_bytes = sends * ar_size / tp
            t_pp = pp_bytes / bw["pp/send_recv"]
        # ---- DP / ZeRO traffic
        n_dense = spec.shard
        grad_elems = unsharded
        dp_step_bytes = dp_mb_bytes = 0.0
        dp_link = _mixed_bw(bw, "dp_sp", dp_ops)
        replicas = (spec.dp // (spec.dp_shard or spec.dp))
        if spec.zero_stage <= 1:
            n = spec.dp * sp
            if n > 1:
                if spec.zero_stage == 1 and not dt.autocast_copies and spec.precision != "fp32":
                    dp_step_bytes = all_gather_bytes(grad_elems * dt.grad, n) + all_gather_bytes(grad_elems * dt.param, n_dense)
                else:
                    dp_step_bytes = all_reduce_bytes(grad_elems * dt.grad, n)
                    if spec.zero_stage == 1:
                        dp_step_bytes += all_gather_bytes(grad_elems * dt.param, n_dense)
        else:
            gathered = param_bytes_gathered * grad_elems
            n_ag = 1 if spec.zero_stage == 2 else 2
            dp_mb_bytes = n_ag * all_gather_bytes(gathered, n_dense)
            grad_sync = all_gather_bytes(grad_elems * dt.grad, n_dense)
            if replicas > 1:
                grad_sync += all_reduce_bytes(grad_elems * dt.grad / n_dense, replicas)
            if spec.fsdp_sync_once:
                dp_step_bytes = grad_sync
            else:
                dp_mb_bytes += grad_sync
            dp_link = _mixed_bw(bw, "dp_shard", dp_ops) if replicas == 1 else \
                min(_mixed_bw(bw, "dp_shard", dp_ops), _mixed_bw(bw, "dp_sp", dp_ops))
        t_dp_mb = dp_mb_bytes / dp_link if dp_mb_bytes else 0.0
        t_dp_mb_exposed = max(0.0, t_dp_mb - t_compute) if spec.dp_overlap else t_dp_mb
        t_mb = t_compute + t_tp + t_sp + t_ep + t_pp + t_dp_mb_exposed
        per_rank.append({
            "pp_rank": r.pp_rank, "chunks": r.chunks, "layers": r.layers, "in_flight_microbatches": n_if,
            **states, "activations": activations, "transient": transient, "total": total,
            "hardware_flops_per_microbatch": hw, "t_compute": t_compute, "t_tp": t_tp, "t_sp": t_sp, "t_ep": t_ep,
            "t_pp": t_pp, "t_dp_mb_exposed": t_dp_mb_exposed, "t_mb": t_mb,
            "comm": {"tp": tp_bytes * m, "sp": sp_bytes * m, "ep": ep_bytes * m, "pp": pp_bytes * m,
                     "dp": dp_step_bytes + dp_mb_bytes * m},
            "dp_step_bytes": dp_step_bytes, "dp_link": dp_link,
            "t_bwd_last": (2 * (fwd + head) + (hw - 3 * (fwd + head))) / rate,
            "zero1_gather": all_gather_bytes(grad_elems * dt.param, n_dense) if spec.zero_stage == 1 else 0.0,
        })

    slowest = max(per_rank, key=lambda e: e["t_mb"])
    worst = max(per_rank, key=lambda e: e["total"])
    units = bubble_units(spec.schedule, pp, v)
    t_pipe = (m + units) * slowest["t_mb"]
    # Exposed data-parallel traffic of ZeRO 0/1: the all-reduce (or reduce-scatter) overlaps the
    # last microbatch's backward; ZeRO-1's parameter all-gather follows the optimizer step.
    t_dp_exposed = 0.0
    for e in per_rank:
        if e["dp_step_bytes"]:
            gather = e["zero1_gather"] / e["dp_link"]
            reduce_t = e["dp_step_bytes"] / e["dp_link"] - gather
            hidden = e["t_bwd_last"] if spec.dp_overlap else 0.0
            t_dp_exposed = max(t_dp_exposed, max(0.0, reduce_t - hidden) + gather)
    step = t_pipe + t_dp_exposed
    flops = step_flops(f, x, spec.global_batch, spec.seq, spec.recompute, spec.recompute_every)
    world = spec.world
    mfu = flops["model"] / (step * world * cl.peak_flops) if step > 0 else 0.0
    capacity = cl.device_memory_bytes * USABLE_MEMORY_FRACTION
    fits = worst["total"] <= capacity
    comm = {k: max(e["comm"][k] for e in per_rank) for k in ("tp", "dp", "pp", "ep", "sp")}
    out = {
        "memory_bytes": {k: int(round(worst[k])) for k in ("params", "grads", "optimizer", "activations", "transient", "total")},
        "flops_per_step": flops["model"],
        "hardware_flops_per_step": flops["hardware"],
        "pipeline_bubble_fraction": bubble_fraction(spec.schedule, pp, v, m),
        "pipeline_bubble_overhead": bubble_overhead(spec.schedule, pp, v, m),
        "comm_bytes_per_step": {k: float(vv) for k, vv in comm.items()},
        "step_time_s": step,
        "tokens_per_s": spec.tokens_per_step / step if step > 0 else 0.0,
        "mfu": mfu,
        "fits": fits,
        "time_breakdown_s": {
            "compute": m * slowest["t_compute"],
            "tp": m * slowest["t_tp"], "sp": m * slowest["t_sp"], "ep": m * slowest["t_ep"], "pp": m * slowest["t_pp"],
            "dp_exposed": t_dp_exposed + m * slowest["t_dp_mb_exposed"],
            "bubble": units * slowest["t_mb"],
        },
        "worst_memory_pp_rank": worst["pp_rank"],
        "capacity_bytes": capacity,
    }
    if not detail:
        return out
    out["params_total"] = param_count(f, x)
    out["memory_bytes_per_stage"] = [
        {"pp_rank": e["pp_rank"], "chunks": e["chunks"], "layers": e["layers"], "in_flight_microbatches": e["in_flight_microbatches"],
         **{k: int(round(e[k])) for k in ("params", "grads", "optimizer", "activations", "transient", "total")}}
        for e in per_rank]
    out["device_memory_bytes"] = cl.device_memory_bytes
    out["memory_gib"] = {k: vv / GIB for k, vv in out["memory_bytes"].items()}
    groups = family_groups(spec.order, {"tp": tp, "sp": sp, "dp": spec.dp, "pp": pp}, spec.ep, spec.dp_shard or spec.dp)
    used = {"tp": tp_bw, "sp": bw["sp/all_to_all" if spec.sp_mode == "ulysses" else "sp/send_recv"],
            "dp_sp": _mixed_bw(bw, "dp_sp", dp_ops), "pp": bw["pp/send_recv"], "ep": bw["ep/all_to_all"]}
    out["links"] = {name: f"{link_of(cl, groups[name])}-node {used[name] / GB:g} GB/s" for name in ("tp", "sp", "dp_sp", "pp", "ep")}
    out["bandwidth_source"] = cl.bandwidth_source
    out["assumptions"] = {
        "matmul_efficiency": eff,
        "link_bandwidths_gbps": {link: {op: cl.bw(link, op) / GB for op in COMM_OPS} for link in ("intra", "inter")},
        "mixed_precision": spec.mixed if spec.precision != "fp32" else "fp32",
        "bytes_per_param": {"params": dt.param, "grads": dt.grad, "optimizer": dt.optim},
        "usable_memory_fraction": USABLE_MEMORY_FRACTION,
        "activation_model": "counted saved tensors of the HF modules (memory.py)",
        "units": "memory in bytes (memory_gib: GiB = 2**30 bytes); comm_bytes_per_step: bytes one rank moves per step; "
                 "bandwidths GB/s = 10**9 bytes/s; FLOPs per step (whole cluster)",
    }
    if f.arch == "gpt2":
        out["korthikanti_layer_bytes"] = korthikanti_layer_bytes(spec.seq, b, f.hidden, f.heads, tp, spec.tp_sp, spec.recompute)
        out["counted_layer_bytes"] = acts[False][0] * sp
    out["notes"] = _notes(spec, out, worst, eff)
    return out


def _notes(spec: PlanSpec, est: dict, worst: dict, eff: float) -> List[str]:
    cl = spec.cluster
    notes = [f"memory in bytes and GiB (2**30); worst rank is pipeline rank {worst['pp_rank']} "
             f"({worst['total'] / GIB:.2f} GiB of {cl.device_memory_bytes / GIB:.2f} GiB, "
             f"{USABLE_MEMORY_FRACTION:.0%} usable)"]
    if spec.precision != "fp32":
        d = dtypes(spec.precision, "autocast")
        if spec.mixed == "zero":
            notes.append("16-bit states counted as ZeRO/Megatron do (2+2+12 bytes/param); partrain's runtime today keeps fp32 "
                         "weights under torch.autocast (4+4+8, plus 16-bit weight copies per in-flight microbatch): "
                         "estimate(v, mixed='autocast') counts that")
        else:
            notes.append(f"autocast: fp32 weights and gradients ({d.param}+{d.grad}+{d.optim} bytes/param) and a 16-bit copy of each "
                         "weight saved per in-flight microbatch")
    if spec.sp > 1:
        over = "dp_shard (partrain's ZeRO-1 optimizer shards over dp only)" if spec.zero_stage == 1 else "dp_shard x sp"
        notes.append(f"context parallel ({spec.sp_mode}): weights replicated over sp; model state sharded over {over}; "
                     "activations of seq/sp tokens per rank")
    if spec.ep > 1:
        notes.append("expert parallel: experts split over ep, their states sharded over the remaining dp x sp ranks")
    if cl.measured:
        comm_note = f"communication at the bus bandwidths measured per op in {cl.bandwidth_source.split(':', 1)[1]}"
        if cl.nodes > 1 and not any(key.startswith("inter/") for key, _ in cl.measured):
            comm_note += (f"; inter-node links at the nominal cluster.inter_node_gbps ({cl.inter_bw / GB:g} GB/s): "
                          "the profile has no inter-node measurement (measured on one node)")
    else:
        comm_note = "communication at the cluster's link speeds"
    notes.append(f"compute at {eff:.0%} of peak {cl.peak_flops / 1e12:g} TFLOP/s; {comm_note}")
    if not est["fits"]:
        notes.append(f"does not fit: needs {worst['total'] / GIB:.2f} GiB, usable {est['capacity_bytes'] / GIB:.2f} GiB")
    return notes


def estimate(v, mixed: str = "zero", dp_overlap: bool = True) -> dict:
    """The "estimate" block of the plan report for a validated run (see module docstring)."""
    return estimate_spec(spec_from_validated(v, mixed=mixed, dp_overlap=dp_overlap), detail=True)
