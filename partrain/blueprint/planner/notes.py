"""The estimate's notes as data: a code and its figures, never a sentence.

The planner says what it assumed and found (which accounting, where compute and bandwidths come from,
what a CPU process holds, whether the layout fits) as `Note`s; `partrain.blueprint.report.notes`
turns each code into the English the report prints. The JSON report carries both: "note_data" (these,
as dicts) and "notes" (their text). A new note is a code here and a renderer there; a code the report
does not know is printed as its figures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from partrain.blueprint.planner.compute_model import compute_figures
from partrain.blueprint.planner.memory import dtypes
from partrain.blueprint.planner.spec import PlanSpec


@dataclass(frozen=True)
class Note:
    """One finding of the estimate: `code` names it, `figures` hold its numbers (bytes, seconds,
    fractions, counts) and the few names (paths, modes) the text quotes."""

    code: str
    figures: Dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return {"code": self.code, "figures": dict(self.figures)}


def memory_note(spec: PlanSpec, worst_bytes: float, worst_pp_rank: int, usable: float) -> Note:
    """The worst rank's memory against the device's (on a CPU, the node's memory its processes share)."""
    cl = spec.cluster
    figures: Dict[str, Any] = {
        "worst_pp_rank": worst_pp_rank,
        "worst_bytes": worst_bytes,
        "device_bytes": cl.device_memory_bytes,
        "usable_fraction": usable,
    }
    if cl.device == "cpu":
        figures.update(node_bytes=cl.device_memory_bytes * cl.devices_per_node, processes=cl.devices_per_node)
    return Note("memory", figures)


def accounting_note(spec: PlanSpec, param: int, grad: int, optim: int) -> Optional[Note]:
    """How 16-bit training's states are counted (None for fp32): the paper's, master weights, FSDP's
    mixed precision, or autocast over fp32 weights; `param`/`grad`/`optim` are autocast's bytes per parameter."""
    if spec.precision == "fp32":
        return None
    if spec.mixed == "zero":
        return Note("accounting_paper")
    if spec.style == "master":
        return Note("accounting_master", {"optimizer_shards": spec.shard if spec.zero_stage == 1 else 1})
    kind = "accounting_fsdp" if spec.zero_stage >= 2 else "accounting_autocast"
    return Note(kind, {"bytes_per_param": [param, grad, optim]})


def parallel_notes(spec: PlanSpec, est: dict) -> List[Note]:
    """Context parallel, expert parallel, latent attention and MoE routing, where the layout has them."""
    notes = []
    if spec.sp > 1:
        notes.append(Note("context_parallel", {"sp_mode": spec.sp_mode, "zero1": spec.zero_stage == 1}))
    if spec.ep > 1:
        moe = est["moe"]
        figures = {
            "local_experts": spec.facts.n_experts // spec.ep,
            "experts": spec.facts.n_experts,
            "expert_shard": moe["expert_shard"],
            "edp": moe["edp"],
            "link": est["links"]["ep"],
        }
        notes.append(Note("expert_parallel", figures))
    latent = spec.facts.latent_attention
    if latent is not None:  # the attention formulas count plain heads (see families/deepseek_v3.py)
        notes.append(Note("latent_attention", {"head_dim": spec.facts.head_dim, "v_head_dim": latent.v_head_dim}))
    if spec.facts.is_moe:
        cf = spec.moe_capacity_factor
        slots = None if cf is None else est["moe"]["capacity_per_expert"]
        notes.append(Note("moe_routing", {"capacity_factor": cf, "capacity_per_expert": slots}))
    return notes


def comm_figures(spec: PlanSpec) -> Dict[str, Any]:
    """Where the bandwidths come from: measured (the profile, and whether it lacks inter-node links that
    the layout needs) or the cluster's link speeds."""
    cl = spec.cluster
    if not cl.measured:
        return {"measured": False}
    no_inter = cl.nodes > 1 and not any(key.startswith("inter/") for key, _ in cl.measured)
    return {
        "measured": True,
        "profile": cl.bandwidth_source.split(":", 1)[1],
        "nominal_inter_bw": cl.inter_bw if no_inter else None,
    }


def nominal_compute_note(spec: PlanSpec, efficiency: float) -> Note:
    """Compute at a share of the cluster's peak (no compute profile), with the bandwidths' source."""
    figures = {"efficiency": efficiency, "peak_flops": spec.cluster.peak_flops, "comm": comm_figures(spec)}
    return Note("compute_nominal", figures)


def does_not_fit_note(worst_bytes: float, capacity_bytes: float) -> Note:
    return Note("does_not_fit", {"needs_bytes": worst_bytes, "usable_bytes": capacity_bytes})


def compute_note(spec: PlanSpec, efficiency: float) -> Note:
    """Where compute time and bandwidths come from: the compute profile's fitted model, or the peak."""
    if not spec.cluster.compute_profile:
        return nominal_compute_note(spec, efficiency)
    return Note("compute_profile", {**compute_figures(spec.cluster.compute_profile), "comm": comm_figures(spec)})


def estimate_notes(spec: PlanSpec, est: dict, worst_bytes: float, worst_pp_rank: int, efficiency: float) -> List[Note]:
    """The estimate's notes in the report's order, less the CPU host model's (estimate.py adds those)."""
    d = dtypes(spec.precision, "autocast")
    notes = [memory_note(spec, worst_bytes, worst_pp_rank, est["assumptions"]["usable_memory_fraction"])]
    accounting = accounting_note(spec, d.param, d.grad, d.optim)
    notes += [accounting] if accounting else []
    notes += parallel_notes(spec, est)
    notes.append(compute_note(spec, efficiency))
    if not est["fits"]:
        notes.append(does_not_fit_note(worst_bytes, est["capacity_bytes"]))
    return notes
