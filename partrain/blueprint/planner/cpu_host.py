"""The CPU host model: what a rank's process costs a CPU node besides its tensors' kernels.

Frozen on purpose: it only matters when training runs on CPU processes (`cluster.device == "cpu"`),
where the cores that compute also run everything around the kernels. `estimate.py` is its only caller
and skips it on accelerators; no new accuracy work goes here. Its figures come from a CPU compute
profile (`partrain bench compute`: the "host" and "process" blocks, partrain/bench/cpu/) and the comm
profile's CPU per call ("cpu_s" rows); profiles hold measurements only, and whatever the planner derives
from them (the rank steps' factor below) it derives here, at plan time, with the formula of this version.

Two terms:

1. "process" memory. On a GPU the interpreter, torch and transformers live in host memory; on a CPU the
   process is on the device. A rank's resident memory also holds the runtime before the model's first
   tensor (about 350 MiB whatever the model), the library code its steps page in (about 16 MiB), and the
   heap glibc keeps after freeing activation-sized buffers: HEAP_FIXED_BYTES + HEAP_PER_TRANSIENT_BYTE x
   (activations + transients), a rule fitted to the peak RSS of 7 pipeline stages of the CPU recipes
   gpt-dp, gpt-3d, llama-fsdp-tp, mixtral-ep, llama-long-sp and llama-long-ring (0.99-1.04 of the plan;
   three layouts outside the fit 0.89-1.03). The profile's "process" block measures the first two; without
   it the nominal figures below (torch 2.13 CPU, transformers 5, the 2-core reference machine) stand in.

2. The shared-core bound on the step. When a node's ranks outnumber its cores, the step cannot be shorter
   than all their CPU work divided by the cores:

       step >= sum over the node's ranks of cpu(rank) / cores
       cpu(rank) = factor x own(rank) + the CPU of its collective calls
       own(rank) = kernels (the compute model's time at the rank's share of a core, times that share)
                 + per parameter tensor: optimizer step and gradient clip (plain or DTensor, measured)
                 + under tp > 1, per layer and microbatch: what the TP wrappers add, and on the first and
                   last stages what they add to the embedding, head and loss (measured as one, half each)
       collective calls: CPU per ring step (the comm profile's lockstep rows) x the call's ring steps

   The pieces of own(rank) are timed alone; in a run a node's processes take turns on each core and a step
   holds work no piece covers. The profile's "host.rank_steps" block measures the profiled layout's real
   rank steps, every rank of a node at once (bench/cpu/rank_steps.py); `factor` is their CPU over what
   own(rank) counts for that layout today (1 without the block). A gloo rank that waits for its partner
   blocks, it does not spin (measured on gpt-3d, 8 ranks on 2 cores: 0.7-0.9 ms of CPU a call).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from partrain.blueprint.comm_profile import ring_steps
from partrain.blueprint.compute_profile import RANK_STEPS_LAYOUT_KEYS, load_profile, profile_key
from partrain.blueprint.planner.comm import COMM_OPS, family_groups, link_of
from partrain.blueprint.planner.compute_model import ComputeModel
from partrain.blueprint.planner.notes import Note
from partrain.blueprint.planner.params import (
    embed_tensors,
    final_tensors,
    layer_is_sparse,
    layer_tensors,
    tied_head_copy,
)
from partrain.blueprint.planner.rank_state import PipelineRank
from partrain.blueprint.planner.spec import ClusterSpec, PlanSpec

MIB = 2**20

NOMINAL_RUNTIME_BYTES = 350 * MIB
"""Resident bytes of a partrain worker before its model is built (measured: 348-352 MiB on gpt-dp's ranks)."""
NOMINAL_CODE_BYTES = 16 * MIB
"""Library code a CPU worker's steps page in after that (measured: 13-18 MiB of file-backed RSS)."""
HEAP_FIXED_BYTES = 12 * MIB
"""The heap glibc keeps whatever the activations (the module docstring's fit)."""
HEAP_PER_TRANSIENT_BYTE = 1.0
"""Heap glibc keeps per byte of the rank's planned activations and transients (the module docstring's fit)."""
LOSS_PARALLEL_CALLS = 3
"""All-reduces per microbatch that loss parallel's cross-entropy makes on the last stage beyond the
head's one (the logits' max, their exp-sum, the target logits; counted on gpt-3d)."""
CLIP_CALLS_TP = 1
"""Gradient-norm all-reduces over TP per step: one for the TP-sharded gradients (grad_norm.py)."""


@dataclass(frozen=True)
class HostCosts:
    """A CPU profile's per-call work besides kernels (its "host" block), in seconds."""

    optimizer_plain_s: float
    """The optimizer's step, per plain parameter tensor."""
    optimizer_dtensor_s: float
    """The optimizer's step, per DTensor parameter (tensor-parallel or FSDP)."""
    clip_plain_s: float
    clip_dtensor_s: float
    tp_layer_s: float = 0.0
    """What partrain's tensor-parallel wrappers add to one layer's forward + backward."""
    tp_ends_s: float = 0.0
    """What they add to a microbatch's embedding, head and loss (forward + backward)."""


@dataclass(frozen=True)
class RankSteps:
    """The profiled layout's real rank steps ("host.rank_steps"): measurements only."""

    layout: str
    """The layout in words (for the report)."""
    fields: Tuple[Tuple[str, object], ...]
    """The PlanSpec fields of the profiled layout (RANK_STEPS_LAYOUT_KEYS less devices_per_node)."""
    devices_per_node: int
    pp_ranks: Tuple[int, ...]
    """The pipeline rank of each measured rank."""
    measured_cpu_s: Tuple[float, ...]
    """Each measured rank's process CPU seconds per step."""


@dataclass(frozen=True)
class CpuHost:
    """What a CPU compute profile says about the host: any of its three blocks may be missing."""

    host: Optional[HostCosts] = None
    process: Optional[Tuple[float, float]] = None
    """(runtime, library code) resident bytes of a training process beyond its tensors."""
    rank_steps: Optional[RankSteps] = None


def cpu_host_of(profile: dict) -> CpuHost:
    """The host model's view of a checked compute profile (CpuHost() for a GPU's)."""
    if profile["device"]["type"] != "cpu":
        return CpuHost()
    block, process = profile.get("host"), profile.get("process")
    held = (float(process["runtime_rss_bytes"]), float(process["code_rss_bytes"])) if process else None
    if not block:
        return CpuHost(process=held)
    opt, clip = block["optimizer_s_per_tensor"], block["clip_s_per_tensor"]
    host = HostCosts(
        float(opt["plain"]),
        float(opt["dtensor"]),
        float(clip["plain"]),
        float(clip["dtensor"]),
        float(block.get("tp_layer_s", 0.0)),
        float(block.get("tp_ends_s", 0.0)),
    )
    return CpuHost(host, held, _rank_steps(block.get("rank_steps")))


def _rank_steps(block: Optional[dict]) -> Optional[RankSteps]:
    """None for a profile without the block, or with one measured before it recorded its layout's fields."""
    if not block or not isinstance(block.get("spec"), dict):
        return None
    spec = block["spec"]
    fields = tuple((k, spec[k]) for k in RANK_STEPS_LAYOUT_KEYS if k in spec and k != "devices_per_node")
    return RankSteps(
        layout=str(block.get("layout", "")),
        fields=fields,
        devices_per_node=int(spec.get("devices_per_node", 1)),
        pp_ranks=tuple(int(p) for p in block["pp_ranks"]),
        measured_cpu_s=tuple(float(s) for s in block["measured_cpu_s"]),
    )


@functools.lru_cache(maxsize=16)
def _cpu_host(key: Tuple[str, int, int]) -> CpuHost:
    return cpu_host_of(load_profile(key[0]))


def cpu_host(spec: PlanSpec) -> CpuHost:
    """The host model's figures for the spec's compute profile (cached while the file is unchanged)."""
    path = spec.cluster.compute_profile
    return _cpu_host(profile_key(path)) if path else CpuHost()


# --- 1. the "process" memory term ---------------------------------------------------------------


def process_bytes(spec: PlanSpec, transient_bytes: float) -> float:
    """The "process" term of one CPU rank whose activations and transients are `transient_bytes`."""
    measured = cpu_host(spec).process
    runtime, code = measured or (NOMINAL_RUNTIME_BYTES, NOMINAL_CODE_BYTES)
    return runtime + code + HEAP_FIXED_BYTES + HEAP_PER_TRANSIENT_BYTE * transient_bytes


def process_note(spec: PlanSpec, nbytes: float) -> Note:
    """What the term holds and where its figures come from (`report.notes` words it)."""
    measured = cpu_host(spec).process is not None
    return Note(
        "process",
        {
            "bytes": nbytes,
            "profile": spec.cluster.compute_profile if measured else None,
            "heap_fixed_bytes": HEAP_FIXED_BYTES,
            "heap_per_transient_byte": HEAP_PER_TRANSIENT_BYTE,
        },
    )


# --- 2. the shared-core bound -------------------------------------------------------------------


def call_cpu(cl: ClusterSpec, link: str, op: str, ranks: int) -> float:
    """CPU seconds one call of `op` over `ranks` ranks costs each of them: the comm profile's CPU per ring
    step on that link (an op it did not measure costs what its all-reduce does) x the call's ring steps."""
    costs = dict(cl.cpu_costs)
    per_step = costs.get(f"{link}/{op}", costs.get(f"{link}/all_reduce", 0.0))
    return per_step * ring_steps(op, ranks)


@functools.lru_cache(maxsize=4096)
def group_cpu_costs(cl: ClusterSpec, order, tp: int, sp: int, dp: int, pp: int, ep: int, dp_shard: int):
    """CPU seconds one call costs a rank, "tp/<op>" etc. for every family and op (empty without a comm
    profile measured on CPU devices)."""
    if not cl.cpu_costs:
        return {}
    groups = family_groups(order, {"tp": tp, "sp": sp, "dp": dp, "pp": pp}, ep, dp_shard)
    return {
        f"{name}/{op}": call_cpu(cl, link_of(cl, members), op, len(members))
        for name, members in groups.items()
        for op in COMM_OPS
        if len(members) > 1
    }


def _param_tensors(spec: PlanSpec, r: PipelineRank) -> List[bool]:
    """For each parameter tensor of the rank: is it a DTensor?"""
    f, x = spec.facts, spec.extras
    tensors = []
    for sparse in (False, True):
        n = r.sparse if sparse else r.layers - r.sparse
        if n:
            index = next((i for i in range(f.n_layers) if layer_is_sparse(f, x, i) == sparse), 0)
            tensors += layer_tensors(f, x, index) * n
    if r.first:
        tensors += embed_tensors(f)
    if r.last:
        tensors += final_tensors(f) + ([tied_head_copy(f)] if f.tied_embeddings and r.n_chunks > 1 else [])
    fsdp = spec.zero_stage >= 2
    return [fsdp or (spec.tp > 1 and t.tp_dim is not None) for t in tensors]


def tensor_seconds(spec: PlanSpec, r: PipelineRank, host: HostCosts) -> float:
    """Per-tensor CPU of the rank's optimizer step and gradient clip."""
    kinds = _param_tensors(spec, r)
    dtensors = sum(kinds)
    plain = len(kinds) - dtensors
    clip = plain * host.clip_plain_s + dtensors * host.clip_dtensor_s
    if spec.zero_stage == 1 and spec.shard > 1:  # ZeRO-1 steps its flat buffers, one per group
        return clip + 2 * host.optimizer_plain_s
    return clip + plain * host.optimizer_plain_s + dtensors * host.optimizer_dtensor_s


def control_calls(spec: PlanSpec, r: PipelineRank, microbatches: int) -> Dict[str, float]:
    """The collectives of the runtime's own per-step work, by "family/op", that rank_traffic does not
    time: the stop agreement (world), the loss broadcast and the pipeline's gradient-norm sum and tied
    weights (pp), the gradient norm's DTensor groups (tp, FSDP) and loss parallel's cross-entropy."""
    out: Dict[str, float] = {"world/all_reduce": 1.0}
    if spec.pp > 1:
        out["pp/all_gather"] = 1.0  # the loss broadcast: n - 1 steps, as an all-gather
        out["pp/all_reduce"] = 1.0 + (1.0 if spec.facts.tied_embeddings else 0.0)
    if spec.tp > 1:
        out["tp/all_reduce"] = CLIP_CALLS_TP + (LOSS_PARALLEL_CALLS * microbatches if r.last else 0.0)
    if spec.zero_stage >= 2:
        out["dp_shard/all_reduce"] = 1.0
    return out


def collective_seconds(spec: PlanSpec, traffic, r: PipelineRank) -> float:
    """CPU of the rank's collective calls in a step (0 without a comm profile measured on CPU)."""
    cpu_call = group_cpu_costs(
        spec.cluster, spec.order, spec.tp, spec.sp, spec.dp, spec.pp, spec.ep, spec.dp_shard or spec.dp
    )
    if not cpu_call:
        return 0.0
    m = spec.microbatches
    link = "intra" if spec.world <= spec.cluster.devices_per_node else "inter"
    total = sum(n * m * cpu_call.get(key, 0.0) for key, n in traffic.calls.items())
    total += sum(n * cpu_call.get(key, 0.0) for key, n in traffic.calls_step.items())
    for key, n in control_calls(spec, r, m).items():
        world = key.startswith("world/")
        total += n * (call_cpu(spec.cluster, link, "all_reduce", spec.world) if world else cpu_call.get(key, 0.0))
    return total


def rank_own_cpu_seconds(spec: PlanSpec, model: ComputeModel, estimate) -> float:
    """CPU seconds of one rank's step besides its collective calls, as the pieces measured alone add up:
    kernels at the rank's share of the cores, the per-tensor optimizer and clip, the TP wrappers."""
    share = model.core_share(spec.cluster.devices_per_node)
    c, r = estimate.compute, estimate.rank
    seconds = (spec.microbatches * c.t_compute + c.t_optimizer) * share
    host = cpu_host(spec).host
    if host is not None:
        seconds += tensor_seconds(spec, r, host)
        if spec.tp > 1:
            # The ends' cost, measured as one, is split between the embedding's and the head's stages.
            ends = (0.5 if r.first else 0.0) + (0.5 if r.last else 0.0)
            seconds += spec.microbatches * (r.layers * host.tp_layer_s + ends * host.tp_ends_s)
    return seconds


def rank_steps_spec(spec: PlanSpec, steps: RankSteps) -> Optional[PlanSpec]:
    """The profiled layout as a PlanSpec of this spec's model and cluster (None: it does not fit the model)."""
    fields = dict(steps.fields)
    cluster = replace(spec.cluster, devices_per_node=steps.devices_per_node)
    profiled = spec.with_(cluster=cluster, **fields)
    if profiled.pp * profiled.v > spec.facts.n_layers or profiled.microbatches < 1:
        return None
    return profiled


def rank_step_factor(spec: PlanSpec, count: Callable[[PlanSpec], Dict[int, float]]) -> float:
    """The profiled rank steps' measured CPU over what `count` (own CPU by pipeline rank) gives the same
    ranks today; 1 without a measurement, or when it counts nothing for them."""
    steps = cpu_host(spec).rank_steps
    profiled = rank_steps_spec(spec, steps) if steps is not None else None
    if profiled is None:
        return 1.0
    by_stage = count(profiled)
    counted = sum(by_stage.get(p, 0.0) for p in steps.pp_ranks)
    return sum(steps.measured_cpu_s) / counted if counted > 0 else 1.0


def shared_core_step(spec: PlanSpec, model: ComputeModel, per_rank: Sequence, factor: float) -> float:
    """The node's CPU work per step over its cores (0 when the profile did not say its cores). `per_rank`
    holds one estimate per pipeline rank (or, in the search, the few it times: their mean stands for a stage)."""
    if model.device != "cpu" or not model.cores or not per_rank:
        return 0.0

    def cpu(e) -> float:
        return factor * rank_own_cpu_seconds(spec, model, e) + collective_seconds(spec, e.traffic, e.rank)

    mean = sum(cpu(e) for e in per_rank) / len(per_rank)
    return mean * min(spec.cluster.devices_per_node, spec.world) / model.cores


def shared_cores_note(spec: PlanSpec, model: ComputeModel, factor: float, cpu_shared_s: float) -> Optional[Note]:
    """The bound's note for a CPU profile with fewer cores than a node's ranks (None otherwise)."""
    ranks = spec.cluster.devices_per_node
    if model.device != "cpu" or not model.cores or ranks <= model.cores:
        return None
    found = cpu_host(spec)
    steps = found.rank_steps
    return Note(
        "cpu_shared_cores",
        {
            "processes": ranks,
            "cores": model.cores,
            "host_block": found.host is not None,
            "tp_wrappers": found.host is not None and spec.tp > 1,
            "collective_cpu": bool(spec.cluster.cpu_costs),
            "factor": factor,
            "rank_steps_layout": steps.layout if steps is not None and factor != 1.0 else None,
            "cpu_shared_s": cpu_shared_s,
        },
    )
