"""The worker side of `partrain bench comm`: time collectives with torch.distributed, nccl-tests style.

Started by the CLI through torchrun (`python -m partrain.bench.comm SETTINGS_JSON`), or called
in-process by `partrain bench comm` run under the user's own torchrun / srun (multi-node).

What is measured (see profile.py for the file and the bandwidth conventions):
- link classes the planner distinguishes: "intra" = the ranks of one node, "inter" = one rank per
  node (only when nodes > 1), plus "world" = every rank (nodes > 1, informative). Every group of a
  class runs at the same time (all nodes' intra groups together, all local ranks' inter groups
  together), as they do in training, so shared NICs or memory bandwidth show up;
- ops all_reduce, all_gather (all_gather_single, formerly all_gather_into_tensor), reduce_scatter
  (reduce_scatter_single / reduce_scatter_tensor), all_to_all (all_to_all_single) and send_recv
  (each rank sends to the next rank of its group and receives from the previous one, batched as in
  nccl-tests' sendrecv);
- per message size: `warmup` untimed calls, a barrier, `iters` timed calls; a rank's time is its
  mean per call and the reported time the slowest rank's (all-reduce MAX), as in nccl-tests.
Before timing, each op runs once on small known values and its result is checked: a backend
that lacks an op is recorded as unsupported (never emulated), a wrong result stops the bench.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
import traceback
from typing import Callable, Dict, List, Tuple

from partrain.bench.comm_parent import FAILURE, PROGRESS, BenchSettings
from partrain.blueprint.comm_profile import (
    OPS,
    bus_factor,
    make_profile,
    result,
    write_profile,
)
from partrain.runtime.context import DistEnv, from_environ
from partrain.runtime.lifecycle import joined_group, leave

TORCH_OPS = {
    "all_reduce": ("all_reduce",),
    "all_gather": ("all_gather_single", "all_gather_into_tensor"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor"),
    "all_to_all": ("all_to_all_single",),
    "send_recv": ("batch_isend_irecv",),
}
"""torch.distributed calls per op, newest name first (torch 2.13 renamed the flat-tensor collectives
*_single and deprecates the *_into_tensor / *_tensor names; older torch has only those)."""
ELEMENT_BYTES = 4
"""float32: every backend reduces it (gloo's bf16 reductions are slower paths, not link speed)."""


def torch_op(op: str) -> str:
    import torch.distributed as dist

    return next(name for name in TORCH_OPS[op] if hasattr(dist, name))


def link_groups(nodes: int, devices_per_node: int) -> Dict[str, List[List[int]]]:
    """The groups of each link class (ranks are laid out node by node, as torchrun and srun do)."""
    world = nodes * devices_per_node
    out: Dict[str, List[List[int]]] = {}
    if devices_per_node > 1:
        out["intra"] = [list(range(k * devices_per_node, (k + 1) * devices_per_node)) for k in range(nodes)]
    if nodes > 1:
        out["inter"] = [list(range(local, world, devices_per_node)) for local in range(devices_per_node)]
        if devices_per_node > 1:
            out["world"] = [list(range(world))]
    return out


class _Bench:
    """One rank's measurement: its device, its group of each link class, the op runners."""

    def __init__(self, s: BenchSettings, env: DistEnv):
        import torch

        self.torch, self.s, self.env = torch, s, env
        self.device = torch.device("cuda", env.local_rank) if s.device == "cuda" else torch.device("cpu")
        self.dtype = torch.float32
        self.error = ""

    def sync(self) -> None:
        if self.device.type == "cuda":  # CUDA collectives return before the transfer ends
            self.torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(device_ids=[self.env.local_rank] if self.device.type == "cuda" else None)

    def world_max(self, value: float) -> float:
        import torch.distributed as dist

        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def world_mean(self, value: float) -> float:
        import torch.distributed as dist

        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t.item()) / self.env.world_size

    def runner(self, op: str, count: int, group, members: List[int]):
        """(call, input, output) for `op` on `count` elements (the full size; chunks are count / n)."""
        import torch.distributed as dist

        torch, n, me = self.torch, len(members), members.index(self.env.rank)
        empty = lambda k: torch.zeros(k, dtype=self.dtype, device=self.device)  # noqa: E731
        chunk = count // n
        if op == "all_reduce":
            x = empty(count)
            return (lambda: dist.all_reduce(x, group=group)), x, x
        if op == "all_gather":
            x, out = empty(chunk), empty(count)
            gather = getattr(dist, torch_op(op))
            return (lambda: gather(out, x, group=group)), x, out
        if op == "reduce_scatter":
            x, out = empty(count), empty(chunk)
            scatter = getattr(dist, torch_op(op))
            return (lambda: scatter(out, x, group=group)), x, out
        if op == "all_to_all":
            x, out = empty(count), empty(count)
            return (lambda: dist.all_to_all_single(out, x, group=group)), x, out
        if op == "send_recv":
            x, out = empty(count), empty(count)
            nxt, prev = members[(me + 1) % n], members[(me - 1) % n]

            def call():
                ops = [dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, out, prev, group)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()

            return call, x, out
        raise ValueError(op)

    def check(self, op: str, group, members: List[int]) -> int:
        """Run `op` once on known values: 0 right, 1 the backend refused it, 2 a wrong result."""
        torch, n = self.torch, len(members)
        me = members.index(self.env.rank)
        k = 4 * n
        try:
            call, x, out = self.runner(op, k, group, members)
            x.fill_(float(me + 1))  # rank i of the group contributes i + 1
            call()
            self.sync()
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as exc:
            self.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            return 1
        ranks = torch.arange(1, n + 1, dtype=self.dtype, device=self.device)
        total = float(n * (n + 1) // 2)
        expected = {
            "all_reduce": torch.full((k,), total, dtype=self.dtype, device=self.device),
            "all_gather": ranks.repeat_interleave(k // n),
            "reduce_scatter": torch.full((k // n,), total, dtype=self.dtype, device=self.device),
            "all_to_all": ranks.repeat_interleave(k // n),
            "send_recv": torch.full((k,), float((me - 1) % n + 1), dtype=self.dtype, device=self.device),
        }[op]
        return 0 if torch.equal(out, expected) else 2

    def time_op(self, op: str, count: int, group, members: List[int]) -> Tuple[float, float]:
        """(slowest rank's mean seconds per call, the ranks' mean CPU seconds per call), over every
        group of the class running at once. The CPU time is the whole process's (the backend's
        threads too): what a call costs the cores that ranks sharing them could have computed on."""
        call, _, _ = self.runner(op, count, group, members)
        for _ in range(self.s.warmup):
            call()
        self.sync()
        self.barrier()  # every group of the class starts together
        cpu, start = time.process_time(), time.perf_counter()
        for _ in range(self.s.iters):
            call()
        self.sync()
        wall, cpu = (time.perf_counter() - start) / self.s.iters, (time.process_time() - cpu) / self.s.iters
        return self.world_max(wall), self.world_mean(cpu)


def measure(s: BenchSettings, env: DistEnv, progress: Callable[[str], None] = lambda text: None) -> dict:
    """Every link class x op x size; returns the profile (complete on every rank)."""
    import torch
    import torch.distributed as dist

    bench = _Bench(s, env)
    links: Dict[str, dict] = {}
    for link, groups in link_groups(s.nodes, s.devices_per_node).items():
        # new_subgroups_by_enumeration: every rank creates every group (collective), keeps its own.
        group = (
            None
            if len(groups) == 1 and len(groups[0]) == env.world_size
            else dist.new_subgroups_by_enumeration(groups)[0]
        )
        members = next(g for g in groups if env.rank in g)
        n = len(members)
        ops: Dict[str, dict] = {}
        for op in OPS:
            progress(f"{op} over {link} groups of {n}")
            bench.error = ""
            verdict = int(bench.world_max(float(bench.check(op, group, members))))
            rec: dict = {
                "supported": verdict != 1,
                "torch_op": torch_op(op),
                "bus_factor": bus_factor(op, n),
                "results": [],
            }
            if verdict == 2:
                raise RuntimeError(f"{op} over {link} groups returned a wrong result on {s.backend}")
            if verdict == 1:
                rec["error"] = bench.error or "refused on another rank"
            else:
                for nbytes in s.sizes:
                    count = max(n, nbytes // ELEMENT_BYTES // n * n)  # a whole number of chunks
                    progress(f"{op} over {link} groups of {n}: {count * ELEMENT_BYTES:,} bytes")
                    t, cpu = bench.time_op(op, count, group, members)
                    rec["results"].append(result(count * ELEMENT_BYTES, t, rec["bus_factor"], cpu))
            ops[op] = rec
        links[link] = {"group_size": n, "groups": groups, "ops": ops}
    cluster = {
        "name": s.name,
        "nodes": s.nodes,
        "devices_per_node": s.devices_per_node,
        "backend": s.backend,
        "device": s.device,
    }
    settings = {"dtype": "float32", "sizes": list(s.sizes), "iters": s.iters, "warmup": s.warmup}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    profile = make_profile(
        cluster, links, settings, torch_version=torch.__version__, hostname=socket.gethostname(), date=date
    )
    return profile


def run(s: BenchSettings, env: DistEnv, show_progress: bool = True) -> tuple:
    """Measure and (rank 0) write the profile; (exit code, profile or None). Leaves the process
    group destroyed; the caller ends the process with `lifecycle.leave` (gloo may abort at normal exit)."""
    import torch

    progress = (
        (lambda text: print(PROGRESS + text, flush=True)) if show_progress and env.is_main else (lambda text: None)
    )
    try:
        if env.world_size != s.world_size:
            raise RuntimeError(
                f"the cluster has {s.world_size} processes (nodes x devices_per_node) but the launcher "
                f"started {env.world_size}"
            )
        if s.device == "cuda":
            torch.cuda.set_device(env.local_rank)
        with joined_group(s.backend, env.rank, env.world_size, s.timeout_s, init_method=env.init_method):
            profile = measure(s, env, progress)
            if env.is_main:
                write_profile(s.out, profile)
        return 0, profile
    except BaseException as exc:  # noqa: BLE001 - report this rank's failure and exit; torchrun stops the rest
        first = f"rank {env.rank}: {type(exc).__name__}: {exc}".splitlines()[0]
        print(f"{FAILURE}{first}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1, None


def entry() -> None:
    env = from_environ(os.environ)
    if env is None or len(sys.argv) != 2:
        print("partrain.bench.comm is started by `partrain bench comm` (under torchrun)", file=sys.stderr)
        leave(2)
    code, _ = run(BenchSettings.from_json(sys.argv[1]), env)
    leave(code)


if __name__ == "__main__":
    entry()
