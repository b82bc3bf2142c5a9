"""A node's real rank steps, all at once: the compute profile's "host.rank_steps" block (CPU only).

host_costs.py times the pieces of a CPU rank's step one at a time, in one process with the machine to
itself. In a run, a node's ranks share its cores, and each rank's own work then costs more CPU than the
same work alone (every switch between the processes sharing a core refills its caches), and a step holds
work no piece covers (the pipeline schedule's bookkeeping, the gradient sync's flattening, the loss's
ends). This bench measures the real thing: each of the first node's ranks runs in a process of its own,
all of them at once, as that rank of the layout's full world on torch's fake process group (every
collective returns at once, no peers exist). `train.assemble.build_engine` builds the rank's shard and
engine exactly as a worker does, and a step is the trainer's: zero grad, forward + backward (the pipeline
schedule under pp), the loss's share, the gradient clip, the optimizer step. Timed: each rank's process
CPU per step, the median of the steps it ran while every rank was still running. Two answers the fake
group cannot give are supplied: the pipeline stages' first-step vote on their shapes (`_static_pipeline_vote`)
and DDP's bucket all-reduce result (`_answer_ddp_buckets`). Each rank is a fresh interpreter, talking
to this one over its stdin and stdout (ready, go, timed, stop), so the caller's own main module never
runs again in the children and a rank that dies is seen at once.

The collectives' own CPU is not in it (they return at once): `partrain bench comm` measures that, and
the planner adds it per call. The block keeps measurements only: the profiled layout (its PlanSpec
fields, compute_profile.RANK_STEPS_LAYOUT_KEYS) and, per rank, its pipeline rank and its CPU per step.
The planner compares them with what it counts for that layout at plan time (planner/cpu_host.py), so a
change to its formula never leaves a stale figure in a profile.

Not measured (the block is left out, and the planner counts the pieces as they are): GPU runs; expert
parallelism (the token exchange sizes its buffers from what peers send, and a fake peer sends nothing);
pipelines whose stages infer their shapes from their peers at the first step (16-bit autocast,
Megatron-SP); a node whose ranks' predicted memory would not fit in half of this machine's available
memory.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

STEPS = 8
"""Timed steps per rank (after WARMUP untimed ones)."""
WARMUP = 3
"""Untimed first steps: the allocator, the optimizer's state and the schedule's buffers settle."""
TIMEOUT_S = 600.0
"""The longest the whole measurement may take before it is given up (the block is then left out)."""
MEMORY_SHARE = 0.5
"""Of this machine's available memory, the most the node's ranks may be predicted to take."""


def node_ranks(v) -> List[int]:
    """The first node's ranks: the ones that share its cores in a run."""
    return list(range(min(v.run.cluster.devices_per_node, v.layout.world_size)))


def _available_bytes() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def why_not(v, rank_bytes: float) -> Optional[str]:
    """Why this run's rank steps cannot be measured here (None: they can). `rank_bytes` is the
    planner's predicted memory of one rank."""
    from partrain.train.assemble import static_stage_shapes

    if v.run.cluster.device != "cpu":
        return "not a CPU run"
    if v.layout.ep > 1:
        return "expert parallelism sizes its token exchange from what peers send (a fake peer sends nothing)"
    if v.layout.pp > 1 and not static_stage_shapes(v):
        return "the pipeline stages infer their shapes from their peers at the first step"
    need, have = rank_bytes * len(node_ranks(v)), _available_bytes() * MEMORY_SHARE
    if need > have:
        return f"the node's ranks would take {need / 2**30:.1f} GiB, more than half of this machine's free memory"
    return None


@contextlib.contextmanager
def _static_pipeline_vote():
    """torch's pipeline stages vote at their first step on whether every stage knows its shapes; on the
    fake process group the vote received is a zero (nothing is sent), which would make them exchange
    metadata with peers that do not exist. partrain only measures stages that do know their shapes
    (`why_not`), so the vote they would have reached is 'static'."""
    from torch.distributed.pipelining import stage as stage_module

    cls = stage_module.PipelineStage
    original = getattr(cls, "_warmup_backward_result", None)
    if original is None:  # another torch: no vote to fix
        yield
        return

    def vote(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        return result.fill_(1) if result is not None else result

    cls._warmup_backward_result = vote
    try:
        yield
    finally:
        cls._warmup_backward_result = original


def _answer_ddp_buckets(engine) -> None:
    """DDP's reducer expects its bucket's all-reduce to hand back a tensor; the fake group's hands back
    nothing. A hook that returns the bucket as it is stands in for it (the call's CPU is bench comm's)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    def done(_state, bucket):
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    dp = getattr(engine, "dp", None)
    for module in [getattr(dp, "module", None), *getattr(engine, "stages", [])]:
        if isinstance(module, DistributedDataParallel):
            module.register_comm_hook(None, done)


def _rank_main(v, rank: int, threads: int, say: Callable[[str], None], told: Callable[[], Optional[str]]) -> None:
    """One rank's process: build, warm up, say "ready" and wait for "go" (every rank ready), time STEPS
    steps and say "timed <seconds>", then keep stepping (untimed) until told "stop" (every rank has timed
    its own), so that none is timed on a quieter node."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from partrain.runtime.mesh import build_mesh
    from partrain.train.assemble import build_engine

    torch.set_num_threads(threads)
    # Received activations are whatever the buffers held: no denormals, whose arithmetic is slow.
    torch.set_flush_denormal(True)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=v.layout.world_size)
    with _static_pipeline_vote():
        engine = build_engine(v, build_mesh(v.layout, "cpu"), torch.device("cpu"))
        _answer_ddp_buckets(engine)
        g = torch.Generator().manual_seed(rank)
        shape = (v.microbatches * v.run.train.micro_batch_size, v.run.train.seq_len)
        inputs, labels = (torch.randint(0, v.facts.vocab, shape, generator=g) for _ in range(2))

        def step() -> None:
            engine.optimizer.zero_grad(set_to_none=True)
            loss = engine.forward_backward(inputs, labels, 1.0)
            engine.share_loss(loss)
            engine.clip(v.run.optim.grad_clip)
            engine.optimizer.step()

        for _ in range(WARMUP):
            step()
        say("ready")
        while (word := told()) != "go":
            if word == "stop":  # another rank failed: nothing will be timed
                return
            time.sleep(0.01)
        times = []
        for _ in range(STEPS):
            t0 = time.process_time()
            step()
            times.append(time.process_time() - t0)
        say(f"timed {sorted(times)[len(times) // 2]!r}")
        while told() != "stop":
            step()


def _child_main(argv: List[str]) -> int:
    """`python -m partrain.bench.cpu.rank_steps RUN_PICKLE RANK THREADS`: one rank, talking on stdin/stdout."""
    import pickle
    import select
    import sys

    with open(argv[0], "rb") as f:
        v = pickle.load(f)

    def say(line: str) -> None:
        print(line, flush=True)

    def told() -> Optional[str]:
        if not select.select([sys.stdin], [], [], 0)[0]:
            return None
        return sys.stdin.readline().strip() or "stop"  # the parent gone: stop

    try:
        _rank_main(v, int(argv[1]), int(argv[2]), say, told)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which leaves the block out
        say(f"error {type(e).__name__}: {e}"[:300].replace("\n", " "))
        return 1
    return 0


def _read_lines(procs: Dict[int, "object"], deadline: float) -> Tuple[Dict[int, str], str]:
    """The next line from every rank in `procs` ({rank: line}, ""), or ({}, what went wrong)."""
    import select

    lines: Dict[int, str] = {}
    while len(lines) < len(procs):
        waiting = {p.stdout: r for r, p in procs.items() if r not in lines}
        left = deadline - time.monotonic()
        if left <= 0:
            return {}, f"the ranks did not finish within {TIMEOUT_S:.0f} s"
        for stream in select.select(list(waiting), [], [], min(left, 1.0))[0]:
            rank, line = waiting[stream], stream.readline().strip()
            if not line or line.startswith("error"):
                code = procs[rank].poll()
                return {}, f"rank {rank}: " + (line[6:] if line else f"exited with code {code} before reporting")
            lines[rank] = line
    return lines, ""


def _tell(procs: Dict[int, "object"], word: str) -> None:
    for p in procs.values():
        try:
            p.stdin.write(word + "\n")
            p.stdin.flush()
        except OSError:
            pass


def measure_node(v, threads: int) -> Tuple[Dict[int, float], str]:
    """({rank: CPU seconds per step} for the node's ranks, "") or ({}, why it failed). Each rank is a
    fresh interpreter (`python -m partrain.bench.cpu.rank_steps`), whatever process calls this."""
    import pickle
    import subprocess
    import sys

    import partrain

    root = os.path.dirname(os.path.dirname(os.path.abspath(partrain.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH", "")) if x))
    env.update(OMP_NUM_THREADS=str(threads))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    deadline = time.monotonic() + TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="partrain-rank-steps-") as scratch:
        run_file = os.path.join(scratch, "run.pickle")
        with open(run_file, "wb") as f:
            pickle.dump(v, f)
        cmd = [sys.executable, "-m", "partrain.bench.cpu.rank_steps", run_file]
        procs = {
            r: subprocess.Popen(
                [*cmd, str(r), str(threads)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            for r in node_ranks(v)
        }
        try:
            ready, error = _read_lines(procs, deadline)
            if not error:
                _tell(procs, "go")
                timed, error = _read_lines(procs, deadline)
            if not error:
                return {r: float(line.split()[1]) for r, line in timed.items()}, ""
            return {}, error
        finally:
            _tell(procs, "stop")
            for p in procs.values():
                try:
                    p.wait(timeout=10.0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def _layout_text(v) -> str:
    degrees = " ".join(f"{k}{n}" for k, n in v.layout.degrees.items() if n > 1) or "one rank"
    p, t = v.run.parallel, v.run.train
    schedule = f" {p.pp_schedule}" if v.layout.pp > 1 else ""
    batch = f"micro {t.micro_batch_size} x seq {t.seq_len}, {v.microbatches} microbatches"
    return f"{degrees} zero {p.zero_stage}{schedule}, {batch}"


def layout_fields(spec) -> dict:
    """The profiled layout as the planner names it (compute_profile.RANK_STEPS_LAYOUT_KEYS)."""
    from partrain.blueprint.compute_profile import RANK_STEPS_LAYOUT_KEYS

    cluster = {"devices_per_node": spec.cluster.devices_per_node}
    return {k: cluster[k] if k in cluster else getattr(spec, k) for k in RANK_STEPS_LAYOUT_KEYS}


def rank_steps_block(v, spec, threads: int, progress: Callable[[str], None] = lambda _: None) -> Optional[dict]:
    """The profile's "host.rank_steps" block for run `v` and its PlanSpec `spec` (None when it cannot be
    measured: `why_not`)."""
    from partrain.blueprint.planner.estimate import estimate_spec

    reason = why_not(v, estimate_spec(spec, detail=False)["memory_bytes"]["total"])
    if reason is None:
        measured, reason = measure_node(v, threads)
    if reason:
        progress(f"rank steps not measured: {reason}")
        return None
    ranks = sorted(measured)
    return {
        "layout": _layout_text(v),
        "spec": layout_fields(spec),
        "ranks": ranks,
        "pp_ranks": [v.layout.coords(r)["pp"] for r in ranks],
        "measured_cpu_s": [measured[r] for r in ranks],
    }


if __name__ == "__main__":
    import sys

    sys.exit(_child_main(sys.argv[1:]))
