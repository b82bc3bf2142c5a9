"""An elastic run on one host, driven step by step: two `partrain train --node-rank K` launchers over
loopback, one node lost (its launcher SIGKILLed), then one rejoining; and the plain runs it is compared
with. Shared by tests/test_elastic.py (the shrink) and benchmarks/elastic.py (shrink and grow-back,
timed).

Node 1 is started first and node 0 (the rendezvous store's host) once node 1's torchrun runs: node 1
then waits at the store, both join torchrun's first round together (an elastic rendezvous otherwise
starts without a node that comes more than cluster.elastic_wait_s late), and node 1's torchrun, the
older process, gets global rank 0. The killed node is always node 1 (the store's host must stay), so
rank 0 moves to node 0 at the shrink: metrics continue in node 0's folder, and the layout-change
history, carried in the checkpoints, is whole there.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from partrain.rehearse.runs import train_all
from partrain.testing.parity import parity_args

GPT_3D_SHORT = [
    "recipe=gpt-3d",
    "train.seq_len=32",
    "data.max_bytes=200000",
    "train.timeout_s=30",
    "train.eval_every=0",
    "train.eval_batches=0",
]
"""gpt-3d's model in short, quiet runs: what the elastic test and benchmark start their nodes with."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, ready: Callable[[], bool], timeout_s: float, procs: Sequence = ()) -> float:
    """Seconds until `ready()`; RuntimeError after timeout_s or when a launcher in `procs` ended first."""
    start = time.monotonic()
    while not ready():
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a launcher ended while waiting for {what}: {[p.poll() for p in procs]}")
        time.sleep(0.2)
    return time.monotonic() - start


def metrics_lines(run_dir: Path) -> List[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if '"loss"' in line]


class ElasticRun:
    """Launchers of one elastic run under `tmp` (run folders tmp/<name>, output tmp/<name>.out)."""

    def __init__(self, tmp: Path, overrides: Sequence[str]) -> None:
        self.tmp = Path(tmp)
        self.overrides = list(overrides)
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.procs: Dict[str, subprocess.Popen] = {}
        self.order: List[str] = []

    def start(self, name: str, node_rank: int) -> subprocess.Popen:
        run_dir = self.tmp / name
        args = [*self.overrides, f"train.run_dir={run_dir}", "--node-rank", str(node_rank)]
        out = open(self.tmp / f"{name}.out", "w")  # noqa: SIM115 - the launcher writes it until it ends
        proc = subprocess.Popen(
            [sys.executable, "-m", "partrain.cli", "train", *args, "--rdzv-endpoint", self.endpoint],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[name] = proc
        self.order.append(name)
        return proc

    def start_two(self, timeout_s: float = 300) -> None:
        """Node 1 ("node1"), then node 0 ("node0") once node 1's torchrun runs (see the module doc)."""
        self.start("node1", 1)
        wait_for("node 1's torchrun", (self.tmp / "node1" / "logs" / "torchrun.log").exists, timeout_s)
        self.start("node0", 0)

    def steps_done(self) -> int:
        return max((r["step"] for name in self.order for r in metrics_lines(self.tmp / name)), default=0)

    def losses(self) -> Dict[int, float]:
        """{step: loss} over every folder rank 0 wrote to, later lines winning (a step trained again)."""
        out: Dict[int, float] = {}
        for name in self.order:
            for r in metrics_lines(self.tmp / name):
                out[r["step"]] = r["loss"]
        return out

    def changes(self, name: str = "node0") -> List[dict]:
        path = self.tmp / name / "layout_changes.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def kill_launcher(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def output(self, name: str) -> str:
        return (self.tmp / f"{name}.out").read_text(errors="replace")

    def live(self) -> List[subprocess.Popen]:
        return [p for p in self.procs.values() if p.returncode is None]

    def stop_all(self) -> None:
        for proc in self.live():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def layout_overrides(brief: dict) -> List[str]:
    """The plain (not auto, one node) overrides of a recorded layout."""
    return [
        "cluster.nodes=1",
        f"cluster.devices_per_node={brief['world_size']}",
        f"parallel.dp={brief['dp']}",
        f"parallel.tp={brief['tp']}",
        f"parallel.pp={brief['pp']}",
        f"parallel.sp={brief['sp']}",
        f"parallel.zero_stage={brief['zero_stage']}",
        f"train.micro_batch_size={brief['micro_batch_size']}",
    ]


def resumed_reference(
    common: Sequence[str], brief: dict, checkpoint: Path, run_dir: Path, steps: int, save_every: int = 0
) -> Dict[int, float]:
    """{step: loss} of a plain run of `brief`'s layout resuming from `checkpoint` (saving every
    save_every steps into run_dir/checkpoints, or nothing)."""
    over = [
        *common,
        *layout_overrides(brief),
        f"checkpoint.resume={checkpoint}",
        f"checkpoint.every_steps={save_every}",
    ]
    over += [f"checkpoint.dir={run_dir / 'checkpoints'}", "checkpoint.keep_last=100"]
    rec = _train(over, run_dir, steps)
    first = _first_step(checkpoint)
    return {first + i + 1: loss for i, loss in enumerate(rec.losses)}


def fresh_reference(common: Sequence[str], brief: dict, run_dir: Path, steps: int, save_every: int) -> Dict[int, float]:
    """{step: loss} of an uninterrupted plain run of `brief`'s layout, saving every save_every steps."""
    over = [*common, *layout_overrides(brief), f"checkpoint.every_steps={save_every}", "checkpoint.keep_last=100"]
    over.append(f"checkpoint.dir={run_dir / 'checkpoints'}")
    rec = _train(over, run_dir, steps)
    return {i + 1: loss for i, loss in enumerate(rec.losses)}


def _train(overrides: Sequence[str], run_dir: Path, steps: int):
    """A plain reference run in real processes through the worker's code (run folder run_dir/reference/run;
    its checkpoints where the overrides say): forked from preloaded processes, not a `partrain train` launch."""
    return train_all({"reference": parity_args(overrides, steps)}, run_dir)["reference"]


def _first_step(checkpoint: Path) -> int:
    return int(json.loads((Path(checkpoint) / "partrain.json").read_text())["step"])


def max_difference(got: Dict[int, float], want: Dict[int, float], steps: Optional[range] = None) -> float:
    keys = [s for s in (steps or sorted(want)) if s in want]
    missing = [s for s in keys if s not in got]
    if missing:
        raise AssertionError(f"steps {missing[:5]}... not trained by the elastic run")
    return max(abs(got[s] - want[s]) for s in keys)
