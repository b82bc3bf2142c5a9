"""Run a function in N real processes on gloo, started in milliseconds (`partrain rehearse`, and tests that
look inside a rank).

Each child joins a process group through a FileStore, runs `fn(rank, world, *args)`, writes
whatever `fn` returns as JSON to `folder/result.rank<R>.json`, tears the group down and leaves with
`partrain.runtime.lifecycle` (gloo can abort at interpreter exit otherwise). The parent returns the results in rank
order and raises if a child failed or hung.

Children are forked by multiprocessing's fork server, which imports torch, transformers' model code
and partrain's training stack once (PRELOAD) and then forks a child per rank in milliseconds. A
freshly spawned interpreter spends about 7 s of CPU on those imports, so on a 2-core machine a
4-process launch paid about 14 s before it ran a line of the test. The fork server itself never
runs a tensor op or starts a thread pool, so a forked child starts as clean as a spawned one. Each
child takes the parent's environment and working folder at the call (the fork server has its own).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback
from pathlib import Path
from typing import Any, Callable, List

PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.llama.modeling_llama",
    "partrain.train.assemble",
    "partrain.train.loop",
    "partrain.worker",
    "partrain.rehearse.runs",
]
"""Modules the fork server imports once for every child (a missing one is skipped)."""


def _child(rank: int, world: int, folder: str, fn: Callable, args: tuple, environ: dict, cwd: str, quiet: bool) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    if quiet:  # the caller prints its own report: each rank's output goes to folder/rank<R>.out
        out = os.open(os.path.join(folder, f"rank{rank}.out"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
    import torch
    import torch.distributed as dist

    from partrain.runtime.lifecycle import joined_group, leave

    code = 0
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(folder, "store"), world)
        with joined_group("gloo", rank, world, 60, store=store):
            result = fn(rank, world, *args)
            Path(folder, f"result.rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        traceback.print_exc()
        code = 1
    leave(code)


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first call)
    return ctx


def run_spawned(
    fn: Callable, world: int, folder: Path, *args: Any, timeout_s: float = 180, quiet: bool = False
) -> List[Any]:
    """fn(rank, world, *args) in `world` processes of one gloo group; their results in rank order.
    quiet: each process's stdout and stderr go to folder/rank<R>.out instead of the caller's."""
    ctx = _context()
    folder = Path(folder).resolve()
    Path(folder, "store").unlink(missing_ok=True)  # an earlier launch's store would hand out its addresses
    environ, cwd = dict(os.environ), os.getcwd()
    procs = [
        ctx.Process(target=_child, args=(rank, world, str(folder), fn, args, environ, cwd, quiet))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=timeout_s)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    codes = [p.exitcode for p in procs]
    if codes != [0] * world:
        raise RuntimeError(f"child exit codes {codes}")
    return [json.loads(Path(folder, f"result.rank{r}.json").read_text()) for r in range(world)]
