"""Where a run's numbers go: metrics.jsonl, TensorBoard, and progress events.

Only rank 0 writes. Under partrain's launcher, events are JSON lines on stdout behind a fixed prefix;
the `partrain train` process that started torchrun turns them into the live progress display (or plain
lines) and the summary. Without it (srun, the user's own torchrun) rank 0 prints plain lines itself.
Which of the two is decided once, by the worker's entry point, and handed down as an `Events`.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Optional, TextIO

EVENT_PREFIX = "@@partrain "

log = logging.getLogger("partrain")


def emit(event: str, stream: TextIO = sys.stdout, **fields) -> None:
    try:
        stream.write(EVENT_PREFIX + json.dumps({"event": event, **fields}, default=float) + "\n")
        stream.flush()
    except BrokenPipeError:  # the launcher reading the events was killed: the run goes on (or stops) without it
        pass


class Events:
    """Where rank 0's progress events go; this base class drops them (every other rank)."""

    def __call__(self, event: str, **fields) -> None:
        pass


class LauncherEvents(Events):
    """JSON event lines for `partrain train`, which started torchrun and reads rank 0's stdout."""

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        self.stream = stream

    def __call__(self, event: str, **fields) -> None:
        emit(event, self.stream or sys.stdout, **fields)


class PlainEvents(Events):
    """Plain text lines on stdout: rank 0 started by srun or the user's torchrun, whose stdout is the
    log a person reads (SLURM output file, CI log, a pipe)."""

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        self.stream = stream

    def __call__(self, event: str, **fields) -> None:
        from partrain.train.progress_text import event_line, summary_lines

        record = {"event": event, **fields}
        lines = summary_lines(record) if event == "summary" else [event_line(record)]
        stream = self.stream or sys.stdout
        try:
            for line in lines:
                if line:
                    stream.write(line + "\n")
            stream.flush()
        except BrokenPipeError:
            pass


def parse_event(line: str) -> Optional[dict]:
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        return json.loads(line[len(EVENT_PREFIX) :])
    except ValueError:
        return None


class MetricsWriter:
    """metrics.jsonl (one object a line, every step) and the trackers of train.loggers (namespaced scalars)."""

    def __init__(self, run_dir: Path, enabled: bool, run=None, tracker_memory=None) -> None:
        """tracker_memory: a trackers.TrackerMemory that counts what the trackers add to the process."""
        self.enabled = enabled
        self.file = None
        self.trackers: list = []
        if not enabled:
            return
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        if run is not None:
            from partrain.train.trackers import open_trackers

            self.trackers = open_trackers(run_dir, run, tracker_memory)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record, default=float) + "\n")
        if self.trackers:
            from partrain.train.trackers import namespaced

            scalars = namespaced(record)
            for tracker in self.trackers:
                tracker.log(scalars, record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        from partrain.train.trackers import close_all

        close_all(self.trackers)
