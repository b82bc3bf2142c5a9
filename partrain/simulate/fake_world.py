"""`partrain plan --simulate`: build what a rank really holds, at the full world size, on one CPU.

For each simulated rank, this process joins torch's fake process group (every collective returns
at once, no peers exist) as that rank of the full world, builds the DeviceMesh of the layout and
runs `partrain.parallel.parallelize.shard_on_meta`: the same code a training rank runs before weights
exist (meta model -> pipeline split -> tensor parallel -> expert parallel ->
recompute -> FSDP). The sharded
parameters' local shapes are then read off the module tree, so the shapes and bytes reported are
the ones the real wrappers produce, not a formula. Next to them: the planner's analytic count for
the same rank (`predicted_rank_elements`), which must agree exactly on parameter elements.

Which ranks: by default the first and the last rank of each pipeline stage (coordinates 0, and
every coordinate at its maximum: the largest and the smallest FSDP shards, the first and last TP
slice), or the ranks the user names. Bytes are those of partrain's
runtime (fp32 weights and gradients, Adam m and v in fp32; bf16/fp16 runs use autocast), i.e. the
planner's "autocast" accounting; the fake backend never allocates them (everything stays on meta).

Imports torch: only `plan --simulate` loads this module.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import replace
from typing import Optional, Sequence

from partrain.blueprint.planner.memory import dtypes
from partrain.blueprint.planner.rank_state import predicted_rank_elements
from partrain.blueprint.planner.simulated import (
    SimulatedParam,
    SimulatedRank,
    Simulation,
    default_ranks,
)
from partrain.blueprint.planner.spec import spec_from_validated


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _optimizer_elements(modules, zero_stage: int, shard_size: int, weight_decay: float) -> int:
    """AdamW state elements (one per moment) exactly as partrain builds the optimizer: every local
    element for DDP/FSDP; for ZeRO-1 each parameter group flattened and cut into shard_size equal
    slices (`ShardedOptimizer`: ceil(numel / n) per rank)."""
    from partrain.parallel.optimizer import param_groups

    groups = [g for m in modules for g in param_groups(m, weight_decay)]
    if zero_stage == 1 and shard_size > 1:
        return sum(-(-sum(_local(p).numel() for p in g["params"]) // shard_size) for g in groups)
    return sum(_local(p).numel() for g in groups for p in g["params"])


def simulate_rank(v, rank: int) -> SimulatedRank:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from partrain.parallel.parallelize import shard_on_meta
    from partrain.runtime.mesh import build_mesh

    lay = v.layout
    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=lay.world_size)
    try:
        mesh = build_mesh(lay, "cpu")
        held = shard_on_meta(v, mesh)
        seen, params, trainable = set(), [], 0
        # A tied weight a rank holds in two stages is one tensor: count it once, like the runtime.
        for module in held.modules:
            for name, p in module.named_parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                local = _local(p)
                trainable += local.numel() if p.requires_grad else 0  # LoRA's frozen base takes no gradient
                placements = ", ".join(str(x) for x in p.placements) if hasattr(p, "placements") else ""
                params.append(
                    SimulatedParam(
                        name,
                        list(p.shape),
                        list(local.shape),
                        placements,
                        str(local.dtype).replace("torch.", ""),
                        local.numel() * local.element_size(),
                    )
                )
        zero = v.run.parallel.zero_stage
        opt_elems = _optimizer_elements(held.modules, zero, mesh.size("dp_shard"), v.run.optim.weight_decay)
        chunks = held.chunks or [0]
    finally:
        dist.destroy_process_group()
    elapsed = time.perf_counter() - started

    spec = spec_from_validated(v, mixed="autocast")
    d = dtypes(spec.precision, spec.style)
    if spec.style == "master":
        # The runtime turns the built fp32 parameters into 16-bit ones (partrain/parallel/master_weights.py).
        half = spec.precision if spec.precision in ("bf16", "fp16") else "bf16"
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[half]
        params = [dataclasses.replace(p, dtype=dtype, bytes=math.prod(p.local_shape) * 2) for p in params]
    p_el, g_el, o_el = predicted_rank_elements(spec, lay, rank)
    param_bytes = sum(p.bytes for p in params)
    param_elements = sum(math.prod(p.local_shape) for p in params)
    element_size = param_bytes // param_elements if param_elements else 4
    simulated = {
        "param_elements": param_elements,
        "params": param_bytes,
        "grads": trainable * element_size,
        "optimizer": opt_elems * 2 * element_size,
    }
    if spec.style == "master":  # an fp32 gradient buffer; an fp32 master copy beside Adam's m and v
        simulated.update(grads=trainable * 4, optimizer=opt_elems * 12)
    simulated["total"] = simulated["params"] + simulated["grads"] + simulated["optimizer"]
    analytic = {"param_elements": p_el, "params": p_el * d.param, "grads": g_el * d.grad, "optimizer": o_el * d.optim}
    analytic["total"] = analytic["params"] + analytic["grads"] + analytic["optimizer"]
    return SimulatedRank(rank, lay.coords(rank), chunks, params, simulated, analytic, elapsed)


def simulate(v, ranks: Optional[Sequence[int]] = None) -> Simulation:
    """Simulate `ranks` (default: `default_ranks`) of the validated run `v`."""
    from partrain.blueprint.trainable import IMPLEMENTED

    started = time.perf_counter()
    out = Simulation(v.layout.world_size)
    p = v.run.parallel
    if (
        p.tp_sequence_parallel
        and v.layout.tp > 1
        and v.facts.learned_positions
        and not IMPLEMENTED["tp-sp-learned-positions"]
    ):
        # Megatron-SP moves activations, not parameters: the shards are those of plain TP.
        v = replace(v, run=replace(v.run, parallel=replace(p, tp_sequence_parallel=False)))
        out.notes.append(
            f"Megatron sequence parallelism is not built for {v.facts.arch} yet: simulated without it "
            "(it changes activations, not where parameters live)"
        )
    for rank in list(ranks) if ranks else default_ranks(v.layout):
        out.ranks.append(simulate_rank(v, rank))
    out.seconds = time.perf_counter() - started
    return out
