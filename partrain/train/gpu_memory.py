"""GPU memory figures and help on CUDA out-of-memory (issue 16, part 4).

Every step on CUDA, the metrics record carries each rank's `torch.cuda.max_memory_allocated` and
`max_memory_reserved` (one all-gather of two integers over the world: per-rank lists, rank order);
summary.json already holds them per rank (`plan_check.measured_memory`). When a rank runs out of
memory it writes what the allocator knows to the run folder (a snapshot when memory history was
being recorded, else `torch.cuda.memory_summary`) and fails with one message: planned vs measured
memory and the settings that would lower the peak, nearest first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

GiB = 2**30


def step_memory_fields(device: torch.device) -> Dict[str, List[int]]:
    """Per-rank peak allocated/reserved bytes so far ({} off CUDA); a collective on CUDA: every rank calls it."""
    if device.type != "cuda":
        return {}
    mine = torch.tensor(
        [torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)],
        dtype=torch.int64,
        device=device,
    )
    world = dist.get_world_size() if dist.is_initialized() else 1
    every = torch.empty(world, 2, dtype=torch.int64, device=device)
    if world > 1:
        dist.all_gather_into_tensor(every, mine.unsqueeze(0))
    else:
        every.copy_(mine.unsqueeze(0))
    rows = every.tolist()
    return {"max_memory_allocated_bytes": [r[0] for r in rows], "max_memory_reserved_bytes": [r[1] for r in rows]}


def settings_that_help(run, heads: Optional[int] = None) -> List[str]:
    """Config changes that lower a rank's peak memory for this run, the cheapest in speed first."""
    p, t = run.parallel, run.train
    out = []
    if t.loss_chunk_tokens == 0:
        out.append("train.loss_chunk_tokens=4096 (no whole fp32 logits)")
    if p.recompute == "none":
        out.append("parallel.recompute=selective (attention core recomputed) or full (only block inputs kept)")
    elif p.recompute == "selective":
        out.append("parallel.recompute=full (only block inputs kept)")
    if t.micro_batch_size > 1:
        out.append(
            f"train.micro_batch_size={t.micro_batch_size // 2} (activations halve; the global batch stays, "
            "with twice the microbatches)"
        )
    if p.zero_stage < 3:
        out.append(f"parallel.zero_stage={p.zero_stage + 1 if p.zero_stage < 2 else 3} (shard more model state)")
    tp = max(1, p.tp)
    if 2 * tp <= run.cluster.devices_per_node and (heads is None or heads % (2 * tp) == 0):
        out.append(f"parallel.tp={2 * tp} (weights and activations split over more GPUs of a node)")
    return out


def oom_message(run, rank: int, planned: int, allocated: int, reserved: int, total: int, written: str, heads=None):
    """One message for a CUDA out-of-memory on `rank` (bytes; `written`: the file with the details)."""
    plan = f"planned {planned / GiB:.2f} GiB" if planned > 0 else "no plan"
    helps = settings_that_help(run, heads)
    fix = "; ".join(helps) if helps else "a larger device or more devices (every memory setting is at its lowest)"
    return (
        f"rank {rank} ran out of GPU memory: {plan}, measured peak {allocated / GiB:.2f} GiB allocated / "
        f"{reserved / GiB:.2f} GiB reserved of {total / GiB:.2f} GiB (cluster.device_memory_gib="
        f"{run.cluster.device_memory_gib}). Settings that help: {fix}. Allocator details: {written}"
    )


def write_allocator_state(device: torch.device, folder: Path, rank: int) -> Path:
    """A memory snapshot (pickle, for pytorch.org/memory_viz) when memory history was being
    recorded, else the allocator's text summary; returns the file written."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        recording = any(torch.cuda.memory._snapshot().get("device_traces") or [])
    except Exception:  # noqa: BLE001 - the summary below still says something
        recording = False
    if recording:
        path = folder / f"memory-snapshot-rank-{rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        return path
    path = folder / f"memory-summary-rank-{rank}.txt"
    path.write_text(torch.cuda.memory_summary(device))
    return path


class GpuOutOfMemory(RuntimeError):
    """A CUDA out-of-memory, explained (`oom_message`)."""


def explain_oom(
    v, device: torch.device, run_dir: Path, rank: int, pp_rank: int, written: Optional[Path] = None
) -> GpuOutOfMemory:
    """The error to raise from a CUDA OOM on this rank, after writing the allocator's state (unless
    `written` names the file already holding it: train.memory_history's snapshot)."""
    from partrain.train.plan_check import Plan

    written = written or write_allocator_state(device, run_dir / "errors", rank)
    total = torch.cuda.get_device_properties(device).total_memory
    return GpuOutOfMemory(
        oom_message(
            v.run,
            rank,
            Plan.of(v).bytes_for(pp_rank),
            torch.cuda.max_memory_allocated(device),
            torch.cuda.max_memory_reserved(device),
            total,
            str(written),
            heads=v.facts.heads,
        )
    )
