"""Measured beside planned: each run's peak memory and tokens/s next to the planner's prediction for
the same layout (summary.json "planned_vs_measured", the last step's metrics.jsonl record and
TensorBoard scalars, the launcher's run summary), with a warning when they differ by more than 20%.

Measured memory, one definition per device:
- cuda: `torch.cuda.max_memory_allocated` minus what was allocated before the model was built (the
  planner counts tensors, not the caching allocator's slack); `max_memory_reserved` is kept beside it;
- cpu: the process's peak RSS (VmHWM), the whole process: on a CPU the planner counts what a worker
  holds beyond its tensors too (its "process" term: interpreter, torch, transformers, partrain, the
  library code the steps page in; planner/cpu_host.py). The RSS just before the model was built,
  with the modules the run imports later (the model's transformers module, the trackers') imported
  first, is kept beside it as the baseline. What rank 0's trackers (train.loggers) add to the process
  is no part of the plan: it is measured apart (trackers.TrackerMemory: their imports, start-up and
  logging calls) and subtracted ("tracker_bytes"), so the memory alarm speaks of the training only.
Measured tokens/s: global tokens per step over the mean step time, skipping warm-up steps (the first
two when the run has four or more, else the first). On accelerators a throughput more than the
tolerance off the plan is a warning; on a CPU the machine's other load decides the step time, so
there it is one line of information naming that load ("cpu_load": the 1-minute load average, the
cores this process may use, the run's processes on this node); memory warns on every device.

Nothing here runs inside a step: the plan is computed once before the loop, memory is read once at
the end. A planner that cannot estimate this layout never fails the run: the block says why.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from partrain.runtime.resident import current_rss_bytes, peak_rss_bytes
from partrain.train.auto_check import EARLY_CHECK_AFTER_WARMUP, auto_verdict, read_auto_record
from partrain.train.trackers import TrackerMemory, import_tracker_modules

log = logging.getLogger("partrain")

TOLERANCE = 0.2
"""A measured figure more than this far from its plan (relative) is reported with a warning."""

ACCOUNTING = "autocast"
"""The planner's accounting compared with the run: partrain's own runtime (fp32 weights under autocast)."""

MEMORY_DEFINITION = {
    "cpu": "peak RSS (VmHWM) of the whole process, as the planner counts a CPU worker: its tensors plus its "
    "'process' term (interpreter, torch, transformers, partrain and their code), minus tracker_bytes (what "
    "the trackers of train.loggers added: their imports, start-up and logging); baseline_memory_bytes is the "
    "RSS just before the model was built",
    "cuda": "torch.cuda.max_memory_allocated minus the bytes allocated before the model was built "
    "(max_memory_reserved kept beside it)",
}


def _warm_imports(v, trackers: Optional[TrackerMemory]) -> None:
    """Import now what the run imports after the baseline, so the baseline holds it; the trackers'
    modules (rank 0's, with `trackers`) measured apart."""
    try:
        from partrain.models.build import import_model_module

        import_model_module(v.run.model)
    except Exception as exc:  # noqa: BLE001 - a custom model: the baseline is only a little lower
        log.info("plan check: the model's module was not imported before the baseline (%s)", exc)
    if trackers is not None:  # rank 0's trackers (train.loggers)
        import_tracker_modules(v.run.train.loggers, trackers)


def memory_baseline(v, device: torch.device, is_main: bool, trackers: Optional[TrackerMemory] = None) -> int:
    """Bytes in use before the model is built (call just before build_engine). On rank 0 of a CPU run
    the trackers' modules are imported here, their resident growth counted in `trackers`."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the peaks count from here
        return int(torch.cuda.memory_allocated(device))
    _warm_imports(v, (trackers if trackers is not None else TrackerMemory()) if is_main else None)
    return current_rss_bytes()


def measured_memory(device: torch.device, baseline: int, trackers: Optional[TrackerMemory] = None) -> Dict[str, int]:
    """This rank's peak memory since the start, by the module's definition ("measured_memory_bytes").
    On a CPU the trackers' resident growth (`trackers`, rank 0) is subtracted and kept as tracker_bytes;
    on CUDA trackers allocate no device memory: nothing to subtract."""
    if device.type == "cuda":
        allocated = int(torch.cuda.max_memory_allocated(device))
        return {
            "measured_memory_bytes": allocated - baseline,
            "max_memory_allocated_bytes": allocated,
            "max_memory_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
            "baseline_memory_bytes": baseline,
        }
    peak = peak_rss_bytes()
    extra = trackers.total if trackers is not None else 0
    out = {"measured_memory_bytes": peak - extra, "peak_rss_bytes": peak, "tracker_bytes": extra}
    if extra:
        out["tracker_bytes_by_phase"] = trackers.to_json()
    return {**out, "baseline_memory_bytes": baseline}


def warmup_steps(n: int) -> int:
    return 2 if n >= 4 else 1 if n >= 2 else 0


def steady_tokens_per_s(step_times: Sequence[float], tokens_per_step: int) -> float:
    """Tokens per second over the steps after warm-up (0.0 without a timed step)."""
    timed = list(step_times)[warmup_steps(len(step_times)) :]
    return tokens_per_step * len(timed) / sum(timed) if timed and sum(timed) > 0 else 0.0


def compare(planned: float, measured: float, tolerance: float = TOLERANCE) -> Dict[str, Any]:
    """{"planned", "measured", "measured_over_planned", "within_tolerance"}; no ratio without a plan."""
    ratio = measured / planned if planned > 0 else None
    ok = ratio is not None and abs(ratio - 1.0) <= tolerance
    return {"planned": planned, "measured": measured, "measured_over_planned": ratio, "within_tolerance": ok}


@dataclass
class Plan:
    """The planner's figures for this run's layout, or why there are none."""

    stage_bytes: Dict[int, dict] = field(default_factory=dict)
    """pp rank -> the planner's memory terms (params, grads, optimizer, activations, transient, total)."""
    tokens_per_s: float = 0.0
    error: Optional[str] = None
    auto: Optional[dict] = None
    """The record of a `parallel=auto` choice (auto_layout.json in the run folder), else None."""

    @classmethod
    def of(cls, v, run_dir=None) -> "Plan":
        auto = read_auto_record(run_dir)
        if auto is not None and _world_of(auto["chosen"]["layout"]) != v.world_size:
            auto = None  # an elastic re-plan: the record predicts the first layout, not this one
        try:
            from partrain.blueprint.planner import estimate

            est = estimate(v, mixed=ACCOUNTING)
            stages = {int(s["pp_rank"]): {k: s[k] for k in _TERMS if k in s} for s in est["memory_bytes_per_stage"]}
            return cls(stages, float(est["tokens_per_s"]), auto=auto)
        except Exception as exc:  # noqa: BLE001 - a run never fails for its plan check
            log.warning("plan check: the planner could not estimate this layout: %s: %s", type(exc).__name__, exc)
            return cls(error=f"the planner could not estimate this layout: {type(exc).__name__}: {exc}", auto=auto)

    def bytes_for(self, pp_rank: int) -> int:
        stage = self.stage_bytes.get(pp_rank)
        return int(stage["total"]) if stage else 0


def _world_of(layout: dict) -> int:
    return layout["dp"] * layout["tp"] * layout["pp"] * layout["sp"]


_TERMS = ("params", "grads", "optimizer", "activations", "transient", "process", "total")


CPU_MEMORY_HINT = (
    "; a CPU RSS counts the planner's 'process' term (interpreter, libraries, their code, glibc's heap), "
    "nominal unless cluster.compute_profile names a `partrain bench compute` profile of this machine, and "
    "its heap share is an empirical rule (planner/cpu_host.py)"
)
"""Why a CPU run can still measure above its plan: the runtime and code figures of another machine or
library version, and a heap that keeps more than the rule (fitted to partrain's CPU recipes)."""


def host_load(processes_on_node: int) -> Dict[str, Any]:
    """This machine's load now: {"load_average_1m", "cores" (the CPUs this process may run on),
    "processes_on_node" (the run's), "processes_per_core"}; load_average_1m is None where the OS
    does not say."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    return {
        "load_average_1m": load,
        "cores": cores,
        "processes_on_node": processes_on_node,
        "processes_per_core": round(processes_on_node / cores, 2),
    }


def load_text(load: Dict[str, Any]) -> str:
    """The host's load in words: "CPU: load average 5.2 on 2 cores, 8 ranks on this node (4 per core)"."""
    avg = "load average unknown" if load["load_average_1m"] is None else f"load average {load['load_average_1m']:g}"
    n, cores = load["processes_on_node"], load["cores"]
    return (
        f"CPU: {avg} on {cores} core{'s' * (cores != 1)}, {n} rank{'s' * (n != 1)} on this node "
        f"({load['processes_per_core']:g} per core)"
    )


def processes_on_this_node(v) -> int:
    """The run's processes on this node: torchrun's LOCAL_WORLD_SIZE, else the cluster's devices per node."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit():
        return int(local)
    run = getattr(v, "run", None)
    return int(run.cluster.devices_per_node) if run is not None else 1


def _info(tokens: dict, load: Optional[Dict[str, Any]]) -> List[str]:
    """On a CPU run (load given): the throughput against its plan as information naming the load."""
    if load is None or tokens["within_tolerance"] or tokens["measured_over_planned"] is None:
        return []
    return [
        f"throughput {tokens['measured']:,.0f} tokens/s, {tokens['measured_over_planned']:.2f}x the planned "
        f"{tokens['planned']:,.0f} ({load_text(load)}; on a CPU the machine's other load decides the step time)"
    ]


def _warnings(memory: dict, tokens: dict, worst: dict, device_type: str) -> List[str]:
    """The figures more than TOLERANCE away from their plan, one sentence each (throughput only on
    accelerators: on a CPU it is information, `_info`)."""
    out = []
    if not memory["within_tolerance"] and memory["measured_over_planned"] is not None:
        out.append(
            f"peak memory of rank {worst['rank']} is {memory['measured_over_planned']:.2f}x the plan "
            f"({memory['measured'] / 2**30:.3f} vs {memory['planned'] / 2**30:.3f} GiB planned)"
            + (CPU_MEMORY_HINT if device_type == "cpu" and memory["measured_over_planned"] > 1 else "")
        )
    if device_type != "cpu" and not tokens["within_tolerance"] and tokens["measured_over_planned"] is not None:
        out.append(
            f"throughput is {tokens['measured_over_planned']:.2f}x the plan "
            f"({tokens['measured']:,.0f} vs {tokens['planned']:,.0f} tokens/s planned)"
        )
    return out


def planned_vs_measured(
    plan: Plan,
    ranks: List[dict],
    step_times: Sequence[float],
    v,
    device_type: str,
    load: Optional[Dict[str, Any]] = None,
) -> dict:
    """The summary's "planned_vs_measured" block from every rank's measured memory (the gathered
    rank records: rank, pp_rank, measured_memory_bytes) and rank 0's step times. load: on a CPU,
    the host's load (`host_load`; measured now when not given)."""
    try:
        if device_type == "cpu" and load is None:
            load = host_load(processes_on_this_node(v))
        return _block(plan, ranks, step_times, v, device_type, load if device_type == "cpu" else None)
    except Exception as exc:  # noqa: BLE001 - a run never fails for its plan check
        log.warning("plan check failed: %s: %s", type(exc).__name__, exc)
        why = f"the plan check failed: {type(exc).__name__}: {exc}"
        return {"accounting": ACCOUNTING, "error": why, "warnings": []}


def _block(plan: Plan, ranks: List[dict], step_times: Sequence[float], v, device_type: str, load) -> dict:
    per_rank = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        c = compare(plan.bytes_for(r["pp_rank"]), r["measured_memory_bytes"])
        per_rank.append({"rank": r["rank"], "pp_rank": r["pp_rank"], **c, "tracker_bytes": r.get("tracker_bytes", 0)})
    # The rank furthest from its plan decides the memory verdict and the one-line summary.
    worst = max(per_rank, key=lambda c: abs((c["measured_over_planned"] or 0.0) - 1.0))
    memory = compare(worst["planned"], worst["measured"])
    tokens = compare(plan.tokens_per_s, steady_tokens_per_s(step_times, v.tokens_per_step))
    block = {
        "accounting": ACCOUNTING,
        "memory_definition": MEMORY_DEFINITION.get(device_type, MEMORY_DEFINITION["cpu"]),
        "tolerance": TOLERANCE,
        "error": plan.error,
        # What the trackers added to the worst rank's process, already taken out of "measured".
        "memory": {"rank": worst["rank"], **memory, "tracker_bytes_subtracted": worst["tracker_bytes"]},
        "memory_per_rank": per_rank,
        "planned_memory_terms": {str(k): s for k, s in sorted(plan.stage_bytes.items())},
        "tokens_per_s": {**tokens, "warmup_steps_skipped": warmup_steps(len(step_times))},
        "warnings": [] if plan.error else _warnings(memory, tokens, worst, device_type),
        "info": [] if plan.error else _info(tokens, load),
    }
    if load is not None:
        block["cpu_load"] = load
    if plan.auto is not None:
        block["auto"] = auto_verdict(plan.auto, memory["measured"], tokens["measured"], load and load_text(load))
        block["warnings"] += block["auto"]["warnings"]
        block["info"] += block["auto"]["info"]
    for text in block["warnings"]:
        log.warning("planned vs measured: %s", text)
    for text in block["info"]:
        log.info("planned vs measured: %s", text)
    return block


class PlanCheckMetrics:
    """A MetricsWriter that adds the plan check to the run's last step record (rank 0's own memory):
    plan_memory_bytes, measured_memory_bytes, memory_measured_over_planned, plan_tokens_per_s,
    measured_tokens_per_s, tokens_per_s_measured_over_planned. Every other record passes unchanged,
    so parsers of step and eval lines keep working; TensorBoard gets them as scalars at that step."""

    def __init__(
        self,
        inner,
        plan: Plan,
        last_step: int,
        v,
        device: torch.device,
        baseline: int,
        pp_rank: int,
        trackers: Optional[TrackerMemory] = None,
    ):
        self.inner, self.plan, self.last_step, self.v = inner, plan, last_step, v
        self.device, self.baseline, self.pp_rank, self.trackers = device, baseline, pp_rank, trackers
        self.step_times: List[float] = []

    def write(self, record: dict) -> None:
        if "step_time_s" in record:
            self.step_times.append(record["step_time_s"])
            if self.plan.auto is not None and len(self.step_times) == self.early_check_at():
                self.check_auto_early()
            if record["step"] == self.last_step:
                try:
                    record = {**record, **self.fields()}
                except Exception as exc:  # noqa: BLE001 - a run never fails for its plan check
                    log.warning("plan check failed: %s: %s", type(exc).__name__, exc)
        self.inner.write(record)

    def early_check_at(self) -> int:
        """The number of steps this run times before the early `parallel=auto` check."""
        return min(self.last_step, warmup_steps(self.last_step) + EARLY_CHECK_AFTER_WARMUP)

    def check_auto_early(self) -> None:
        try:
            measured = measured_memory(self.device, self.baseline, self.trackers)["measured_memory_bytes"]
            tokens = steady_tokens_per_s(self.step_times, self.v.tokens_per_step)
            cpu = load_text(host_load(processes_on_this_node(self.v))) if self.device.type == "cpu" else None
            verdict = auto_verdict(self.plan.auto, measured, tokens, cpu)
            for text in verdict["warnings"]:
                log.warning("after %d steps: %s", len(self.step_times), text)
                # A plain line on rank 0's stdout reaches the launcher's console (or the user's torchrun) now.
                print(f"warning: after {len(self.step_times)} steps: {text}", flush=True)
            for text in verdict["info"]:  # a CPU's step time: information in the log, not a warning
                log.info("after %d steps: %s", len(self.step_times), text)
        except Exception as exc:  # noqa: BLE001 - a run never fails for its plan check
            log.warning("parallel=auto check failed: %s: %s", type(exc).__name__, exc)

    def fields(self) -> Dict[str, Any]:
        measured = measured_memory(self.device, self.baseline, self.trackers)["measured_memory_bytes"]
        memory = compare(self.plan.bytes_for(self.pp_rank), measured)
        tokens = compare(self.plan.tokens_per_s, steady_tokens_per_s(self.step_times, self.v.tokens_per_step))
        out = {"measured_memory_bytes": measured, "measured_tokens_per_s": tokens["measured"]}
        if self.plan.error is None:
            out.update(
                plan_memory_bytes=memory["planned"],
                memory_measured_over_planned=memory["measured_over_planned"],
                plan_tokens_per_s=tokens["planned"],
                tokens_per_s_measured_over_planned=tokens["measured_over_planned"],
            )
        return out

    def close(self) -> None:
        self.inner.close()
