"""`partrain bench comm` / `compute` / `dp-sync`: measure the cluster for the planner."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from partrain.cli.common import (
    JSON,
    OVERRIDES,
    RECIPES,
    compose_on_this_machine,
    fail,
    local_gpus,
    recipe_dirs,
    stdout_console,
)
from partrain.errors import ConfigError, Problem

bench_app = typer.Typer(help="Measure the cluster for the planner.", no_args_is_help=True)


@bench_app.command("comm")
def bench_comm_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    sizes: Optional[str] = typer.Option(
        None,
        "--sizes",
        help="Message sizes in bytes, comma-separated; K, M, G = 2**10, 2**20, 2**30 "
        "(default 1K,64K,1M,16M on CPU, plus 256M on CUDA). The planner uses the largest.",
    ),
    iters: int = typer.Option(20, "--iters", help="Timed calls per op and size."),
    warmup: int = typer.Option(5, "--warmup", help="Untimed calls before timing."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Profile file to write (default runs/bench-comm/<cluster>-<time>.json)."
    ),
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
) -> None:
    """Measure all-reduce, all-gather, reduce-scatter, all-to-all and send/recv bandwidth over the cluster's process
    groups (nccl-tests' algbw/busbw by size, and each call's CPU) and save a profile for `cluster.comm_profile`."""
    from partrain.bench.comm_parent import (
        bench_problems,
        bench_settings,
        render_profile,
    )
    from partrain.bench.comm_parent import launch as bench_launch
    from partrain.blueprint.validate import validate
    from partrain.runtime.context import cpu_count, from_environ

    try:  # composed as plan/train do; only problems of the cluster (and timeouts) stop a measurement
        run = compose_on_this_machine(overrides or [], recipes)
        try:
            validate(run)
        except ConfigError as err:
            if bench_problems(err.problems):
                raise ConfigError(bench_problems(err.problems)) from None
        dist_env = from_environ(dict(os.environ))
        settings = bench_settings(run, sizes, iters, warmup, out, dist_env)
    except ConfigError as err:
        fail(err, as_json)
    if dist_env is not None:  # under torchrun / srun (multi-node): this process is a worker
        from partrain.bench.comm import run as bench_run
        from partrain.runtime.lifecycle import leave

        code, profile = bench_run(settings, dist_env, show_progress=False)
        if code == 0 and dist_env.is_main:
            if as_json:
                print(json.dumps({"path": settings.out, **profile}))
            else:
                render_profile(profile, Path(settings.out), stdout_console())
        leave(code)  # gloo may abort at a normal interpreter exit
    threads = run.train.threads_per_process or max(1, cpu_count() // settings.devices_per_node)
    code, cause, tail = bench_launch(settings, Console(stderr=True, highlight=False), dict(os.environ), threads)
    if code != 0:
        err = Console(stderr=True, highlight=False)
        err.print(tail, markup=False)
        err.print(f"[bold red]bench comm failed[/bold red] (torchrun exit code {code}): ", end="")
        err.print(cause or "see the output above", markup=False)
        raise typer.Exit(1)
    profile = json.loads(Path(settings.out).read_text())
    if as_json:
        print(json.dumps({"path": settings.out, **profile}))
    else:
        render_profile(profile, Path(settings.out), stdout_console())


@bench_app.command("compute")
def bench_compute_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    iters: int = typer.Option(
        5,
        "--iters",
        help="Timed calls per matmul shape (median kept); the layer gets at least 15.",
    ),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Profile file to write (default runs/bench-compute/<cluster>-<time>.json)."
    ),
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
) -> None:
    """Measure this machine's matmul rates for the model's shapes, one decoder layer's forward + backward time and
    saved bytes, and an elementwise bandwidth, at the run's precision, and save a profile for `cluster.compute_profile`.
    On CPU also what a worker holds beyond its tensors and the per-call work besides kernels (optimizer and clip per
    parameter tensor, what the TP wrappers add) and the first node's real rank steps, all at once on the fake process
    group (the planner scales the ranks' counted CPU by them).
    """
    from partrain.bench.compute_parent import bench_spec, default_out, render_profile

    try:
        run, spec = bench_spec(overrides or [], recipe_dirs(recipes, dict(os.environ)), iters, local_gpus())
    except ConfigError as err:
        fail(err, as_json)
    from partrain.bench.compute import measure
    from partrain.blueprint.compute_profile import write_profile

    status = Console(stderr=True, highlight=False)
    profile = measure(run, spec, iters, progress=lambda msg: status.print(f"bench compute: {msg}", markup=False))
    path = write_profile(out or default_out(run.cluster.name), profile)
    if as_json:
        print(json.dumps({"path": str(path), **profile}))
    else:
        render_profile(profile, path, stdout_console())


@bench_app.command("dp-sync")
def bench_dp_sync_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    iters: int = typer.Option(10, "--iters", help="Timed steps per strategy (median kept)."),
    warmup: int = typer.Option(2, "--warmup", help="Untimed steps before timing."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Report file to write (default runs/bench-dp-sync/<cluster>-<time>.json)."
    ),
    as_json: bool = JSON,
    recipes: Optional[List[Path]] = RECIPES,
) -> None:
    """Time each data-parallel gradient-sync strategy (allreduce, ring, hierarchical, parameter server co-located
    and dedicated) on this cluster for the model's gradient sizes: time per step, bytes sent per rank and by the
    busiest rank, counted at every send/recv, beside the planner's prediction."""
    from partrain.bench import dp_sync_parent as bench
    from partrain.runtime.context import cpu_count

    try:
        if iters < 1 or warmup < 0:
            raise ConfigError(
                Problem("--iters", iters, "must be at least 1 (and --warmup at least 0)", "e.g. --iters 10")
            )
        run = bench.validated(overrides or [], recipe_dirs(recipes, dict(os.environ)), local_gpus())
        numels = bench.parameter_numels(run)
    except ConfigError as err:
        fail(err, as_json)
    world = run.cluster.nodes * run.cluster.devices_per_node
    threads = run.train.threads_per_process or max(1, cpu_count() // world)
    path = out or bench.default_out(run.cluster.name)
    s = bench.settings(run, numels, iters, warmup, path, threads)
    code, tail = bench.launch(s, dict(os.environ), threads)
    if code != 0:
        err = Console(stderr=True, highlight=False)
        err.print(tail, markup=False)
        err.print(f"[bold red]bench dp-sync failed[/bold red] (torchrun exit code {code})")
        raise typer.Exit(1)
    rep = bench.report(run, s, json.loads(path.read_text())["measured"])
    path.write_text(json.dumps(rep, indent=1))
    if as_json:
        print(json.dumps({"path": str(path), **rep}))
    else:
        bench.render(rep, stdout_console())
