"""`partrain bench dp-sync` workers: time each gradient-sync strategy on this cluster for the
model's gradient sizes, counting the bytes each rank really sends.

Every process is a data-parallel rank (world = nodes x devices_per_node). Each holds real fp32
tensors shaped like the model's parameters with gradients, and for every strategy runs `warmup`
untimed and `iters` timed steps of its sync (allreduce, ring and hierarchical: bucket by bucket as
backward would launch them; parameter-server: push, clip, update, pull; also with dedicated
servers when the world leaves workers). Per strategy it reports the median step time (slowest
rank) and, from the byte counters (`partrain.parallel.dp_sync.counter`), bytes sent and received
per rank per step. Rank 0 writes the JSON the parent renders.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, List

import torch
import torch.distributed as dist
from torch import nn

from partrain.blueprint.layout import Layout
from partrain.parallel.dp_sync.buckets import make_buckets
from partrain.parallel.dp_sync.counter import CommCounter
from partrain.parallel.dp_sync.groups import dp_groups
from partrain.parallel.dp_sync.param_server import ParameterServer
from partrain.parallel.dp_sync.strategies import flat_all_reduce
from partrain.runtime.context import DistEnv, from_environ
from partrain.runtime.lifecycle import joined_group, leave

PROGRESS = "partrain-bench: "
FAILURE = "partrain-bench-error: "


def _params(numels: List[List[int]], seed: int) -> List[dict]:
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for decay, sizes in zip((0.1, 0.0), numels):
        params = [nn.Parameter(torch.randn(n, generator=gen)) for n in sizes]
        groups.append({"params": params, "weight_decay": decay})
    return [g for g in groups if g["params"]]


def _fill_grads(groups: List[dict], step: int, rank: int) -> None:
    for g in groups:
        for i, p in enumerate(g["params"]):
            p.grad = torch.full_like(p, float((step + i + rank) % 7 + 1) * 1e-3)


def _flat_step(name: str, groups, dp, p2p, counter, bucket_mb: float) -> Callable[[int], None]:
    params = [p for g in groups for p in g["params"]]
    buckets = make_buckets(params, bucket_mb)
    strategy = flat_all_reduce(name, dp, None if name == "allreduce" else p2p, counter)

    def step(i: int) -> None:
        _fill_grads(groups, i, dist.get_rank())
        for b in buckets:
            torch.cat([p.grad.reshape(-1) for p in b.params], out=b.flat)
            strategy.mean_(b.flat)

    return step


def _server_step(groups, dp, p2p, counter, servers: int, dedicated: bool) -> Callable[[int], None]:
    ps = ParameterServer(
        groups, dp, servers, lambda gs: torch.optim.AdamW(gs, lr=1e-4, foreach=False), counter, p2p, None, dedicated
    )

    def step(i: int) -> None:
        _fill_grads(groups, i, dist.get_rank())
        ps.push_gradients()
        ps.clip(1.0)
        ps.step()

    return step


def _time(step: Callable[[int], None], counter: CommCounter, iters: int, warmup: int, per_node: int) -> dict:
    for i in range(warmup):
        step(i)
    counter.reset()
    times = []
    for i in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        step(warmup + i)
        times.append(time.perf_counter() - t0)
    node = dist.get_rank() // per_node
    return {
        "inter_node_bytes": sum(b for r, b in counter.to_peer.items() if r // per_node != node) / iters,
        "seconds": statistics.median(times),
        "sent_bytes": counter.sent_bytes / iters,
        "recv_bytes": counter.recv_bytes / iters,
        "messages": counter.messages / iters,
    }


def measure(s: dict, env: DistEnv, progress) -> dict:
    layout = Layout(dp=env.world_size, devices_per_node=s["devices_per_node"])
    dp = dp_groups(layout, env.rank)
    p2p = dist.new_group()
    rows = {}
    for case in s["cases"]:
        progress(f"{case['label']} over {env.world_size} ranks")
        groups = _params(s["numels"], seed=0)
        counter = CommCounter()
        if case["strategy"] == "parameter-server":
            step = _server_step(groups, dp, p2p, counter, case["servers"], case["dedicated"])
        else:
            step = _flat_step(case["strategy"], groups, dp, p2p, counter, s["bucket_mb"])
        mine = _time(step, counter, s["iters"], s["warmup"], s["devices_per_node"])
        gathered: List = [None] * env.world_size
        dist.all_gather_object(gathered, mine)
        rows[case["label"]] = {
            "seconds": max(g["seconds"] for g in gathered),
            "sent_bytes": [g["sent_bytes"] for g in gathered],
            "recv_bytes": [g["recv_bytes"] for g in gathered],
            "messages": [g["messages"] for g in gathered],
            "inter_node_bytes": [g["inter_node_bytes"] for g in gathered],
        }
    return rows


def run(s: dict, env: DistEnv) -> int:
    progress = (lambda text: print(PROGRESS + text, flush=True)) if env.is_main else (lambda text: None)
    try:
        if env.world_size != s["nodes"] * s["devices_per_node"]:
            raise RuntimeError(
                f"the cluster has {s['nodes'] * s['devices_per_node']} processes, torchrun started {env.world_size}"
            )
        torch.set_num_threads(max(1, s["threads"]))
        with joined_group(s["backend"], env.rank, env.world_size, s["timeout_s"], init_method=env.init_method):
            rows = measure(s, env, progress)
            if env.is_main:
                Path(s["out"]).parent.mkdir(parents=True, exist_ok=True)
                Path(s["out"]).write_text(json.dumps({"measured": rows}, indent=1))
        return 0
    except BaseException as exc:  # noqa: BLE001 - report this rank's failure; torchrun stops the rest
        first = f"rank {env.rank}: {type(exc).__name__}: {exc}".splitlines()[0]
        print(f"{FAILURE}{first}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1


def entry() -> None:
    env = from_environ(os.environ)
    if env is None or len(sys.argv) != 2:
        print("partrain.bench.dp_sync is started by `partrain bench dp-sync` (under torchrun)", file=sys.stderr)
        leave(2)
    leave(run(json.loads(sys.argv[1]), env))


if __name__ == "__main__":
    entry()
