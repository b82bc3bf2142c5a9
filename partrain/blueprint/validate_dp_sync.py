"""Rules of `parallel.dp_sync` and its keys (bucket size, parameter servers), checked before any
process starts. What composes with what, and why:

- every strategy: zero_stage 0; `ring` and `hierarchical` also zero_stage 1 (they only replace the
  gradient all-reduce; the sharded optimizer is unchanged). FSDP (zero_stage 2/3) reduce-scatters
  gradients itself, and the parameter server already shards the optimizer state on its servers.
- tensor and pipeline parallelism: `ring` and `hierarchical` (the dp group is a sub-group of the
  grid). The parameter server clips and updates flat shards of this rank's parameters, which would
  need the tp/pp-aware global norm: refused.
- sp > 1 and ep > 1: refused (sequence-parallel ranks and expert-data-parallel groups reduce over
  other groups than the dp one these strategies are built on).
- `hierarchical`: every node must hold the same number of members of each dp group.
- `parameter-server`: 1 <= ps_servers <= dp; fp32 or bf16 (fp16's loss scaling unscales gradients
  the servers hold); no checkpoints (the servers' optimizer state is not saved yet); servers are
  co-located (dedicated servers hold no data, which would change the global batch: only
  `partrain bench dp-sync` measures them).
"""

from __future__ import annotations

from typing import Dict

from partrain.blueprint.config.schema import DP_SYNC, PS_PLACEMENTS, RunConfig
from partrain.blueprint.layout import Layout
from partrain.blueprint.problems import ProblemCollector

DEDICATED_RULE = "dedicated parameter servers train on no data (the global batch would change)"
"""The one rule `partrain bench dp-sync` lifts (it measures dedicated servers)."""


def dp_sync_problems(c: ProblemCollector, run: RunConfig, degrees: Dict[str, int] | None) -> None:
    p = run.parallel
    if not c.check(
        p.dp_sync in DP_SYNC,
        "parallel.dp_sync",
        p.dp_sync,
        f"must be one of {', '.join(DP_SYNC)}",
        "set parallel.dp_sync=allreduce",
    ):
        return
    c.check(
        p.dp_bucket_mb > 0,
        "parallel.dp_bucket_mb",
        p.dp_bucket_mb,
        "must be > 0 (MiB)",
        "e.g. parallel.dp_bucket_mb=25",
    )
    c.check(p.ps_servers >= 1, "parallel.ps_servers", p.ps_servers, "must be >= 1", "set parallel.ps_servers=1")
    c.check(
        p.ps_placement in PS_PLACEMENTS,
        "parallel.ps_placement",
        p.ps_placement,
        f"must be one of {', '.join(PS_PLACEMENTS)}",
        "set parallel.ps_placement=colocated",
    )
    if p.dp_sync == "allreduce" or degrees is None:
        return
    name = p.dp_sync
    stages = (0, 1) if name in ("ring", "hierarchical") else (0,)
    why = {
        "ring": "FSDP reduce-scatters the gradients itself",
        "hierarchical": "FSDP reduce-scatters the gradients itself",
        "parameter-server": "the servers already shard the optimizer state (that is ZeRO-1's job)",
    }[name]
    c.check(
        p.zero_stage in stages,
        "parallel.zero_stage",
        p.zero_stage,
        f"parallel.dp_sync={name} works with zero_stage {' or '.join(map(str, stages))}: {why}",
        "set parallel.zero_stage=0, or parallel.dp_sync=allreduce",
    )
    for axis in ("sp", "ep"):
        c.check(
            degrees.get(axis, getattr(p, axis)) == 1,
            f"parallel.{axis}",
            getattr(p, axis),
            f"parallel.dp_sync={name} is built on the dp group; {axis} > 1 reduces gradients over other groups too",
            f"set parallel.{axis}=1, or parallel.dp_sync=allreduce",
        )
    from partrain.blueprint.precision_mode import uses_master_weights

    t = run.train
    c.check(
        not uses_master_weights(t.precision, t.param_dtype, p.zero_stage, run.cluster.device, degrees.get("ep", 1)),
        "train.param_dtype",
        t.param_dtype,
        f"parallel.dp_sync={name} synchronises fp32 gradients of fp32 parameters; 16-bit parameters with fp32 "
        "master weights reduce their own fp32 gradient buffer",
        "set train.param_dtype=fp32, or parallel.dp_sync=allreduce",
    )
    if name == "parameter-server":
        _ps_problems(c, run, degrees)
    if name == "hierarchical" and c.problems == [] and degrees["dp"] > 1:
        _hierarchical_problems(c, run, degrees)


def _ps_problems(c: ProblemCollector, run: RunConfig, degrees: Dict[str, int]) -> None:
    p, dp = run.parallel, degrees["dp"]
    c.check(
        p.ps_servers <= dp,
        "parallel.ps_servers",
        p.ps_servers,
        f"must be at most the data-parallel degree ({dp}): each server is one of the dp ranks",
        f"set parallel.ps_servers to 1..{dp}",
    )
    for axis in ("tp", "pp"):
        c.check(
            degrees[axis] == 1,
            f"parallel.{axis}",
            degrees[axis],
            f"parallel.dp_sync=parameter-server updates flat shards of a whole model; {axis} > 1 is not supported",
            f"set parallel.{axis}=1, or parallel.dp_sync=ring / hierarchical",
        )
    c.check(
        run.train.precision != "fp16",
        "train.precision",
        run.train.precision,
        "parameter-server: fp16 loss scaling would unscale gradients the servers already hold",
        "use train.precision=bf16 or fp32",
    )
    ck = run.checkpoint
    saves = [f"checkpoint.{k}={getattr(ck, k)}" for k in ("every_steps", "export_hf") if getattr(ck, k)]
    if ck.resume != "none":
        saves.append(f"checkpoint.resume={ck.resume}")
    c.check(
        not saves,
        saves[0].split("=")[0] if saves else "checkpoint.every_steps",
        saves[0].split("=", 1)[1] if saves else 0,
        "parameter-server: the servers' master shards and optimizer state are not checkpointed yet, so the run "
        f"cannot save or resume ({', '.join(saves)}); its final checkpoint is skipped, and the launch says so",
        "set checkpoint.every_steps=0 checkpoint.export_hf=false checkpoint.resume=none, or parallel.dp_sync=allreduce",
    )
    c.check(
        p.ps_placement == "colocated",
        "parallel.ps_placement",
        p.ps_placement,
        DEDICATED_RULE,
        "train with parallel.ps_placement=colocated; `partrain bench dp-sync` measures dedicated servers",
    )


def _hierarchical_problems(c: ProblemCollector, run: RunConfig, degrees: Dict[str, int]) -> None:
    layout = Layout(
        **{a: degrees[a] for a in ("tp", "sp", "dp", "pp")},
        order=tuple(run.parallel.order),
        devices_per_node=run.cluster.devices_per_node,
    )
    group = layout.groups("dp_sp")[0]
    counts: Dict[int, int] = {}
    for r in group:
        counts[layout.node_of(r)] = counts.get(layout.node_of(r), 0) + 1
    c.check(
        len(set(counts.values())) == 1,
        "parallel.dp_sync",
        "hierarchical",
        f"needs the same number of a dp group's ranks on every node; dp group {group} has {counts} per node",
        "choose degrees whose dp groups spread evenly over nodes, or parallel.dp_sync=ring",
    )
