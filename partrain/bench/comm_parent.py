"""The parent side of `partrain bench comm`: settings, the torchrun command, the terminal report.

No torch here: the CLI checks its input and starts the workers (`partrain.bench.comm`) before any
heavy import, and renders the profile they wrote. Under an existing torchrun or srun the CLI calls
the worker in-process instead (multi-node runs; see `partrain.bench.comm.run`).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping, Optional, Tuple

from partrain.blueprint.comm_profile import OPS, human_bytes
from partrain.runtime.torchrun import torchrun_command

PROGRESS = "partrain-bench: "
"""Prefix of the progress lines rank 0 prints; the parent shows them as a status line."""
FAILURE = "partrain-bench-error: "
"""Prefix of the one line a failing worker prints first (the parent shows the first one as the cause)."""
DEFAULT_SIZES = {"cpu": "1K,64K,1M,16M", "cuda": "1K,64K,1M,16M,256M"}
"""Message sizes per device type. The planner uses the largest one: GPUs need large messages to
reach their link bandwidth, gloo on CPU gets there by a few MB (and 256M would take long)."""


@dataclass(frozen=True)
class BenchSettings:
    """Everything a worker needs (passed as JSON on its command line; workers never run Hydra)."""

    name: str
    nodes: int
    devices_per_node: int
    backend: str
    device: str
    sizes: Tuple[int, ...]
    iters: int
    warmup: int
    out: str
    timeout_s: float = 300.0

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "BenchSettings":
        d = json.loads(text)
        d["sizes"] = tuple(d["sizes"])
        return cls(**d)


def default_out(cluster_name: str) -> Path:
    """runs/bench-comm/<cluster>-<timestamp>.json under the working folder (a new name each run)."""
    base = Path("runs") / "bench-comm" / f"{cluster_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base.with_suffix(".json"), 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}.json"), n + 1
    return path


def worker_command(s: BenchSettings) -> list:
    """torchrun starting `partrain.bench.comm SETTINGS_JSON` in every process of this machine."""
    return torchrun_command(s.devices_per_node, ["-m", "partrain.bench.comm", s.to_json()])


def launch(s: BenchSettings, status_console, environ: Mapping[str, str], threads: int) -> Tuple[int, str, str]:
    """Run the workers on this machine; (torchrun's exit code, the first worker failure line, the
    tail of their output: torchrun's own report comes last and rarely names the cause)."""
    env = dict(environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        worker_command(s), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
    )
    tail: deque = deque(maxlen=40)
    cause = ""
    with status_console.status(f"measuring {s.backend} collectives over {s.world_size} processes") as status:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(PROGRESS):
                status.update(f"measuring {line[len(PROGRESS) :].strip()}")
            elif line.startswith(FAILURE):
                cause = cause or line[len(FAILURE) :].strip()
            else:
                tail.append(line)
    return proc.wait(), cause, "".join(tail)


def render_profile(profile: dict, path: Optional[Path], console) -> None:
    """nccl-tests-like tables (one per link class and op), the planner summary, and where it went."""
    from rich.table import Table

    cl = profile["cluster"]
    for link, entry in profile["links"].items():
        for op in OPS:
            rec = entry["ops"].get(op)
            if rec is None:
                continue
            title = (
                f"{op} over {link} groups of {entry['group_size']} ({cl['backend']}, {cl['device']}; "
                f"bus factor {rec['bus_factor']:.3g})"
            )
            if not rec["supported"]:
                console.print(
                    f"[yellow]{title}: not supported by this backend[/yellow] ({rec.get('error', '')})", highlight=False
                )
                continue
            table = Table(title=title, title_justify="left")
            for col in ("size", "bytes", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
                table.add_column(col, justify="right")
            for r in rec["results"]:
                table.add_row(
                    human_bytes(r["bytes"]),
                    f"{r['bytes']:,}",
                    f"{r['time_s'] * 1e6:,.1f}",
                    f"{r['algbw']:.3f}",
                    f"{r['busbw']:.3f}",
                )
            console.print(table)
    summary = Table(
        title="bus bandwidth at the largest size (GB/s): what the planner uses with cluster.comm_profile",
        title_justify="left",
    )
    summary.add_column("link")
    for op in OPS:
        summary.add_column(op, justify="right")
    for link, ops in profile["summary"].items():
        summary.add_row(link, *(f"{ops[op]:.3f}" if op in ops else "-" for op in OPS))
    console.print(summary)
    if path is not None:
        console.print(
            f"profile written to [cyan]{path}[/cyan]; plan with it: partrain plan ... cluster.comm_profile={path}",
            highlight=False,
            soft_wrap=True,
        )


BENCH_KEYS = ("cluster.", "train.timeout_s", "train.threads_per_process")
"""Config keys a measurement depends on: only their problems stop `partrain bench comm`."""


def bench_problems(problems: list) -> list:
    """The validator's problems that matter to a measurement. A model, layout or batch that does
    not fit the cluster (say, the default tiny model's batch on cluster=h100x64) says nothing
    about its links, so it does not stop the bench; nor does cluster.comm_profile, the file a
    measurement may be about to (re)write."""
    return [p for p in problems if p.key.startswith(BENCH_KEYS) and p.key != "cluster.comm_profile"]


def _option_problems(size_text: str, iters: int, warmup: int, out: Optional[Path]) -> Tuple[list, list]:
    """(parsed sizes, problems) of the command's own options."""
    from partrain.blueprint.comm_profile import parse_sizes
    from partrain.errors import Problem

    problems = []
    try:
        parsed = parse_sizes(size_text)
    except ValueError as exc:
        parsed = []
        problems.append(
            Problem(
                "--sizes",
                size_text,
                f"must be a comma-separated list of positive byte counts: {exc}",
                "e.g. --sizes 1K,64K,1M,16M (K, M, G = 2**10, 2**20, 2**30 bytes)",
            )
        )
    if iters < 1:
        problems.append(Problem("--iters", iters, "must be >= 1 (timed calls per message size)", "e.g. --iters 20"))
    if warmup < 0:
        problems.append(Problem("--warmup", warmup, "must be >= 0 (untimed calls before timing)", "e.g. --warmup 5"))
    if out is not None and out.is_dir():
        problems.append(
            Problem("--out", str(out), "is a folder; the profile is one JSON file", f"e.g. --out {out / 'comm.json'}")
        )
    elif out is not None:
        from partrain.preflight import file_problems

        problems += file_problems("--out", out)
    return parsed, problems


def _cluster_problems(cl, dist_env, checked_so_far: bool) -> list:
    """What stops a measurement on this cluster config and launcher (processes, nodes, GPUs)."""
    from partrain.errors import Problem

    problems = []
    world = cl.nodes * cl.devices_per_node
    if world < 2:
        problems.append(
            Problem(
                "cluster.devices_per_node",
                cl.devices_per_node,
                "measuring communication needs at least 2 processes (nodes x devices_per_node)",
                "set cluster.devices_per_node=2 or more",
            )
        )
    if dist_env is None and cl.nodes > 1:
        problems.append(
            Problem(
                "cluster.nodes",
                cl.nodes,
                "a multi-node measurement needs a launcher on every node",
                "start `partrain bench comm ...` under torchrun (--nnodes, --rdzv-endpoint) or srun on each node",
            )
        )
    if dist_env is not None and (dist_env.world_size, dist_env.local_world_size) != (world, cl.devices_per_node):
        problems.append(
            Problem(
                "cluster.devices_per_node",
                cl.devices_per_node,
                f"the launcher started {dist_env.world_size} processes, {dist_env.local_world_size} per node, "
                f"but the cluster has {cl.nodes} x {cl.devices_per_node}",
                "set cluster.nodes and cluster.devices_per_node to what the launcher starts",
            )
        )
    if dist_env is None and cl.device == "cuda" and checked_so_far and not problems:
        import torch

        if torch.cuda.device_count() < cl.devices_per_node:
            problems.append(
                Problem(
                    "cluster.device",
                    "cuda",
                    f"the cluster has {cl.devices_per_node} GPUs per node, this machine {torch.cuda.device_count()}",
                    "use cluster=local-cpu, or fewer cluster.devices_per_node",
                )
            )
    return problems


def bench_settings(run, sizes: Optional[str], iters: int, warmup: int, out: Optional[Path], dist_env) -> BenchSettings:
    """Check the command's input against the composed run (a RunConfig whose cluster is valid);
    ConfigError (exit 2) before anything starts. `dist_env` is the launcher's DistEnv under
    torchrun / srun, else None."""
    from partrain.errors import ConfigError

    cl = run.cluster
    size_text = sizes if sizes is not None else DEFAULT_SIZES.get(cl.device, DEFAULT_SIZES["cpu"])
    if out is None:
        # Under a launcher every rank computes one; only rank 0 writes (and reports) its own.
        out = default_out(cl.name)
    parsed, problems = _option_problems(size_text, iters, warmup, out)
    problems += _cluster_problems(cl, dist_env, checked_so_far=not problems)
    if problems:
        raise ConfigError(problems)
    return BenchSettings(
        name=cl.name,
        nodes=cl.nodes,
        devices_per_node=cl.devices_per_node,
        backend=cl.backend,
        device=cl.device,
        sizes=tuple(parsed),
        iters=iters,
        warmup=warmup,
        out=str(out),
        timeout_s=float(run.train.timeout_s),
    )
