"""Train several configs one after another inside processes that are already running.

Each case goes through what `partrain train` does before torchrun (`prepare_run`, in the caller's process)
and then through the worker's own code from the joined process group on (`train_run_dirs`), into a run
folder of its own; the cases of one process count share one launch (`train_all`, forked from a server that
imported torch and partrain once: partrain.runtime.spawn). `partrain rehearse` runs a layout and its
one-process reference this way; the suite runs its parity cases this way.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Sequence

from partrain.rehearse.parity import RunRecord, read_record


def prepare_run(overrides: Sequence[str], run_dir: Path, recipe_dirs: Sequence[str] = ()) -> int:
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
    v = validate(compose(["train.threads_per_process=1", *overrides, f"train.run_dir={run_dir}"], list(recipe_dirs)))
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
    metrics.jsonl, summary.json, logs and checkpoints. Only torchrun, the group's start-up and the
    meshes of equal layouts (MeshCache) are shared between the runs."""
    import torch
    import torch.distributed as dist

    from partrain.blueprint.config.compose import load_resolved
    from partrain.blueprint.validate import validate
    from partrain.runtime.context import DistEnv
    from partrain.train.relayout import layout_for_world
    from partrain.worker import setup_logging, threads_for, train_process

    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, master_addr="", master_port=0)
    meshes = MeshCache()
    codes = []
    for run_dir in map(Path, run_dirs):
        v = validate(load_resolved(run_dir / "config.yaml"))
        setup_logging(run_dir, env)
        torch.set_num_threads(threads_for(v, env))
        v, dropped = layout_for_world(v, run_dir, world)
        codes.append(train_process(v, env, run_dir, dropped=dropped, mesh_of=meshes))
        dist.barrier()  # the next run starts together (rank 0 writes the summary last)
        meshes.release_other_groups()
    return codes


class MeshCache:
    """build_mesh for a process that trains run after run: one mesh per distinct layout shape
    (runtime.mesh.mesh_key), kept for the runs after it, and every other group a run made destroyed
    after it.

    Why keep them: DTensor caches its sharding and redistribution plans by mesh, and meshes compare
    equal by their ranks and dimension names, so a plan cached in one run answers the next run's equal
    mesh with the first run's mesh object; its groups must still exist ("Could not resolve the process
    group"). Emptying DTensor's caches after each run instead made every run plan again (a fifth of
    the family matrix's time). Why destroy the others: each gloo group keeps three threads, and a
    process that trained 160 parity cases without releasing them held 2,400 (a load average of 400)."""

    def __init__(self):
        self._meshes: Dict[tuple, object] = {}

    def __call__(self, layout, device_type: str):
        from dataclasses import replace

        from partrain.runtime.mesh import build_mesh, mesh_key

        key = (device_type, mesh_key(layout))
        if key not in self._meshes:
            self._meshes[key] = build_mesh(layout, device_type)
        return replace(self._meshes[key], layout=layout)

    def release_other_groups(self) -> None:
        """Destroy every process group but the default one and the kept meshes'."""
        import gc

        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        # The run's modules and optimizer hold their groups in reference cycles. What survives the collection
        # is frozen (left out of later ones): a full collection over torch's and transformers' objects took
        # 0.45 s a run, a third of a parity case.
        gc.collect()
        gc.freeze()
        kept = self._groups()
        if kept is None:  # a torch without the mesh's group registry: nothing can be kept
            self._meshes.clear()
            kept = set()
        # torch has no public list of the live groups; its own destroy_process_group() walks this map.
        for group in list(distributed_c10d._world.pg_map):
            if group is not dist.GroupMember.WORLD and group not in kept:
                dist.destroy_process_group(group)
        if not self._meshes:
            _forget_dtensor_plans()

    def _groups(self):
        """The groups of the kept meshes, their flattened and sliced meshes included (the root mesh's
        registry holds those a run makes later, e.g. FSDP's flattened dims); None where torch has no
        registry."""
        kept = set()
        for mesh in self._meshes.values():
            for part in (mesh.world, *mesh.flat.values()):
                root_of = getattr(part, "_get_root_mesh", None)  # torch 2.9 has neither this nor the registry
                registry = getattr(root_of(), "_pg_registry", None) if root_of is not None else None
                if registry is None:
                    return None
                kept.update(registry.values())
                kept.update(part.get_all_groups())
        return kept


def _forget_dtensor_plans() -> None:
    """Empty DTensor's caches of sharding and redistribution plans (see MeshCache: where no mesh is kept,
    a plan cached by a destroyed mesh must not answer a later equal one)."""
    from torch.distributed.tensor import _redistribute, debug

    for clear in (
        getattr(debug, "_clear_sharding_prop_cache", None),  # python and C++ fast-path sharding caches
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
    ):
        if clear is not None:
            clear()


def train_all(
    cases: Mapping[str, Sequence[str]],
    root: Path,
    timeout_s: float = 900,
    recipe_dirs: Sequence[str] = (),
    quiet: bool = False,
) -> Dict[str, RunRecord]:
    """Every case (name -> `partrain train` overrides) trained through the worker's code into
    root/NAME/run, sharing one launch of real processes per process count (run_spawned with
    train_run_dirs); each case's RunRecord. Raises ConfigError for a case the CLI would refuse,
    RuntimeError when a process fails. quiet: the processes' output goes to files (run_spawned), not the
    caller's terminal."""
    from partrain.runtime.spawn import run_spawned

    by_world: Dict[int, List[str]] = {}
    for name, overrides in cases.items():
        if not re.fullmatch(r"[A-Za-z0-9._-]+", name):  # it becomes a folder in a Hydra override
            raise ValueError(f"case name {name!r}: use letters, digits, '.', '_' and '-' only")
        run_dir = Path(root) / name / "run"
        by_world.setdefault(prepare_run(overrides, run_dir, recipe_dirs), []).append(str(run_dir))
    for world, run_dirs in sorted(by_world.items()):
        # A folder of its own for each launch: a FileStore left by an earlier launch would hand the new
        # processes the old ones' addresses.
        folder = Path(tempfile.mkdtemp(prefix=f"processes-{world}-", dir=root))
        codes = run_spawned(train_run_dirs, world, folder, run_dirs, timeout_s=timeout_s, quiet=quiet)
        failed = [d for d, per_rank in zip(run_dirs, zip(*codes)) if any(per_rank)]
        if failed:  # rank 0 returns 1 for a run that did not train (summary.json says why)
            raise RuntimeError(f"runs that did not train: {failed}")
    return {name: read_record(Path(root) / name / "run") for name in cases}
