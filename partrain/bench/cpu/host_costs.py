"""What a CPU training step costs besides its kernels: the compute profile's "host" block.

On a CPU the cores that compute also run Python, torch's dispatcher, DTensor's sharding logic and the
optimizer's per-tensor loop; when a node's ranks outnumber its cores, every rank's share of that work
slows every other rank (planner/cpu_host.py). `partrain bench compute` times the pieces that depend
on the layout, in its one process, as rank 0 of a world of max(2, tp) ranks on torch's fake process
group: DTensor shards, propagates and redistributes exactly as on a real mesh of that size, and each
collective returns at once. A collective's own CPU is what `partrain bench comm` measures for real; the
planner adds it per call. Timed:

- the optimizer's step per parameter tensor (optim.name / optim.implementation as the run has them),
  for plain tensors and for DTensors (tensor-parallel and FSDP parameters), on small tensors so the
  fixed cost shows (the planner times the bytes apart);
- the gradient clip (partrain's `clip_gradients`) per tensor, plain and DTensor;
- one decoder layer's forward + backward under partrain's tensor-parallel wrappers at the run's tp
  (its local shapes) beyond what the compute model, fitted to the rows just measured, gives the same
  layer's kernels (scaled by the plain layer's time, measured beside it, over the model's: the speed of
  the machine now): what TP adds to a layer besides its collectives;
- the rest of a microbatch (embedding, head, partrain's loss under loss parallel) wrapped, beyond the
  same plain: what TP adds to the ends.

The wrapped and plain timings alternate, call by call, so that the machine's drift and the page faults
of fresh buffers fall on both alike; each is this thread's CPU time.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional

import torch

from partrain.bench.one_layer import layer_step, one_layer
from partrain.blueprint.planner.compute_model import model_of_profile
from partrain.blueprint.planner.compute_time import shape_of_spec
from partrain.blueprint.planner.spec import PlanSpec

TENSORS = 24
"""Parameter tensors each per-tensor timing steps over."""
TENSOR_SHAPE = (64, 32)
"""Small enough that a step's bytes take a few microseconds: what is left is the per-tensor cost."""


def _fake_world(size: int) -> Optional[Callable[[], None]]:
    """Rank 0 of a fake process group of `size` ranks and how to end it; None when this process already
    has a group (it is a rank of a real run: the host block is then not measured)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        return None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)
    return dist.destroy_process_group


def _medians(calls: List[Callable[[], None]], iters: int) -> List[float]:
    """Median CPU seconds (this thread's) of each call, the calls timed in turn `iters` times after 3
    untimed rounds. CPU, not wall time: these are the cores' work the planner adds up, and a wall clock
    would also count the time other processes of this machine held the core."""
    times: List[List[float]] = [[] for _ in calls]
    for i in range(iters + 3):
        for fn, out in zip(calls, times):
            t0 = time.thread_time()
            fn()
            if i >= 3:
                out.append(time.thread_time() - t0)
    return [sorted(t)[len(t) // 2] for t in times]


def _params(device, mesh) -> list:
    from torch.distributed.tensor import Shard, distribute_tensor

    out = []
    for _ in range(TENSORS):
        t = torch.randn(TENSOR_SHAPE[0] * (mesh.size() if mesh is not None else 1), TENSOR_SHAPE[1], device=device)
        p = torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)]) if mesh is not None else t)
        p.grad = torch.ones_like(p)
        out.append(p)
    return out


def per_tensor_costs(run, device, mesh, iters: int) -> Dict[str, float]:
    """Seconds per parameter tensor of the optimizer's step and of the gradient clip."""
    from partrain.parallel.grad_norm import clip_gradients
    from partrain.parallel.optimizer import make_torch_optimizer

    params = _params(device, mesh)
    optimizer = make_torch_optimizer([{"params": params, "weight_decay": 0.1}], run.optim)
    step, clip = _medians([optimizer.step, lambda: clip_gradients(params, 1.0)], iters)
    return {"optimizer": step / TENSORS, "clip": clip / TENSORS}


def _model_step(run, model, tp: int) -> Callable[[], None]:
    """Forward + backward of the one-layer model with partrain's loss: the head and cross-entropy on the
    final hidden states (train.loss_chunk_tokens), under loss parallel when the model is TP-sliced."""
    from partrain.models.adapters import get_adapter
    from partrain.models.chunked_loss import head_loss_sum
    from partrain.parallel.tensor_parallel import loss_context

    adapter = get_adapter(model)
    base, head = model.get_submodule(adapter.base_prefix), model.get_submodule(adapter.lm_head_path)
    context = loss_context(tp, True)
    tokens = torch.randint(0, int(model.config.vocab_size), (run.train.micro_batch_size, run.train.seq_len))
    chunk = run.train.loss_chunk_tokens or tokens.numel()

    def step():
        with context():
            hidden = base(input_ids=tokens).last_hidden_state
            (head_loss_sum(head, hidden, tokens, chunk) / tokens.numel()).backward()

    return step


def tp_seconds(run, spec: PlanSpec, device, mesh, iters: int, profile: dict) -> Dict[str, float]:
    """What partrain's TP wrappers add to one layer's forward + backward at the mesh's degree ("layer",
    beyond the compute model's kernels for its local shapes) and to the embedding, head and loss
    ("ends", beyond the same plain)."""
    from partrain.models.adapters import get_adapter
    from partrain.parallel.tensor_parallel import parallelize_ends, parallelize_layers

    tp = mesh.size()
    plain_model, plain_layer, rotary = one_layer(run, device)
    model, _, _ = one_layer(run, device)
    adapter = get_adapter(model)
    parallelize_layers(model, adapter, mesh, spec.tp_sp, True)
    parallelize_ends(model, adapter, mesh, spec.tp_sp, True)
    layer_plain, layer_tp, whole_plain, whole_tp = _medians(
        [
            layer_step(plain_layer, rotary, spec, device)[1],
            layer_step(adapter.layers(model)[0], rotary, spec, device)[1],
            _model_step(run, plain_model, 1),
            _model_step(run, model, tp),
        ],
        iters,
    )
    tokens = spec.mbs * spec.seq / spec.sp
    model = model_of_profile(profile, "bench")[0]
    kernels = model.layer_time(shape_of_spec(dataclasses.replace(spec, tp=tp), False, tokens))
    # The compute model's kernels at this moment's speed: the plain layer, timed call by call beside the
    # wrapped one, over what the model gives it (the machine drifts between the matmul rows and now,
    # and a difference of two close figures would carry that drift whole).
    plain_kernels = model.layer_time(shape_of_spec(dataclasses.replace(spec, tp=1), False, tokens))
    drift = layer_plain / plain_kernels if plain_kernels > 0 else 1.0
    return {
        "layer": max(0.0, layer_tp - kernels * drift),
        "ends": max(0.0, (whole_tp - layer_tp) - (whole_plain - layer_plain)),
    }


def measure_host(run, spec: PlanSpec, device, iters: int, profile: dict) -> dict:
    """The profile's "host" block (CPU), given the profile's measured rows so far; {} when this process
    cannot hold a process group of its own."""
    end = _fake_world(max(2, spec.tp))
    if end is None:
        return {}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (max(2, spec.tp),))
        rounds = max(4 * iters, 20)
        plain = per_tensor_costs(run, device, None, rounds)
        dtensor = per_tensor_costs(run, device, mesh, rounds)
        block = {
            "optimizer_s_per_tensor": {"plain": plain["optimizer"], "dtensor": dtensor["optimizer"]},
            "clip_s_per_tensor": {"plain": plain["clip"], "dtensor": dtensor["clip"]},
        }
        try:
            tp = tp_seconds(run, spec, device, mesh, rounds, profile)
            block["tp_layer_s"], block["tp_ends_s"] = tp["layer"], tp["ends"]
        except Exception:  # noqa: BLE001 - an architecture without a TP plan: the planner refuses its tp > 1
            pass
        return {"host": block}
    finally:
        end()
