"""Profiler traces and CUDA memory history of a run (`train.profile_steps`, `train.memory_history`).

`train.profile_steps=[A, B]`: torch.profiler runs on every rank from the start of step A to the end
of step B (steps count from 1, as `step` in metrics.jsonl) and each rank writes its Chrome/Perfetto
trace to RUN_DIR/profile/rank-K.pt.trace.json. The `.pt.trace.json` ending is what TensorBoard's
profiler plugin looks for; ui.perfetto.dev and chrome://tracing open the file as it is. partrain's
own `record_function` ranges (partrain/forward, partrain/backward, partrain/optimizer, partrain/tp/...,
partrain/pp/..., ...) are in it beside torch's operators and collectives.

`train.memory_history=true` (CUDA only, refused on CPU by validation): the caching allocator records
every allocation from the first step; RUN_DIR/memory/rank-K.pickle is dumped at the end of the run's
second step and on out-of-memory (open it at pytorch.org/memory_viz).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

PROFILE_FOLDER = "profile"
MEMORY_FOLDER = "memory"
MEMORY_HISTORY_ENTRIES = 100_000
"""Allocator events kept (a ring buffer): torch's documented example size, enough for a few steps of
a large model's allocations while keeping the snapshot in the tens of MiB."""


def trace_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` writes its profiler trace."""
    return Path(run_dir) / PROFILE_FOLDER / f"rank-{rank}.pt.trace.json"


def memory_snapshot_path(run_dir: Path, rank: int) -> Path:
    """Where rank `rank` dumps its allocator history."""
    return Path(run_dir) / MEMORY_FOLDER / f"rank-{rank}.pickle"


@dataclass(frozen=True)
class ProfilingContext:
    """What a rank needs to know to profile: handed in by the worker, nothing read from the environment."""

    run_dir: Path
    rank: int
    device: torch.device
    profile_steps: Optional[Tuple[int, int]]
    """First and last step traced (1-based, inclusive); None = no trace."""
    memory_history: bool
    memory_dump_step: int
    """The step after which the allocator history is dumped: the run's second step (the last one when
    the run has fewer), so a snapshot covers warm-up and one steady step."""

    @classmethod
    def of(cls, run, run_dir: Path, rank: int, device: torch.device, first_step: int) -> "ProfilingContext":
        """From the run's config; first_step: steps already done (a resumed run starts after them)."""
        t = run.train
        window = tuple(t.profile_steps) if t.profile_steps else None
        return cls(
            run_dir=Path(run_dir),
            rank=rank,
            device=device,
            profile_steps=window,  # type: ignore[arg-type] - validated: two ints
            memory_history=bool(t.memory_history) and device.type == "cuda",
            memory_dump_step=min(first_step + 2, t.steps),
        )


class RunProfiling:
    """One rank's profiler and memory history over the training loop: `step(n)` around each step,
    `close()` once at the end (also after a failure), `on_oom()` from the out-of-memory handler."""

    def __init__(self, ctx: Optional[ProfilingContext] = None) -> None:
        self.ctx = ctx
        self._profiler = None
        self.written: List[Path] = []
        """Files this rank wrote (traces, snapshots), in order."""
        if ctx is not None and ctx.memory_history:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)

    @contextlib.contextmanager
    def step(self, number: int) -> Iterator[None]:
        """Around step `number` (1-based): the profiler starts before the window's first step and
        stops, writing the trace, after its last; the memory history is dumped after its step."""
        ctx = self.ctx
        if ctx is None:
            yield
            return
        if ctx.profile_steps and number == ctx.profile_steps[0]:
            self._start_profiler()
        if self._profiler is None:
            yield
        else:
            # The span torch's own profiler schedule gives each step: TensorBoard's profiler view and
            # Holistic Trace Analysis split iterations at ProfilerStep#N.
            from torch.profiler import record_function

            with record_function(f"ProfilerStep#{number}"):
                yield
        if ctx.profile_steps and number == ctx.profile_steps[1]:
            self._stop_profiler()
        if ctx.memory_history and number == ctx.memory_dump_step:
            self._dump_memory()

    def on_oom(self) -> Optional[Path]:
        """Dump the allocator history (the file to name in the out-of-memory message); None when not recorded."""
        if self.ctx is None or not self.ctx.memory_history:
            return None
        return self._dump_memory()

    def close(self) -> None:
        """A run that ended inside the window (stopped, failed) still writes the steps it traced."""
        if self._profiler is not None:
            self._stop_profiler()
        if self.ctx is not None and self.ctx.memory_history:
            torch.cuda.memory._record_memory_history(enabled=None)

    def record(self) -> Dict[str, str]:
        """This rank's files for its record in summary.json's `ranks` ({} when it wrote none)."""
        out = {}
        for path in self.written:
            out["profile_trace" if path.name.endswith(".pt.trace.json") else "memory_snapshot"] = str(path)
        return out

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.ctx.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # No shapes, stacks or memory events: they multiply the trace's size and the profiler's overhead.
        self._profiler = profile(activities=activities)
        self._profiler.start()

    def _stop_profiler(self) -> None:
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        path = trace_path(self.ctx.run_dir, self.ctx.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(path))
        self.written.append(path)

    def _dump_memory(self) -> Path:
        path = memory_snapshot_path(self.ctx.run_dir, self.ctx.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        if path not in self.written:
            self.written.append(path)
        return path


def profiling_summary(run, ranks: Sequence[dict]) -> dict:
    """summary.json's `profile` (the traced steps and every trace file, rank order) and
    `memory_snapshots` blocks, from the gathered rank records; {} when both switches are off."""
    out: dict = {}
    if run.train.profile_steps:
        traces = [r["profile_trace"] for r in ranks if r.get("profile_trace")]
        out["profile"] = {"steps": list(run.train.profile_steps), "traces": traces}
    if run.train.memory_history:
        out["memory_snapshots"] = [r["memory_snapshot"] for r in ranks if r.get("memory_snapshot")]
    return out
