"""Run a function in N real processes on gloo (for tests that look inside a rank).

Each child joins a process group through a FileStore, runs `fn(rank, world, *args)`, writes
whatever `fn` returns as JSON to `folder/result.rank<R>.json`, tears the group down and leaves with
`partrain.runtime.lifecycle` (gloo can abort at interpreter exit otherwise). The parent returns the results in rank
order and raises if a child failed or hung.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any, Callable, List


def _child(rank: int, world: int, folder: str, fn: Callable, args: tuple) -> None:
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


def run_spawned(fn: Callable, world: int, folder: Path, *args: Any, timeout_s: float = 180) -> List[Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(rank, world, str(folder), fn, args)) for rank in range(world)]
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
