"""Train several configs one after another inside processes that are already running.

`train_all` is the general form: each case goes through what `partrain train` does before
torchrun (prepare_run, in the test's process) and then through the worker's own code from the
joined process group on (train_run_dirs), into a run folder of its own. The cases of one process
count share one launch. `train_cases` (first) is the older, narrower form: cases that read one
prepared data set and return only per-step records.

One `run_spawned` launch pays process start-up and imports once; `train_cases` then composes,
validates and trains each case through the real path (mesh -> build_engine -> Trainer.train_step)
and returns the per-step losses and gradient norms, plus what the gradient sync reports (bytes,
overlap) where the case uses `parallel.dp_sync`. The data comes from a run folder that
`partrain train` already prepared (its data.json), so every case reads the same packed tokens.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

from partrain.testing.parity import RunRecord, parity_args, read_record, reference_overrides


def train_cases(rank: int, world: int, data_run_dir: str, cases: Sequence[Sequence[str]], steps: int) -> List[dict]:
    """For run_spawned: every case's record on this rank (each case must use `world` processes)."""
    import torch

    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.data import TokenBatches, open_packed
    from partrain.runtime.mesh import build_mesh
    from partrain.train.assemble import build_engine
    from partrain.train.loop import Trainer
    from partrain.train.metrics import MetricsWriter

    packed = open_packed(json.loads((Path(data_run_dir) / "data.json").read_text())["meta_path"])
    out = []
    for overrides in cases:
        v = validate(compose(list(overrides)))
        if v.world_size != world:
            raise ValueError(f"case {overrides} needs {v.world_size} processes, not {world}")
        torch.manual_seed(v.run.train.seed)
        mesh = build_mesh(v.layout, "cpu")
        engine = build_engine(v, mesh, torch.device("cpu"))
        batches = TokenBatches.from_packed(packed, v.run.train.seq_len, v.global_batch_size, v.run.train.seed)
        trainer = Trainer(v, mesh, engine, batches, None, MetricsWriter(Path(data_run_dir), enabled=False), False)
        results = [trainer.train_step() for _ in range(steps)]
        record = {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results]}
        record["model_state_bytes"] = trainer.state.model_state_bytes
        sync = getattr(getattr(engine, "dp", None), "sync", None)
        if sync is not None:
            record["counter"] = sync.counter.to_json()
            if sync.bucketed is not None:
                record["overlap"] = sync.bucketed.stats.to_json()
                sync.bucketed.close()
        out.append(record)
    return out


def prepare_run(overrides: Sequence[str], run_dir: Path) -> int:
    """What `partrain train OVERRIDES` does before torchrun, in this process: compose, validate,
    refuse what train cannot run, check and tokenize the data, write the run folder. Returns the
    number of processes the run needs. Raises ConfigError where the CLI would exit 2."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.trainable import unsupported_features
    from partrain.blueprint.validate import validate
    from partrain.errors import ConfigError, Problem
    from partrain.launch import prepare_run_dir
    from partrain.preflight import check_before_launch

    # One thread a process unless the case names more: the suite runs its launches beside each other on
    # a few cores, where a second OpenMP thread spins in its barriers on a core another process needs.
    v = validate(compose(["train.threads_per_process=1", *overrides, f"train.run_dir={run_dir}"]))
    missing = unsupported_features(v)
    if missing:
        raise ConfigError([Problem("parallel", "layout", text, "see partrain.blueprint.trainable") for text in missing])
    check_before_launch(v)
    prepare_run_dir(v, Path(run_dir))
    return v.world_size


def train_run_dirs(rank: int, world: int, run_dirs: Sequence[str]) -> List[int]:
    """For run_spawned: each prepared run folder (prepare_run) trained one after another by the
    worker's own code (partrain.worker.train_process) in this process group; the exit codes.

    The same as `partrain train` from the joined process group on: the run folder gets its
    metrics.jsonl, summary.json, logs and checkpoints. Only torchrun and the group's start-up are
    shared between the runs."""
    import torch
    import torch.distributed as dist

    from partrain.blueprint.config.compose import load_resolved
    from partrain.blueprint.validate import validate
    from partrain.runtime.context import DistEnv
    from partrain.train.relayout import layout_for_world
    from partrain.worker import setup_logging, threads_for, train_process

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, master_addr="", master_port=0)
    codes = []
    for run_dir in map(Path, run_dirs):
        v = validate(load_resolved(run_dir / "config.yaml"))
        setup_logging(run_dir, env)
        torch.set_num_threads(threads_for(v, env))
        v, dropped = layout_for_world(v, run_dir, world)
        codes.append(train_process(v, env, run_dir, dropped=dropped))
        dist.barrier()  # the next run starts together (rank 0 writes the summary last)
    return codes


def train_all(cases: Mapping[str, Sequence[str]], root: Path, timeout_s: float = 900) -> Dict[str, RunRecord]:
    """Every case (name -> `partrain train` overrides) trained through the worker's code into
    root/NAME/run, sharing one launch of real processes per process count (run_spawned with
    train_run_dirs); each case's RunRecord. Raises ConfigError for a case the CLI would refuse,
    RuntimeError when a process fails."""
    from partrain.testing.multiproc import run_spawned

    by_world: Dict[int, List[str]] = {}
    for name, overrides in cases.items():
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):  # it becomes a folder in a Hydra override
            raise ValueError(f"case name {name!r}: use letters, digits, '.', '_' and '-' only")
        run_dir = Path(root) / name / "run"
        by_world.setdefault(prepare_run(overrides, run_dir), []).append(str(run_dir))
    for world, run_dirs in sorted(by_world.items()):
        # A folder of its own for each launch: a FileStore left by an earlier launch would hand the new
        # processes the old ones' addresses.
        folder = Path(tempfile.mkdtemp(prefix=f"processes-{world}-", dir=root))
        codes = run_spawned(train_run_dirs, world, folder, run_dirs, timeout_s=timeout_s)
        failed = [d for d, per_rank in zip(run_dirs, zip(*codes)) if any(per_rank)]
        if failed:  # rank 0 returns 1 for a run that did not train (summary.json says why)
            raise RuntimeError(f"runs that did not train: {failed}")
    return {name: read_record(Path(root) / name / "run") for name in cases}


def train_with_references(
    layouts: Mapping[str, Sequence[str]],
    reference_of: Callable[[str], Tuple[str, Sequence[str]]],
    steps: int,
    root: Path,
) -> Dict[str, RunRecord]:
    """Parity runs (`steps` steps, no eval) of every layout and of the one-process reference each is
    compared with: reference_of(name) gives (the reference's name, the overrides it keeps of the
    layout; testing.parity.reference_overrides turns them into one process). A reference shared by
    several layouts trains once; the runs share one launch per process count (train_all)."""
    cases: Dict[str, List[str]] = {}
    for name, overrides in layouts.items():
        reference_name, kept = reference_of(name)
        cases[reference_name] = parity_args(reference_overrides(kept), steps)
        cases[name] = parity_args(overrides, steps)
    return train_all(cases, root)
