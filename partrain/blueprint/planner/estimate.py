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
- SP (context parallel, `rank_traffic.sp_traffic`): Ulysses all-to-all of q, k, v and the attention
  output, forward and backward, not overlapped; ring passes K and V around the ring (backward also
  their fp32 gradients), each step's transfer hidden behind that step's attention block where the
  block is long enough. K/V at the width partrain's sp attention moves them (memory.sp_kv_width).
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
- With `cluster.compute_profile` (a `partrain bench compute` profile) compute is timed per matmul
  shape, attention, elementwise bytes and host overhead instead, plus the optimizer update
  (compute_model.py); "compute_source" in the report says which.
- On a CPU node whose ranks outnumber the profile's cores, the step is at least the ranks' CPU work
  over the cores (cpu_host.py: kernels, per-tensor optimizer and clip, TP wrappers, every collective
  call's measured CPU); what that adds to the critical path is "cpu_shared" in the breakdown. The CPU
  host model is consulted on CPU clusters only.
- Links: TP at intra-node bandwidth when the group is inside a node; every group at the slowest
  link it spans (see comm.py). The optimizer update itself is not timed (without a compute profile).
- Bandwidths: the cluster's nominal link speeds, or with `cluster.comm_profile` the bus bandwidth
  `partrain bench comm` measured for each op on that link class: TP all-reduce (Megatron-SP:
  all-gather + reduce-scatter), Ulysses and EP all-to-all, ring attention and PP send/recv, DP
  all-reduce / all-gather / reduce-scatter by ZeRO stage (one bandwidth per step, weighted by the
  collectives' rough volume shares). "bandwidth_source" in the report says which. A comm profile also
  gives a fixed cost per call (alpha: its smallest message's time beyond its bytes, per ring step,
  times the group's n - 1 steps) charged to every TP collective, Ulysses and EP all-to-all and
  pipeline send of a microbatch; DP's few large bucket calls are timed by bandwidth alone.

Reported communication (`comm_bytes_per_step`) is the volume one rank moves per step in each group
family (ring volumes, see comm.py), for the busiest pipeline rank; "dp" includes ZeRO/FSDP traffic.

Memory of a rank = model states at rest (params, grads, optimizer: memory.py) + saved activations
of the microbatches in flight (bubble.py) + transients: the all-gathered parameters FSDP holds
(ZeRO 2: the rank's whole unsharded model from forward to backward; ZeRO 3: the root - embeddings,
final norm, head - plus two layers), and the larger of the forward's peak (logits and their fp32
copy on the last stage; under full recompute, autocast's cached weight copies) and the backward's
(the fp32 loss gradients, or one layer's full activations while it is recomputed): peaks.py.
On a CPU device (runtime accounting) each rank also counts "process": the resident memory of the
worker beyond its tensors, interpreter, libraries, their code and the heap glibc keeps (cpu_host.py).
It fits when the total is at most USABLE_MEMORY_FRACTION of the device memory (the rest: CUDA
context, allocator fragmentation, communication buffers).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Dict, List, Tuple

from partrain.blueprint.compute_profile import profile_key
from partrain.blueprint.families import family
from partrain.blueprint.planner.bubble import (
    bubble_fraction,
    bubble_overhead,
    bubble_units,
    in_flight,
)
from partrain.blueprint.planner.comm import (
    COMM_OPS,
    family_groups,
    link_of,
)
from partrain.blueprint.planner.compute_model import compute_assumptions
from partrain.blueprint.planner.compute_time import optimizer_time, rank_microbatch_time
from partrain.blueprint.planner.cpu_host import (
    process_bytes,
    process_note,
    rank_own_cpu_seconds,
    rank_step_factor,
    shared_core_step,
    shared_cores_note,
)
from partrain.blueprint.planner.flops import head_forward_flops, step_flops
from partrain.blueprint.planner.memory import (
    end_activations,
    korthikanti_layer_bytes,
    sp_attention_transient,
)
from partrain.blueprint.planner.moe_report import moe_report
from partrain.blueprint.planner.notes import estimate_notes
from partrain.blueprint.planner.params import param_count
from partrain.blueprint.planner.peaks import phase_transient, pipeline_copies_correction
from partrain.blueprint.planner.rank_state import (
    PipelineRank,
    group_parts,
    pipeline_ranks,
    rank_state_elements,
    spec_key,
)
from partrain.blueprint.planner.rank_traffic import (
    RankTraffic,
    dp_traffic,
    ep_traffic,
    pp_traffic,
    sp_traffic,
    tp_traffic,
)
from partrain.blueprint.planner.spec import GB, GIB, PlanSpec, spec_from_validated
from partrain.blueprint.planner.step_inputs import (
    StepInputs,
    matmul_efficiency,
    mixed_bandwidth,
    step_inputs,
)

USABLE_MEMORY_FRACTION = 0.95
"""Share of device memory the estimate may fill and still call the layout fitting."""


MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "transient", "process", "total")


@dataclass
class RankMemory:
    """Bytes one pipeline rank holds at its peak: model states, saved activations, transients."""

    params: float
    grads: float
    optimizer: float
    activations: float
    transient: float
    unsharded_param_elements: int
    """Elements of this rank's parameters before FSDP sharding (what FSDP gathers and syncs)."""
    process: float = 0.0
    """What the process holds beyond tensors on a CPU device (cpu_host.py); 0 on GPUs."""

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.transient + self.process

    def rounded(self) -> Dict[str, int]:
        return {k: int(round(getattr(self, k))) for k in MEMORY_KEYS}


def _fsdp_gathered(spec: PlanSpec, r: PipelineRank, p: int, unsharded: int, gathered_bytes: int) -> float:
    """Bytes of parameters FSDP holds all-gathered (ZeRO 2: the whole rank's model from forward to
    backward; ZeRO 3: the root modules plus two layers)."""
    if spec.zero_stage == 2:
        return (unsharded - p) * gathered_bytes
    if spec.zero_stage != 3:
        return 0.0
    full_key = spec_key(spec)[:-1] + (0,)
    kinds = r.kinds(spec)
    root = sum(group_parts(full_key, kind, 0)[0] for kind, _ in kinds if kind[0] != "layer")
    layer_max = max((group_parts(full_key, kind, 0)[0] for kind, _ in kinds if kind[0] == "layer"), default=0)
    return (root + 2 * layer_max) * gathered_bytes * (1 - 1 / spec.shard)


def _rank_memory(spec: PlanSpec, r: PipelineRank, n_if: int, s: StepInputs) -> RankMemory:
    f, dt = spec.facts, s.dt
    p, g, o, unsharded = rank_state_elements(spec, r)
    per_chunk = r.layers / len(r.chunks)
    avg_kept = ((r.layers - r.sparse) * s.acts[False][0] + r.sparse * s.acts.get(True, (0, 0))[0]) / max(1, r.layers)
    saved = n_if * per_chunk * avg_kept + pipeline_copies_correction(spec, r, s, n_if)
    chunk_mbs = max(1.0, n_if / len(r.chunks))  # microbatches in flight per chunk
    ends = end_activations(spec, r.first, r.last, s.tokens, spec.seq, spec.mbs, dt)
    rotary_extra = 0.0
    if family(f.arch).block != "gpt2" and len(r.chunks) > 1:  # rotary cos/sin on every chunk
        rotary_extra = (len(r.chunks) - 1) * 2 * spec.seq / spec.sp * f.head_dim * dt.resid
    transient = phase_transient(spec, r, s)  # the forward's or the backward's peak (peaks.py)
    if r.layers:
        transient += sp_attention_transient(spec, s.tokens, dt)  # one layer's ring blocks / all-to-all buffers
    transient += _fsdp_gathered(spec, r, p, unsharded, s.gathered_param_bytes)
    if spec.fsdp_sync_once:  # gradients accumulated unsharded until the last microbatch (LoRA: the adapters')
        transient += ((unsharded - p) if not spec.lora_r else g * (spec.shard - 1)) * dt.grad
    activations = saved + chunk_mbs * (ends + rotary_extra)
    transient += _grad_sync_buffer(spec, g * dt.grad, activations + transient)
    cpu_runtime = spec.cluster.device == "cpu" and spec.mixed != "zero"
    process = process_bytes(spec, activations + transient) if cpu_runtime else 0.0
    return RankMemory(
        params=p * dt.param * (2 if spec.reference_copy else 1),  # dpo's frozen copy: the parameters again
        grads=g * dt.grad,
        optimizer=o * dt.optim,
        activations=activations,
        transient=transient,
        unsharded_param_elements=unsharded,
        process=process,
    )


def _grad_sync_buffer(spec: PlanSpec, grad_bytes: float, backward_extra: float) -> float:
    """Bytes the data-parallel gradient reduction of ZeRO 0/1 adds (partrain.parallel.data_parallel).

    DDP (no TP DTensors, no pipeline, no expert DTensors) keeps bucket buffers as large as the
    gradients for the whole run (gradient_as_bucket_view is off). Otherwise the gradients are
    all-reduced in one flat copy after the backward, when the activations are already freed: it
    raises the peak only where it is larger than what the backward held above the states."""
    # The paper's accounting has none; 16-bit parameters reduce their fp32 gradient buffer in place.
    if spec.zero_stage >= 2 or spec.dp * spec.sp == 1 or spec.style != "autocast":
        return 0.0
    if spec.tp == 1 and spec.pp == 1 and spec.ep == 1:
        return grad_bytes
    return max(0.0, grad_bytes - backward_extra)


FLOAT8_PEAK_RATIO = 2.0
"""Dense float8 over dense bf16 tensor-core peak on sm89+ GPUs (H100/H200 SXM: 1979 vs 989 TFLOP/s),
applied to cluster.peak_tflops (the bf16 peak) for train.float8's converted matmuls on CUDA."""


@dataclass
class RankCompute:
    """FLOPs of one microbatch's forward + backward (+ recompute) on one pipeline rank."""

    forward: float
    """Forward FLOPs of the rank's layers and (last stage) head."""
    attention_core: float
    """Forward FLOPs of the attention core (what ring attention hides its sends behind)."""
    hardware: float
    """All FLOPs executed: 3 passes plus the recomputed forward."""
    rate: float
    t_optimizer: float = 0.0
    """Seconds of the optimizer update per step (timed only with a compute profile)."""

    @property
    def t_compute(self) -> float:
        return self.hardware / self.rate

    @property
    def t_backward(self) -> float:
        """Time of one microbatch's backward (and recompute): what DP traffic can hide behind."""
        return (self.hardware - self.forward) / self.rate


def _rank_compute(spec: PlanSpec, r: PipelineRank, s: StepInputs) -> RankCompute:
    dense = r.layers - r.sparse
    layers = dense * s.layer_flops[False][0] + (r.sparse * s.layer_flops[True][0] if r.sparse else 0.0)
    core = dense * s.layer_flops[False][1] + (r.sparse * s.layer_flops[True][1] if r.sparse else 0.0)
    head = head_forward_flops(spec.facts, s.tokens) / spec.tp if r.last else 0.0
    hw = 3 * (layers + head)
    if r.last and spec.loss_chunked(s.tokens):
        hw += head  # the chunked loss recomputes each chunk's logits in backward
    if spec.recompute == "full":
        hw += layers * s.passes_extra
    elif spec.recompute == "selective":
        hw += core * s.passes_extra
    if spec.reference_forward:  # dpo's reference (adapters off, or the frozen copy): one forward, no backward
        hw += layers + head
    if s.compute is not None:  # timed per matmul shape from cluster.compute_profile (compute_model.py)
        t = rank_microbatch_time(s.compute, spec, dense, r.sparse, r.first, r.last, s.tokens)
        return RankCompute(forward=layers + head, attention_core=core, hardware=hw, rate=hw / t if t > 0 else s.rate)
    if spec.float8 and spec.cluster.device == "cuda" and hw > 0:
        # The converted linears (attention's projections, dense MLPs, shared experts; not routed experts
        # nor routers) run at the float8 peak, in all three passes and a full recompute: one rate for the
        # mix, so every caller's t = FLOPs / rate holds.
        # A CPU has no float8 units (torch emulates the scaled matmul): its rate is left as it is.
        linear = dense * s.float8_flops[False] + r.sparse * s.float8_flops.get(True, 0.0)
        linear *= 3 + (s.passes_extra if spec.recompute == "full" else 0.0)
        t = (hw - linear) / s.rate + linear / (FLOAT8_PEAK_RATIO * s.rate)
        return RankCompute(forward=layers + head, attention_core=core, hardware=hw, rate=hw / t)
    return RankCompute(forward=layers + head, attention_core=core, hardware=hw, rate=s.rate)


@dataclass
class RankEstimate:
    """Memory, compute and traffic of one pipeline rank (the busiest replica of its stage)."""

    rank: PipelineRank
    in_flight: int
    """Microbatches whose activations the schedule holds at once on this rank."""
    memory: RankMemory
    compute: RankCompute
    traffic: RankTraffic
    t_dp_exposed_per_microbatch: float

    @property
    def t_microbatch(self) -> float:
        t = self.traffic
        return self.compute.t_compute + t.t_tp + t.t_sp + t.t_ep + t.t_pp + self.t_dp_exposed_per_microbatch

    def t_dp_exposed_per_step(self, overlap: bool) -> float:
        """ZeRO 0/1: the gradient reduction overlaps the last microbatch's backward; ZeRO-1's
        parameter all-gather follows the optimizer step."""
        t = self.traffic
        if not t.dp_step:
            return 0.0
        gather = t.zero1_gather / t.dp_link
        reduce_t = t.dp_step / t.dp_link - gather
        hidden = self.compute.t_backward if overlap else 0.0
        return max(0.0, reduce_t - hidden) + gather


def _rank_estimate(spec: PlanSpec, r: PipelineRank, s: StepInputs) -> RankEstimate:
    n_if = in_flight(spec.schedule, spec.pp, spec.v, spec.microbatches, r.pp_rank)
    memory = _rank_memory(spec, r, n_if, s)
    compute = _rank_compute(spec, r, s)
    if s.compute is not None:
        compute.t_optimizer = optimizer_time(s.compute, spec, rank_state_elements(spec, r)[2])
    traffic = RankTraffic()
    tp_traffic(spec, r, s, traffic)
    sp_traffic(spec, r, s, compute.attention_core, traffic)
    ep_traffic(spec, r, s, traffic)
    pp_traffic(spec, r, s, traffic)
    dp_traffic(spec, r, memory.unsharded_param_elements, s, traffic)
    t_dp = traffic.t_dp_microbatch
    exposed = max(0.0, t_dp - compute.t_compute) if spec.dp_overlap else t_dp
    return RankEstimate(r, n_if, memory, compute, traffic, exposed)


def _estimated_ranks(spec: PlanSpec, s: StepInputs, detail: bool) -> List[RankEstimate]:
    ranks = pipeline_ranks(spec)
    # The search's cheap form: the ends and the rank with the most layers decide. A subset only lowers
    # the maxima, so it is a lower bound of the full estimate (search.py relies on it); not on CPU,
    # where the shared-core term averages the ranks.
    if not detail and spec.pp > 2 and spec.cluster.device != "cpu":
        most = max(ranks, key=lambda r: r.layers)
        ranks = [ranks[0], ranks[-1]] + ([most] if most not in (ranks[0], ranks[-1]) else [])
    return [_rank_estimate(spec, r, s) for r in ranks]


def own_cpu_by_pp_rank(spec: PlanSpec) -> Dict[int, float]:
    """Per pipeline rank, the CPU seconds of a step besides collectives as the planner counts them from
    the compute profile's pieces (cpu_host.rank_own_cpu_seconds); {} without a compute profile."""
    s = step_inputs(spec)
    if s.compute is None:
        return {}
    return {e.rank.pp_rank: rank_own_cpu_seconds(spec, s.compute, e) for e in _estimated_ranks(spec, s, True)}


@functools.lru_cache(maxsize=64)
def _own_cpu_counted(spec: PlanSpec, _profile: Tuple[str, int, int]) -> Dict[int, float]:
    """own_cpu_by_pp_rank, cached per profile version (the search asks for the profiled layout's count
    once per candidate)."""
    return own_cpu_by_pp_rank(spec)


def _cpu_shared(spec: PlanSpec, s: StepInputs, per_rank: List[RankEstimate], step: float) -> Tuple[float, float]:
    """(what the shared-core bound adds to the step, the rank steps' factor) on a CPU cluster with a
    compute profile; (0, 1) elsewhere: the CPU host model is not consulted."""
    if spec.cluster.device != "cpu" or s.compute is None:
        return 0.0, 1.0
    key = profile_key(spec.cluster.compute_profile)
    factor = rank_step_factor(spec, lambda profiled: _own_cpu_counted(profiled, key))
    return max(0.0, shared_core_step(spec, s.compute, per_rank, factor) - step), factor


def estimate_spec(spec: PlanSpec, detail: bool = True) -> dict:
    """The JSON-able estimate of one layout (see the module docstring); `detail=False` is the
    search's cheap form (fewer ranks, no per-stage table, links or assumptions)."""
    s = step_inputs(spec)
    per_rank = _estimated_ranks(spec, s, detail)
    m = spec.microbatches
    slowest = max(per_rank, key=lambda e: e.t_microbatch)
    worst = max(per_rank, key=lambda e: e.memory.total)
    units = bubble_units(spec.schedule, spec.pp, spec.v)
    t_dp_exposed = max(e.t_dp_exposed_per_step(spec.dp_overlap) for e in per_rank)
    t_optimizer = max(e.compute.t_optimizer for e in per_rank)
    step = (m + units) * slowest.t_microbatch + t_dp_exposed + t_optimizer
    cpu_shared, factor = _cpu_shared(spec, s, per_rank, step)
    shared = {"cpu_shared": cpu_shared}
    step += cpu_shared
    flops = step_flops(spec.facts, spec.extras, spec.global_batch, spec.seq, spec.recompute, spec.recompute_every)
    capacity = spec.cluster.device_memory_bytes * USABLE_MEMORY_FRACTION
    per_step = [e.traffic.per_step(m) for e in per_rank]
    out = {
        "memory_bytes": worst.memory.rounded(),
        "flops_per_step": flops["model"],
        "hardware_flops_per_step": flops["hardware"],
        "pipeline_bubble_fraction": bubble_fraction(spec.schedule, spec.pp, spec.v, m),
        "pipeline_bubble_overhead": bubble_overhead(spec.schedule, spec.pp, spec.v, m),
        "comm_bytes_per_step": {k: float(max(c[k] for c in per_step)) for k in ("tp", "dp", "pp", "ep", "sp")},
        "step_time_s": step,
        "tokens_per_s": spec.tokens_per_step / step if step > 0 else 0.0,
        "mfu": flops["model"] / (step * spec.world * spec.cluster.peak_flops) if step > 0 else 0.0,
        "fits": worst.memory.total <= capacity,
        "time_breakdown_s": {**_time_breakdown(slowest, m, units, t_dp_exposed), "optimizer": t_optimizer, **shared},
        "worst_memory_pp_rank": worst.rank.pp_rank,
        "capacity_bytes": capacity,
    }
    if detail:
        out.update(_detail(spec, s, per_rank, out, worst))
        out["note_data"] = [n.as_dict() for n in _notes(spec, s, out, worst, factor)]
    return out


def _time_breakdown(slowest: RankEstimate, m: int, units: float, t_dp_exposed: float) -> Dict[str, float]:
    t = slowest.traffic
    return {
        "compute": m * slowest.compute.t_compute,
        "tp": m * t.t_tp,
        "sp": m * t.t_sp,
        "ep": m * t.t_ep,
        "pp": m * t.t_pp,
        "dp_exposed": t_dp_exposed + m * slowest.t_dp_exposed_per_microbatch,
        "bubble": units * slowest.t_microbatch,
    }


def _detail(spec: PlanSpec, s: StepInputs, per_rank: List[RankEstimate], out: dict, worst: RankEstimate) -> dict:
    f, cl = spec.facts, spec.cluster
    eff = matmul_efficiency(spec)
    groups = family_groups(
        spec.order, {"tp": spec.tp, "sp": spec.sp, "dp": spec.dp, "pp": spec.pp}, spec.ep, spec.dp_shard or spec.dp
    )
    used = {
        "tp": s.tp_bw,
        "sp": s.bw["sp/all_to_all" if spec.sp_mode == "ulysses" else "sp/send_recv"],
        "dp_sp": mixed_bandwidth(s.bw, "dp_sp", s.dp_ops),
        "pp": s.bw["pp/send_recv"],
        "ep": s.bw["ep/all_to_all"],
    }
    detail = {
        "params_total": param_count(f, spec.extras),
        "memory_bytes_per_stage": [
            {
                "pp_rank": e.rank.pp_rank,
                "chunks": e.rank.chunks,
                "layers": e.rank.layers,
                "in_flight_microbatches": e.in_flight,
                **e.memory.rounded(),
            }
            for e in per_rank
        ],
        "device_memory_bytes": cl.device_memory_bytes,
        "memory_gib": {k: vv / GIB for k, vv in out["memory_bytes"].items()},
        "links": {name: f"{link_of(cl, groups[name])}-node {used[name] / GB:g} GB/s" for name in used},
        "bandwidth_source": cl.bandwidth_source,
        "compute_source": cl.compute_source,
        "assumptions": {
            "matmul_efficiency": eff if s.compute is None else s.rate / cl.peak_flops,
            **({"compute_model": compute_assumptions(s.compute)} if s.compute is not None else {}),
            "link_bandwidths_gbps": {
                link: {op: cl.bw(link, op) / GB for op in COMM_OPS} for link in ("intra", "inter")
            },
            "mixed_precision": spec.style if spec.precision != "fp32" else "fp32",
            "accounting": "paper" if spec.mixed == "zero" else "runtime",
            "bytes_per_param": {"params": s.dt.param, "grads": s.dt.grad, "optimizer": s.dt.optim},
            "usable_memory_fraction": USABLE_MEMORY_FRACTION,
            "activation_model": "counted saved tensors of the HF modules (memory.py)",
            "units": "memory in bytes (memory_gib: GiB = 2**30 bytes); comm_bytes_per_step: bytes one rank moves per "
            "step; bandwidths GB/s = 10**9 bytes/s; FLOPs per step (whole cluster)",
        },
    }
    if family(f.arch).block == "gpt2":  # the paper's formula describes GPT blocks only
        detail["korthikanti_layer_bytes"] = korthikanti_layer_bytes(
            spec.seq, spec.mbs, f.hidden, f.heads, spec.tp, spec.tp_sp, spec.recompute
        )
        detail["counted_layer_bytes"] = s.acts[False][0] * spec.sp
    if f.is_moe:
        rec = s.passes_extra if spec.recompute == "full" else 0.0
        detail["moe"] = moe_report(spec, s.tokens, s.act_bytes, rec, max(e.rank.sparse for e in per_rank), s.dt)
    return detail


def _notes(spec: PlanSpec, s: StepInputs, est: dict, worst: RankEstimate, factor: float) -> list:
    """The estimate's notes (notes.py), with the CPU host model's on a CPU cluster: the process term
    second, the shared-core bound after where compute comes from."""
    notes = estimate_notes(spec, est, worst.memory.total, worst.rank.pp_rank, matmul_efficiency(spec))
    if worst.memory.process:
        notes.insert(1, process_note(spec, worst.memory.process))
    if spec.cluster.device == "cpu" and s.compute is not None:
        shared = shared_cores_note(spec, s.compute, factor, est["time_breakdown_s"]["cpu_shared"])
        at = next(i for i, n in enumerate(notes) if n.code == "compute_profile") + 1
        notes[at:at] = [shared] if shared else []
    return notes


def estimate(v, mixed: str = "autocast", dp_overlap: bool = True) -> dict:
    """The "estimate" block of the plan report for a validated run (see module docstring)."""
    return estimate_spec(spec_from_validated(v, mixed=mixed, dp_overlap=dp_overlap), detail=True)
