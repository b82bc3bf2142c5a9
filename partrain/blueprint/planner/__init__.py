"""The planner: per-rank memory, FLOPs, communication, pipeline bubble and step time of a layout,
and a search over layouts. Pure Python (no torch): the dry run stays fast.

    from partrain.blueprint.planner import estimate, search, model_state_bytes_per_rank
    est = estimate(validated_run)            # the report's "estimate" block (JSON-able)
    best = search(validated_run, top_k=10)   # the report's "candidates", best first

Modules: spec (PlanSpec: the numbers), params (every HF parameter tensor and how it is sharded),
memory (ZeRO / Korthikanti formulas; counted model states and activations), flops (Narayanan
formulas; counted FLOPs), comm (collective volumes, links), bubble (stage split, in-flight
microbatches, bubbles), rank_state (model-state elements of each pipeline rank), step_inputs
(what every rank's estimate shares), rank_traffic (bytes per group family), compute_model (compute
timed from a measured profile), cpu_host (the CPU host model: a CPU process's own memory and the
shared-core bound; frozen, CPU clusters only), estimate (memory, compute, step time, the report
block), notes (the estimate's notes as codes and figures), search (with search_space: the layouts
enumerated, candidates: their order and reasons), simulated (the data of `plan --simulate`).
The planner returns numbers; words and tables are `partrain.blueprint.report` (report.notes words
the notes); torch-based measurement for tests and benchmarks: `partrain.simulate`.
"""

from partrain.blueprint.planner.estimate import estimate, estimate_spec
from partrain.blueprint.planner.params import param_count, param_tensors
from partrain.blueprint.planner.rank_state import model_state_bytes_per_rank
from partrain.blueprint.planner.search import SearchSpace, base_spec, search
from partrain.blueprint.planner.spec import PlanSpec, spec_from_validated

__all__ = [
    "estimate",
    "estimate_spec",
    "model_state_bytes_per_rank",
    "param_count",
    "param_tensors",
    "search",
    "SearchSpace",
    "PlanSpec",
    "spec_from_validated",
    "plan_report",
    "base_spec",
]


def plan_report(v, search_layouts: bool = False, top_k: int = 10) -> dict:
    """{"estimate": ..., "candidates": [...] (with search_layouts)} to merge into the plan/dry-run report."""
    out = {"estimate": estimate(v)}
    if search_layouts:
        out["candidates"] = search(v, top_k=top_k)
    return out
