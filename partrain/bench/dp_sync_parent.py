"""The parent side of `partrain bench dp-sync`: check the config, start the workers
(`partrain.bench.dp_sync`) under torchrun, and show each strategy's measured figures beside the
planner's prediction (`partrain.blueprint.planner.dp_sync_cost`). No torch here."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path
from typing import List, Sequence, Tuple

from partrain.blueprint.comm_profile import human_bytes
from partrain.blueprint.config.local_gpus import NO_GPUS
from partrain.blueprint.planner.dp_sync_cost import sync_cost
from partrain.blueprint.planner.spec import cluster_spec
from partrain.blueprint.validate_dp_sync import DEDICATED_RULE
from partrain.errors import ConfigError, Problem
from partrain.runtime.torchrun import torchrun_command

MAX_GRAD_BYTES = 1 << 30
"""Largest gradient a bench rank allocates (fp32); bigger models are refused (the bench holds real tensors)."""


def validated(overrides: Sequence[str], recipe_dirs: Sequence[str], gpus=NO_GPUS):
    """The composed run (on a machine with `gpus`), checked as train checks it, except the rule only this
    bench lifts."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate

    run = compose(list(overrides), recipe_dirs, gpus)
    try:
        validate(run)
    except ConfigError as err:
        rest = [p for p in err.problems if p.rule != DEDICATED_RULE]
        if rest:
            raise ConfigError(rest) from None
    return run


def parameter_numels(run) -> List[List[int]]:
    """[[numel of each weight-decayed tensor], [numel of each other one]] of the model (meta build)."""
    from partrain.models.build import build_meta_model

    model = build_meta_model(run.model)
    decay, other = [], []
    for _, p in model.named_parameters():
        (decay if p.dim() >= 2 else other).append(p.numel())
    total = 4 * (sum(decay) + sum(other))
    if total > MAX_GRAD_BYTES:
        raise ConfigError(
            Problem(
                "model",
                run.model.name or run.model.arch,
                f"its fp32 gradients ({human_bytes(total)}) exceed the bench limit of {human_bytes(MAX_GRAD_BYTES)}",
                "bench a smaller model of the same family; the planner scales the figures (partrain plan)",
            )
        )
    return [decay, other]


def cases(run, world: int) -> List[dict]:
    p = run.parallel
    servers = min(p.ps_servers, world)
    out = [{"label": s, "strategy": s, "servers": 1, "dedicated": False} for s in ("allreduce", "ring", "hierarchical")]
    out.append(
        {
            "label": f"parameter-server x{servers}",
            "strategy": "parameter-server",
            "servers": servers,
            "dedicated": False,
        }
    )
    if world > servers:
        out.append(
            {
                "label": f"parameter-server x{servers} dedicated",
                "strategy": "parameter-server",
                "servers": servers,
                "dedicated": True,
            }
        )
    return out


def settings(run, numels, iters: int, warmup: int, out: Path, threads: int) -> dict:
    cl = run.cluster
    world = cl.nodes * cl.devices_per_node
    return {
        "nodes": cl.nodes,
        "devices_per_node": cl.devices_per_node,
        "backend": cl.backend,
        "numels": numels,
        "bucket_mb": run.parallel.dp_bucket_mb,
        "cases": cases(run, world),
        "iters": iters,
        "warmup": warmup,
        "out": str(out),
        "threads": threads,
        "timeout_s": float(run.train.timeout_s),
    }


def default_out(cluster_name: str) -> Path:
    base = Path("runs") / "bench-dp-sync" / f"{cluster_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base.with_suffix(".json"), 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}.json"), n + 1
    return path


def launch(s: dict, environ, threads: int) -> Tuple[int, str]:
    """Run the workers on this machine; (exit code, the tail of their output)."""
    cmd = torchrun_command(s["devices_per_node"] * s["nodes"], ["-m", "partrain.bench.dp_sync", json.dumps(s)])
    env = dict(environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    return proc.returncode, proc.stdout[-4000:]


def report(run, s: dict, measured: dict) -> dict:
    """Per strategy: measured time and bytes (mean per rank, busiest rank) beside the prediction."""
    cluster = cluster_spec(run.cluster)
    members = list(range(s["nodes"] * s["devices_per_node"]))
    grad_bytes = 4 * sum(sum(g) for g in s["numels"])
    buckets = max(1, -(-grad_bytes // int(s["bucket_mb"] * 2**20)))
    rows = []
    for case in s["cases"]:
        m = measured[case["label"]]
        predicted = sync_cost(
            case["strategy"], cluster, members, grad_bytes, buckets, case["servers"], case["dedicated"]
        )
        sent = m["sent_bytes"]
        rows.append(
            {
                "strategy": case["label"],
                "seconds": m["seconds"],
                "bytes_per_rank": sum(sent) / len(sent),
                "busiest_bytes": max(sent),
                "busiest_rank": sent.index(max(sent)),
                "inter_node_bytes": max(m["inter_node_bytes"]),
                "sent_bytes": sent,
                "recv_bytes": m["recv_bytes"],
                "predicted": dataclasses.asdict(predicted),
            }
        )
    return {
        "cluster": {"name": run.cluster.name, "nodes": s["nodes"], "devices_per_node": s["devices_per_node"]},
        "grad_bytes": grad_bytes,
        "bucket_mb": s["bucket_mb"],
        "bandwidth_source": cluster.bandwidth_source,
        "rows": rows,
    }


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def render(rep: dict, console) -> None:
    from rich.table import Table

    cl, g = rep["cluster"], rep["grad_bytes"]
    table = Table(
        title=f"gradient sync per step, {cl['nodes']} x {cl['devices_per_node']} ranks, gradients G = {_mb(g)} "
        f"per rank; plan = the planner's alpha-beta model ({rep['bandwidth_source']} bandwidths)",
        title_justify="left",
    )
    cols = ("strategy", "ms", "plan ms", "sent/rank", "xG", "plan xG", "busiest rank", "xG", "plan xG", "inter-node xG")
    for col in cols:
        table.add_column(col, justify="right")
    for r in rep["rows"]:
        p = r["predicted"]
        table.add_row(
            r["strategy"],
            f"{r['seconds'] * 1e3:,.2f}",
            f"{p['seconds'] * 1e3:,.2f}",
            _mb(r["bytes_per_rank"]),
            f"{r['bytes_per_rank'] / g:.3f}",
            f"{p['bytes_per_rank'] / g:.3f}",
            f"{_mb(r['busiest_bytes'])} (r{r['busiest_rank']})",
            f"{r['busiest_bytes'] / g:.3f}",
            f"{p['busiest_bytes'] / g:.3f}",
            f"{r['inter_node_bytes'] / g:.3f} | {p['inter_node_bytes'] / g:.3f}",
        )
    console.print(table)
    console.print(
        "sent = bytes a rank sent per step, counted at every send/recv; xG = in gradient sizes; inter-node = the most "
        "one rank sent across nodes, measured | planned. allreduce counts the bytes handed to the backend's collective "
        "(its wire bytes are not visible; its inter-node bytes are not counted).",
        highlight=False,
    )
