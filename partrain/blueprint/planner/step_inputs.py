"""What every pipeline rank's estimate shares: dtypes, tokens, achieved FLOP/s, the bandwidth of
each group family (nominal or measured per op), and per-layer FLOPs and saved activations."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Tuple

from partrain.blueprint.families import family
from partrain.blueprint.planner.comm import COMM_OPS, bandwidth, family_groups, link_of
from partrain.blueprint.planner.compute_model import ComputeModel, compute_model
from partrain.blueprint.planner.compute_time import matmul_rate
from partrain.blueprint.planner.flops import attention_proj_macs, layer_forward_flops, mlp_macs
from partrain.blueprint.planner.memory import (
    LayerActivations,
    dtypes,
    layer_activations,
)
from partrain.blueprint.planner.params import layer_is_sparse, param_count
from partrain.blueprint.planner.spec import PlanSpec


def matmul_efficiency(spec: PlanSpec) -> float:
    """Achieved fraction of peak FLOP/s for the model's matmuls (see module docstring)."""
    if spec.cluster.device != "cuda":
        return 0.5
    h = spec.facts.hidden
    return 0.70 * h / (h + 900)


def float8_linear_macs(spec: PlanSpec, sparse: bool) -> int:
    """Multiply-accumulates per token (= weights) of one layer's linears that train.float8 converts:
    attention's projections and a dense MLP, or in an MoE layer its shared expert only (the routed
    experts' fused tensors and the router stay bf16: partrain.parallel.float8)."""
    f = spec.facts
    if not sparse:
        return attention_proj_macs(f) + mlp_macs(f, spec.extras, False)
    shared = 3 * f.hidden * f.shared_expert_ffn if family(f.arch).shared_expert and f.shared_expert_ffn else 0
    return attention_proj_macs(f) + shared


def _float8_flops_per_rank(spec: PlanSpec, sparse: bool, tokens: float) -> float:
    """Forward FLOPs of one layer's float8 linears on one rank (attention split over TP; a shared expert
    is replicated over TP, as the MoE block: _layer_flops_per_rank)."""
    attention = attention_proj_macs(spec.facts)
    mlp = float8_linear_macs(spec, sparse) - attention
    return 2.0 * tokens * (attention / spec.tp + mlp / (1 if sparse else spec.tp))


def float8_gathered_share(spec: PlanSpec) -> float:
    """The share of the parameters FSDP all-gathers in float8 (1 byte, not 2) under train.float8 with the
    tensorwise recipe at zero 2/3: the converted linears' weights over all parameters. Not under tp > 1
    (torchao's float8 all-gather wraps a plain weight, not a TP shard) nor LoRA (its projections cast the
    frozen base themselves): partrain.parallel.float8."""
    if spec.float8 != "tensorwise" or spec.zero_stage < 2 or spec.tp > 1 or spec.lora_r:
        return 0.0
    f, x = spec.facts, spec.extras
    linear = sum(float8_linear_macs(spec, layer_is_sparse(f, x, i)) for i in range(f.n_layers))
    return linear / param_count(f, x)


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
def group_bandwidths(cl, order, tp: int, sp: int, dp: int, pp: int, ep: int, dp_shard: int) -> Dict[str, float]:
    """Bytes/s of each group family: "tp" (its all-reduce) and "tp/<op>" for every op (these differ
    only with a measured comm profile)."""
    groups = family_groups(order, {"tp": tp, "sp": sp, "dp": dp, "pp": pp}, ep, dp_shard)
    out = {name: bandwidth(cl, members) for name, members in groups.items()}
    out.update({f"{name}/{op}": bandwidth(cl, members, op) for name, members in groups.items() for op in COMM_OPS})
    return out


@functools.lru_cache(maxsize=4096)
def group_latencies(cl, order, tp: int, sp: int, dp: int, pp: int, ep: int, dp_shard: int) -> Dict[str, float]:
    """Seconds of fixed cost per call, "tp/<op>" etc. for every family and op (0 without a comm profile):
    the profile's cost per ring step times the group's n - 1 steps (one for a send/recv)."""
    if not cl.latencies:
        return {}
    groups = family_groups(order, {"tp": tp, "sp": sp, "dp": dp, "pp": pp}, ep, dp_shard)
    return {
        f"{name}/{op}": cl.alpha(link_of(cl, members), op) * (1 if op == "send_recv" else max(1, len(members) - 1))
        for name, members in groups.items()
        for op in COMM_OPS
    }


def mixed_bandwidth(bw: Dict[str, float], family: str, volumes: Dict[str, float]) -> float:
    """Bandwidth of traffic split over ops in these volume proportions: total / sum(volume / bw)."""
    rates = {op: bw[f"{family}/{op}"] for op in volumes}
    if len(set(rates.values())) == 1:  # nominal speeds: one bandwidth for every op
        return next(iter(rates.values()))
    return sum(volumes.values()) / sum(vol / rates[op] for op, vol in volumes.items())


def dp_volumes(spec: PlanSpec, reduce_scatter: bool) -> Dict[str, float]:
    """Rough volume shares of the data-parallel collectives (ring volumes, per parameter)."""
    if spec.zero_stage == 0:
        return {"all_reduce": 1.0}
    if spec.zero_stage == 1:
        return {"reduce_scatter": 1.0, "all_gather": 1.0} if reduce_scatter else {"all_reduce": 2.0, "all_gather": 1.0}
    return {"all_gather": 1.0 if spec.zero_stage == 2 else 2.0, "reduce_scatter": 1.0}


@dataclass
class StepInputs:
    """What every pipeline rank's estimate shares: dtypes, sizes and rates of one microbatch."""

    dt: Any
    tokens: float
    """Tokens of one microbatch on one rank (TP ranks share them; SP ranks split them)."""
    rate: float
    """Achieved FLOP/s of one device."""
    bw: Dict[str, float]
    alpha: Dict[str, float]
    """Seconds of fixed cost per call by "family/op" (empty: none known, 0)."""
    tp_bw: float
    dp_ops: Dict[str, float]
    acts: Dict[bool, Tuple[float, float]]
    layer_flops: Dict[bool, Tuple[float, float]]
    act_bytes: int
    ar_size: float
    """Bytes of one activation tensor of a microbatch on a rank."""
    passes_extra: float
    """Share of layers re-run in backward (recompute every k-th layer)."""
    gathered_param_bytes: float
    """Bytes per element of the parameters FSDP all-gathers (16-bit under MixedPrecisionPolicy; the mean
    over the model with float8 all-gathers, float8_gathered_share)."""
    compute: Optional[ComputeModel] = None
    """The fitted compute model of `cluster.compute_profile` (None: FLOPs / rate)."""
    float8_flops: Dict[bool, float] = field(default_factory=dict)
    """train.float8: forward FLOPs of one dense / sparse layer's converted linears on a rank (empty: off)."""


def step_inputs(spec: PlanSpec) -> StepInputs:
    f, dt = spec.facts, dtypes(spec.precision, spec.style)
    tokens = spec.mbs * spec.seq / spec.sp
    bw = group_bandwidths(
        spec.cluster, spec.order, spec.tp, spec.sp, spec.dp, spec.pp, spec.ep, spec.dp_shard or spec.dp
    )
    # Megatron-SP moves the all-reduce's bytes as all-gather + reduce-scatter, half each.
    tp_bw = mixed_bandwidth(bw, "tp", {"all_gather": 1.0, "reduce_scatter": 1.0}) if spec.tp_sp else bw["tp"]
    acts = _activation_terms(spec, tokens, spec.mbs, dt)
    # With a compute profile, compute is timed per matmul shape (compute_model.py); "rate" is then
    # the measured rate at the MLP projection's shape (ring attention's overlap estimate uses it).
    model = compute_model(spec.cluster.compute_profile) if spec.cluster.compute_profile else None
    return StepInputs(
        dt=dt,
        tokens=tokens,
        rate=matmul_rate(model, spec, tokens) if model else spec.cluster.peak_flops * matmul_efficiency(spec),
        bw=bw,
        alpha=group_latencies(
            spec.cluster, spec.order, spec.tp, spec.sp, spec.dp, spec.pp, spec.ep, spec.dp_shard or spec.dp
        ),
        tp_bw=tp_bw,
        dp_ops=dp_volumes(spec, spec.zero_stage == 1 and dt.zero1_reduce_scatter and spec.precision != "fp32"),
        acts=acts,
        layer_flops={s: _layer_flops_per_rank(spec, s, tokens) for s in acts},
        act_bytes=dt.compute,
        ar_size=tokens * f.hidden * dt.compute,
        passes_extra=1.0 / max(1, spec.recompute_every),
        gathered_param_bytes=4 if spec.precision == "fp32" else 2 - float8_gathered_share(spec),
        compute=model,
        float8_flops={s: _float8_flops_per_rank(spec, s, tokens) for s in acts} if spec.float8 else {},
    )
