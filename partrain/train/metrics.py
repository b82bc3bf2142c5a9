"""Where a run's numbers go: metrics.jsonl, TensorBoard, and progress events for the launcher.

Only rank 0 writes. Events are JSON lines on stdout behind a fixed prefix; the `partrain train`
process that started torchrun turns them into the live progress display and the summary.
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


def parse_event(line: str) -> Optional[dict]:
    if not line.startswith(EVENT_PREFIX):
        return None
    try:
        return json.loads(line[len(EVENT_PREFIX) :])
    except ValueError:
        return None


class MetricsWriter:
    """metrics.jsonl (one object a line, every step) and TensorBoard scalars when available."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.enabled = enabled
        self.file = None
        self.tb = None
        if not enabled:
            return
        self.file = open(run_dir / "metrics.jsonl", "a", buffering=1)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        except ImportError:
            log.warning("tensorboard is not installed; metrics go to metrics.jsonl only (pip install tensorboard)")

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record, default=float) + "\n")
        if self.tb is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self.tb.add_scalar(key, value, step)
                elif isinstance(value, list):  # per-expert values: one curve each
                    for i, item in enumerate(value):
                        self.tb.add_scalar(f"{key}/{i}", item, step)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.tb is not None:
            self.tb.close()
