"""Wire a `parallel.dp_sync` strategy other than `allreduce` into the training step: what
`data_parallel.wrap` hands the engine (optimizer, microbatch context, after-backward sync, clip)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, List, Optional

from torch import nn

from partrain.blueprint.config.schema import OptimConfig
from partrain.parallel.dp_sync.buckets import BucketedSync
from partrain.parallel.dp_sync.param_server import ParameterServer
from partrain.parallel.dp_sync.setup import SyncRuntime, SyncSettings, flat_strategy, p2p_group, rank_groups, sync_flat


@dataclass
class Wired:
    optimizer: object
    microbatch: Callable[[bool], ContextManager]
    finish: Callable[[], None]
    clip: Optional[Callable[[float], float]]
    runtime: SyncRuntime


def _has_dtensor_params(model: nn.Module) -> bool:
    return any(hasattr(p, "device_mesh") for p in model.parameters())


def wrap_with_strategy(
    model: nn.Module, mesh, groups: List[Dict], optim_cfg: OptimConfig, sync: SyncSettings, make_optimizer
) -> Wired:
    """`make_optimizer()`: the optimizer the layout would use (the servers replace it for parameter-server)."""
    runtime = SyncRuntime()
    nothing = lambda last: contextlib.nullcontext()
    if sync.strategy == "parameter-server":
        from partrain.parallel.optimizer import make_torch_optimizer

        server = ParameterServer(
            groups,
            rank_groups(mesh),
            sync.ps_servers,
            lambda gs: make_torch_optimizer(gs, optim_cfg),
            runtime.counter,
            p2p_group(),
            mesh["dp_sp"].get_group(),
        )
        runtime.server = server
        return Wired(server, nothing, server.push_gradients, server.clip, runtime)
    # The sharded optimizer (ZeRO-1) re-homes parameters into its flat buffers: build it first.
    optimizer = make_optimizer()
    strategy = flat_strategy(sync.strategy, mesh, runtime.counter)
    runtime.flat = strategy
    if _has_dtensor_params(model):
        return Wired(optimizer, nothing, lambda: sync_flat([model], strategy), None, runtime)
    bucketed = BucketedSync(list(model.parameters()), strategy, sync.bucket_mb)
    runtime.bucketed = bucketed
    return Wired(optimizer, bucketed.microbatch, bucketed.finish, None, runtime)
