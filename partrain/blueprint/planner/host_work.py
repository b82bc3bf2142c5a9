"""The CPU work of a step on a CPU node whose ranks share its cores: a lower bound on the step time.

On a GPU the host runs ahead of the device and the step is the device's critical path. On a CPU node
the same cores run every rank's kernels and everything around them: Python and torch's dispatcher,
DTensor's sharding logic around tensor-parallel layers, the optimizer's per-tensor loop, and the
backend's threads copying, reducing and polling for every collective call. When a node's ranks
outnumber its cores, the step cannot be shorter than all that work divided by the cores:

    step >= sum over the node's ranks of cpu(rank) / cores

    cpu(rank) = busy x own(rank) + the CPU of its collective calls

    own(rank) = kernels: the compute model's time at the share of a core the rank gets, times that share
              + the optimizer's bytes (the same)
              + per parameter tensor: optimizer step and gradient clip (plain or DTensor, measured)
              + per layer and microbatch under tp > 1: what the TP wrappers add (measured), and on the
                first and last stages what they add to the embedding, head and loss (measured as one,
                half to each)
    collective calls: per call, the CPU `partrain bench comm` measured on a busy node (its "busy" block),
              or CPU per ring step x ring steps (its lockstep rows)

The pieces of own(rank) are timed one at a time, in one process with the machine to itself (the compute
profile's "host" block). In a run the same work costs more: a node's processes take turns on each core,
and each turn starts with caches the others filled; and a step holds work no piece covers (the pipeline
schedule's bookkeeping, the gradient sync's flattening, the loss's ends). `busy` is measured: the
compute profile's `host.rank_steps` runs the profiled layout's real rank steps, every rank of the node at
once on the fake process group (bench/rank_steps.py), and keeps their CPU over this count of them; on
the profiled layout busy x own(rank) is then the measured step, and other layouts get the same factor.
Without it, the comm profile's busy-node inflation of a plain compute unit (busy_node.py), else 1.

The per-call costs come from the compute profile's "host" block and the comm profile's "cpu_s" rows;
without them that part counts zero (and the bound is the compute model's own). Parameter tensors are
DTensors under tensor parallelism (the sliced ones) and FSDP (all); ZeRO-1's sharded optimizer steps
its flat buffers (one per parameter group). Besides the collectives `rank_traffic` times, the runtime's
loop makes a few per step, counted in `control_calls` (counted on gpt-3d with torch 2.13).

Measured for gpt-3d (8 ranks on 2 cores, 1 thread each; per-call probes in every rank of a real run, not
committed): 91-100 CPU-ms per rank and step, of which about 25 in 21.6 collective calls (1.2 ms each on
the busy node) and the rest the rank's own work; 8 x 96 ms over 2 cores is the measured step. So the
step is the node's CPU work over its cores, and a gloo rank that waits for its partner blocks, it does not
spin (0.7-0.9 ms of CPU a call). Over four profiles the pieces alone counted 26-39 ms of own work a
rank, and the rank steps measured all at once took 50-59 ms (factor 1.35-2.0).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from partrain.blueprint.planner.compute_model import ComputeModel, HostCosts
from partrain.blueprint.planner.params import (
    embed_tensors,
    final_tensors,
    layer_is_sparse,
    layer_tensors,
    tied_head_copy,
)
from partrain.blueprint.planner.rank_state import PipelineRank
from partrain.blueprint.planner.spec import PlanSpec

LOSS_PARALLEL_CALLS = 3
"""All-reduces per microbatch that loss parallel's cross-entropy makes on the last stage beyond the
head's one (the logits' max, their exp-sum, the target logits; counted on gpt-3d)."""
CLIP_CALLS_TP = 1
"""Gradient-norm all-reduces over TP per step: one for the TP-sharded gradients (grad_norm.py)."""


def _param_tensors(spec: PlanSpec, r: PipelineRank) -> List[bool]:
    """For each parameter tensor of the rank: is it a DTensor?"""
    f, x = spec.facts, spec.extras
    tensors = []
    for sparse in (False, True):
        n = r.sparse if sparse else r.layers - r.sparse
        if n:
            index = _first_layer(spec, sparse)
            tensors += layer_tensors(f, x, index) * n
    if r.first:
        tensors += embed_tensors(f)
    if r.last:
        tensors += final_tensors(f) + ([tied_head_copy(f)] if f.tied_embeddings and r.n_chunks > 1 else [])
    fsdp = spec.zero_stage >= 2
    return [fsdp or (spec.tp > 1 and t.tp_dim is not None) for t in tensors]


def _first_layer(spec: PlanSpec, sparse: bool) -> int:
    for i in range(spec.facts.n_layers):
        if layer_is_sparse(spec.facts, spec.extras, i) == sparse:
            return i
    return 0


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


def _world_call(spec: PlanSpec) -> float:
    """CPU of one all-reduce over every rank (the stop agreement)."""
    link = "intra" if spec.world <= spec.cluster.devices_per_node else "inter"
    return spec.cluster.call_cpu(link, "all_reduce", spec.world)


def collective_seconds(spec: PlanSpec, traffic, r: PipelineRank, cpu_call: Dict[str, float]) -> float:
    """CPU of the rank's collective calls in a step (0 without a comm profile measured on CPU)."""
    if not cpu_call:
        return 0.0
    m = spec.microbatches
    total = sum(n * m * cpu_call.get(key, 0.0) for key, n in traffic.calls.items())
    total += sum(n * cpu_call.get(key, 0.0) for key, n in traffic.calls_step.items())
    for key, n in control_calls(spec, r, m).items():
        total += n * (_world_call(spec) if key.startswith("world/") else cpu_call.get(key, 0.0))
    return total


def rank_own_cpu_seconds(spec: PlanSpec, model: ComputeModel, estimate) -> float:
    """CPU seconds of one rank's step besides its collective calls, as the pieces measured alone add up:
    kernels at the rank's share of the cores, the per-tensor optimizer and clip, the TP wrappers."""
    share = model.core_share(spec.cluster.devices_per_node)
    c, r = estimate.compute, estimate.rank
    seconds = (spec.microbatches * c.t_compute + c.t_optimizer) * share
    if model.host is not None:
        seconds += tensor_seconds(spec, r, model.host)
        if spec.tp > 1:
            # The ends' cost, measured as one, is split between the embedding's and the head's stages.
            ends = (0.5 if r.first else 0.0) + (0.5 if r.last else 0.0)
            seconds += spec.microbatches * (r.layers * model.host.tp_layer_s + ends * model.host.tp_ends_s)
    return seconds


def busy_factor(spec: PlanSpec, model: ComputeModel) -> float:
    """How much more CPU a rank's own work takes in a real step on a busy node than its pieces alone:
    the compute profile's measured rank steps over this count (rank_steps.py), else the comm profile's
    busy-node inflation of a plain compute unit (busy_node.py), else 1."""
    if model.host is not None and model.host.rank_step_factor > 0:
        return model.host.rank_step_factor
    return spec.cluster.busy_compute_inflation


def rank_cpu_seconds(spec: PlanSpec, model: ComputeModel, estimate, cpu_call: Dict[str, float]) -> float:
    """CPU seconds one rank's step takes (the module docstring's cpu(rank))."""
    own = rank_own_cpu_seconds(spec, model, estimate) * busy_factor(spec, model)
    return own + collective_seconds(spec, estimate.traffic, estimate.rank, cpu_call)


def shared_core_step(spec: PlanSpec, model: Optional[ComputeModel], per_rank: Sequence, cpu_call) -> float:
    """The node's CPU work per step over its cores (0 off CPU, or when the profile did not say its cores).
    `per_rank` holds one estimate per pipeline rank (or, in the search, the few it times: their mean
    stands for a stage)."""
    if model is None or model.device != "cpu" or not model.cores or not per_rank:
        return 0.0
    mean = sum(rank_cpu_seconds(spec, model, e, cpu_call) for e in per_rank) / len(per_rank)
    return mean * min(spec.cluster.devices_per_node, spec.world) / model.cores


def shared_cores_note(spec: PlanSpec, model: Optional[ComputeModel], cpu_shared_s: float) -> Optional[str]:
    """The report's line for a CPU profile with fewer cores than a node's ranks (None otherwise): the
    step is their CPU work over the cores, what that counts, and what it leaves out."""
    ranks = spec.cluster.devices_per_node
    if model is None or model.device != "cpu" or not model.cores or ranks <= model.cores:
        return None
    counted = ["kernels"]
    if model.host is not None:
        counted.append("the per-tensor optimizer and clip" + (" and the TP wrappers" if spec.tp > 1 else ""))
    counted.append("collective calls" if spec.cluster.cpu_costs else "no collective CPU (the comm profile has none)")
    bound = f"; it adds {cpu_shared_s:.3g} s to the critical path" if cpu_shared_s > 0 else ""
    missing = "" if model.host is not None else " (the compute profile has no host block: measure it again)"
    factor = busy_factor(spec, model)
    if model.host is not None and model.host.rank_step_factor > 0:
        scaled = f"; each rank's own work x{factor:.2f}, the real rank steps of {model.host.rank_step_layout} measured"
        scaled += " all at once by bench compute over their count"
    elif factor != 1.0:
        scaled = f"; each rank's own work x{factor:.2f}, the busy-node inflation bench comm measured"
    else:
        scaled = ""
    return (
        f"{ranks} processes per node share {model.cores} CPU cores: the step is at least their CPU work over the cores "
        f"({', '.join(counted)}{missing}){scaled}{bound}. A lower bound: ranks also wait for partners that are "
        "not scheduled"
    )
