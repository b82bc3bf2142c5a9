"""Bytes one pipeline rank moves in each group family (TP, SP, EP, PP, DP/ZeRO/FSDP) and the time
each takes; the rules are in the docstring of estimate.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict

from partrain.blueprint.planner.comm import (
    all_gather_bytes,
    all_reduce_bytes,
    all_to_all_bytes,
    family_groups,
)
from partrain.blueprint.planner.dp_sync_cost import sync_cost
from partrain.blueprint.planner.memory import sp_kv_width
from partrain.blueprint.planner.moe import all_to_all_layer_bytes, expert_dp, expert_layer_elements, expert_shard
from partrain.blueprint.planner.rank_state import PipelineRank
from partrain.blueprint.planner.spec import PlanSpec
from partrain.blueprint.planner.step_inputs import StepInputs, mixed_bandwidth


@dataclass
class RankTraffic:
    """Bytes one pipeline rank moves in each group family (per microbatch unless said) and the
    time each takes at its link's bandwidth."""

    tp: float = 0.0
    sp: float = 0.0
    ep: float = 0.0
    pp: float = 0.0
    dp_microbatch: float = 0.0
    """FSDP all-gathers (and reduce-scatters unless synced once) of every microbatch."""
    dp_step: float = 0.0
    """Once per step: ZeRO 0/1 gradient all-reduce (or reduce-scatter) and parameter all-gather,
    or FSDP's reduce-scatter with fsdp_grad_sync=last_microbatch."""
    zero1_gather: float = 0.0
    """ZeRO-1's parameter all-gather after the optimizer step (part of dp_step, never hidden)."""
    dp_link: float = 0.0
    t_tp: float = 0.0
    t_sp: float = 0.0
    t_ep: float = 0.0
    t_pp: float = 0.0
    t_dp_microbatch: float = 0.0
    calls: Dict[str, float] = field(default_factory=dict)
    """Collective calls per microbatch by "family/op" (what cpu_host.py charges CPU for)."""
    calls_step: Dict[str, float] = field(default_factory=dict)
    """Collective calls once per step by "family/op"."""

    def call(self, key: str, n: float, per_step: bool = False) -> None:
        book = self.calls_step if per_step else self.calls
        if n:
            book[key] = book.get(key, 0.0) + n

    def per_step(self, m: int) -> Dict[str, float]:
        return {
            "tp": self.tp * m,
            "sp": self.sp * m,
            "ep": self.ep * m,
            "pp": self.pp * m,
            "dp": self.dp_step + self.dp_microbatch * m,
        }


def tp_traffic(spec: PlanSpec, r: PipelineRank, s: StepInputs, out: RankTraffic) -> None:
    if spec.tp == 1:
        return
    full = spec.recompute == "full"
    per_layer = 4 + (2 * s.passes_extra if full else 0)
    per_moe = 2 + (1 * s.passes_extra if full else 0)
    if spec.tp_sp:
        # Megatron-SP's sharded saves: each block re-gathers its input in backward (an all-gather is
        # half an all-reduce's bytes): attention and MLP blocks, the attention block of a MoE layer.
        per_layer += 1.0
        per_moe += 0.5
    n_ar = (r.layers - r.sparse) * per_layer + r.sparse * per_moe + (1 if r.first else 0) + (1 if r.last else 0)
    out.tp = n_ar * all_reduce_bytes(s.ar_size, spec.tp)
    # Calls: an all-reduce each, or under Megatron-SP an all-gather and a reduce-scatter in its place.
    per_call = (s.alpha.get("tp/all_gather", 0.0) + s.alpha.get("tp/reduce_scatter", 0.0)) / 2 if spec.tp_sp else 0.0
    calls = n_ar * (2 if spec.tp_sp else 1)
    alpha = per_call if spec.tp_sp else s.alpha.get("tp/all_reduce", 0.0)
    out.t_tp = (out.tp / s.tp_bw if out.tp else 0.0) + calls * alpha
    for op in ("all_gather", "reduce_scatter") if spec.tp_sp else ("all_reduce",):
        out.call(f"tp/{op}", n_ar)


def sp_traffic(spec: PlanSpec, r: PipelineRank, s: StepInputs, attention_core_flops: float, out: RankTraffic) -> None:
    """Bytes one rank sends and exposed seconds of the sp attention of its layers for one microbatch
    (forward, backward, and the recomputed forward under recompute).

    Tensors per local token and TP rank: qw = heads x head_dim / tp (q, the output) and kvw (each
    of K and V: `memory.sp_kv_width`, the width partrain's sp attention moves them at).
    - ulysses: 4 all-to-alls forward (q, k, v to head shards, the output back), the same 4
      backward (the output's gradient in, the q, k, v gradients back); each moves (sp-1)/sp of
      its tensor; on the critical path (attention needs all of q, k, v).
    - ring: forward, sp-1 steps each pass the K/V pair on (input dtype); backward, the K/V pair
      again at sp-1 steps plus the fp32 dK/dV accumulators at all sp steps. A step's transfer
      overlaps that step's block of attention (t_core / sp forward, twice that backward); only
      what exceeds it shows, and the last dK/dV hop, which nothing overlaps.
    """
    sp, f = spec.sp, spec.facts
    if sp == 1:
        return
    t_core = attention_core_flops / max(1, r.layers) / s.rate
    qt = s.tokens * f.heads * f.head_dim / spec.tp
    kvt = s.tokens * sp_kv_width(spec)
    # Full and selective recompute (the attention core, which runs the sp collectives) repeat the forward.
    forwards = 1.0 + (1.0 / max(1, spec.recompute_every) if spec.recompute != "none" else 0.0)
    if spec.sp_mode == "ulysses":
        per_pass = all_to_all_bytes((2 * qt + 2 * kvt) * s.act_bytes, sp)
        out.sp = r.layers * per_pass * (forwards + 1)
        out.t_sp = out.sp / s.bw["sp/all_to_all"] + r.layers * 4 * (forwards + 1) * s.alpha.get("sp/all_to_all", 0.0)
        out.call("sp/all_to_all", r.layers * 4 * (forwards + 1))
        return
    link = s.bw["sp/send_recv"]
    kv, dkv = 2 * kvt * s.act_bytes, 2 * kvt * 4
    t_kv, t_dkv, t_blk = kv / link, dkv / link, t_core / sp
    out.sp = r.layers * ((sp - 1) * kv * (forwards + 1) + sp * dkv)
    exposed_fwd = (sp - 1) * max(0.0, t_kv - t_blk)
    exposed_bwd = (sp - 1) * max(0.0, t_kv + t_dkv - 2 * t_blk) + t_dkv
    out.t_sp = r.layers * (exposed_fwd * forwards + exposed_bwd)
    out.call("sp/send_recv", r.layers * ((sp - 1) * (forwards + 1) + sp))


def ep_traffic(spec: PlanSpec, r: PipelineRank, s: StepInputs, out: RankTraffic) -> None:
    if spec.ep == 1 or not r.sparse:
        return
    rec = s.passes_extra if spec.recompute == "full" else 0.0
    out.ep = r.sparse * all_to_all_layer_bytes(spec, s.tokens, s.act_bytes, rec)["total"]
    calls = r.sparse * (4 + 2 * rec)  # dispatch and combine, forward and backward (and the recomputed forward)
    out.t_ep = out.ep / s.bw["ep/all_to_all"] + calls * s.alpha.get("ep/all_to_all", 0.0)
    out.call("ep/all_to_all", calls)


def pp_traffic(spec: PlanSpec, r: PipelineRank, s: StepInputs, out: RankTraffic) -> None:
    if spec.pp == 1:
        return
    sends = sum((0 if c == r.n_chunks - 1 else 1) + (0 if c == 0 else 1) for c in r.chunks)
    out.pp = sends * s.ar_size / spec.tp
    out.t_pp = out.pp / s.bw["pp/send_recv"] + sends * s.alpha.get("pp/send_recv", 0.0)
    out.call("pp/send_recv", sends)


def dp_traffic(spec: PlanSpec, r: PipelineRank, grad_elems: int, s: StepInputs, out: RankTraffic) -> None:
    dt = s.dt
    # (elements, ranks that reduce their gradients, ranks that shard them, replicas of a shard):
    # dense tensors over dp x sp; with ep > 1 the local experts over their edp replicas only.
    experts = r.sparse * expert_layer_elements(spec) if spec.ep > 1 else 0
    n_exp, edp = expert_shard(spec), expert_dp(spec)
    replicas = spec.dp // (spec.dp_shard or spec.dp)
    parts = [(grad_elems - experts, spec.dp * spec.sp, spec.shard, replicas), (experts, edp, n_exp, edp // n_exp)]
    out.dp_link = mixed_bandwidth(s.bw, "dp_sp", s.dp_ops)
    if spec.zero_stage <= 1:
        for elems, n, n_shard, _ in parts:
            if n <= 1 or not elems:
                continue
            if spec.zero_stage == 1:
                out.zero1_gather += all_gather_bytes(elems * dt.param, n_shard)
            if spec.zero_stage == 1 and dt.zero1_reduce_scatter and spec.precision != "fp32":
                out.dp_step += all_gather_bytes(elems * dt.grad, n)
            else:
                out.dp_step += all_reduce_bytes(elems * dt.grad, n)
        out.dp_step += out.zero1_gather
    else:
        n_ag = 1 if spec.zero_stage == 2 else 2
        grad_sync = 0.0
        for elems, _, n_shard, reps in parts:
            out.dp_microbatch += n_ag * all_gather_bytes(s.gathered_param_bytes * elems, n_shard)
            grad_sync += all_gather_bytes(elems * dt.grad, n_shard)
            if reps > 1:
                grad_sync += all_reduce_bytes(elems * dt.grad / n_shard, reps)
        if spec.fsdp_sync_once:
            out.dp_step = grad_sync
        else:
            out.dp_microbatch += grad_sync
        shard_link = mixed_bandwidth(s.bw, "dp_shard", s.dp_ops)
        out.dp_link = shard_link if replicas == 1 else min(shard_link, out.dp_link)
    if spec.dp_sync != "allreduce" and spec.zero_stage == 0 and spec.ep == 1:
        strategy_traffic(spec, grad_elems * dt.grad, out)
    dp_calls(spec, r, grad_elems * dt.grad, out)
    out.t_dp_microbatch = out.dp_microbatch / out.dp_link if out.dp_microbatch else 0.0


def dp_calls(spec: PlanSpec, r: PipelineRank, grad_bytes: float, out: RankTraffic) -> None:
    """The data-parallel collective calls of a rank: ZeRO 0/1 reduce its gradients in buckets of
    parallel.dp_bucket_mb once per step (ZeRO-1 also all-gathers the updated parameters); FSDP gathers
    every layer (and the root: embeddings, final norm, head) per microbatch, twice under ZeRO 3, and
    reduce-scatters each layer's gradients per microbatch (once per step with fsdp_grad_sync=last_microbatch)."""
    if spec.dp * spec.sp == 1:
        return
    if spec.zero_stage <= 1:
        buckets = max(1, math.ceil(grad_bytes / (spec.dp_bucket_mb * 2**20)))
        out.call("dp_sp/all_reduce", buckets, per_step=True)
        if spec.zero_stage == 1:
            out.call("dp_shard/all_gather", buckets, per_step=True)
        return
    units = r.layers + 1
    out.call("dp_shard/all_gather", units * (1 if spec.zero_stage == 2 else 2))
    out.call("dp_shard/reduce_scatter", units, per_step=spec.fsdp_sync_once)


def strategy_traffic(spec: PlanSpec, grad_bytes: float, out: RankTraffic) -> None:
    """parallel.dp_sync other than allreduce: the busiest rank's bytes, and the link rate that makes
    them take the strategy's alpha-beta time (dp_sync_cost)."""
    degrees = {"tp": spec.tp, "sp": spec.sp, "dp": spec.dp, "pp": spec.pp}
    members = family_groups(spec.order, degrees, spec.ep, spec.dp_shard or spec.dp)["dp_sp"]
    buckets = max(1, math.ceil(grad_bytes / (spec.dp_bucket_mb * 2**20)))
    cost = sync_cost(spec.dp_sync, spec.cluster, members, grad_bytes, buckets, spec.ps_servers)
    if cost.busiest_bytes and cost.seconds:
        out.dp_step, out.dp_link = cost.busiest_bytes, cost.busiest_bytes / cost.seconds
