"""Megatron-SP: saved-activation bytes per decoder layer and step time, tp=1 vs tp=2 + SP.

    python benchmarks/sp_memory.py [--seq 256] [--micro 4] [--steps 8] [--recompute none|selective] [--repeat 3]

Real gloo processes (one for tp=1, two for tp=2), one thread each, the same model, data and seed.
Bytes: what decoder layer 1 saves for backward during one microbatch's forward, counted by
saved-tensor hooks (`partrain.runtime.activations.ModuleSavedActivations`: each storage once,
parameters excluded). Modes at tp=2 + SP:

- sharded: partrain's runtime (`partrain.parallel.megatron_sp`): each block's column-parallel
  projections save the sequence shard and re-gather it in backward (overlapped with the GEMMs);
- torch: torch's ColwiseParallel / SequenceParallel styles (`apply_tp(..., sharded_saves=False)`,
  Llama only; GPT-2's Conv1D has no torch style), which save the gathered input.

Checks the issue's bound (sharded bytes <= 1.05 x tp1 bytes / 2) and prints step times side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from recompute import CONFIGS  # the same small models as benchmarks/recompute.py (this folder)

from partrain.blueprint.config.schema import ModelConfig
from partrain.runtime.spawn import run_spawned


def _measure(rank: int, world: int, arch: str, mode: str, recompute: str, seq: int, micro: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.loss import forward_loss
    from partrain.models.materialize import materialize
    from partrain.parallel.recompute import apply_recompute
    from partrain.parallel.tensor_parallel import apply_tp, loss_context
    from partrain.runtime.activations import ModuleSavedActivations

    cfg = ModelConfig(arch=arch, config=CONFIGS[arch])
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = build_meta_model(cfg)
    adapter = get_adapter(model)
    apply_tp(model, adapter, mesh, sequence_parallel=world > 1, sharded_saves=mode != "torch")
    apply_recompute(model, adapter, recompute)
    materialize(model, cfg, seed=3, device="cpu").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(0)
    layer = adapter.layers(model)[1]
    times, losses, saved = [], [], None
    for step in range(steps):
        ids = torch.randint(0, 256, (micro, seq + 1), generator=gen)
        t0 = time.perf_counter()
        with loss_context(world, True)():
            counter = ModuleSavedActivations(layer, model.parameters()) if step == 0 else contextlib.nullcontext()
            with counter:
                loss = forward_loss(model, ids[:, :-1], ids[:, 1:])
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        saved = counter.total if step == 0 else saved
    return {"layer_saved": saved, "step_ms": statistics.median(times[2:] or times) * 1e3, "losses": losses}


def run(arch: str, mode: str, recompute: str, seq: int, micro: int, steps: int) -> dict:
    world = 1 if mode == "tp1" else 2
    with tempfile.TemporaryDirectory() as folder:
        return run_spawned(_measure, world, Path(folder), arch, mode, recompute, seq, micro, steps, timeout_s=600)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--recompute", default="none", choices=["none", "selective"])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"hidden 256, 4 layers, micro batch {args.micro} x seq {args.seq}, fp32, gloo, 1 thread per rank")
    print(f"recompute={args.recompute}; saved bytes: decoder layer 1, one microbatch, per rank")
    head = f"{'model':<6} {'mode':<16} {'layer KiB':>10} {'vs tp1/2':>9} {'step ms':>9} {'vs sharded':>11}"
    print(head)
    ok = True
    for arch in ("gpt2", "llama"):
        modes = ["tp1", "sharded"] + (["torch"] if arch == "llama" else [])
        # Modes take turns `--repeat` times and each keeps its fastest median: on a shared machine the
        # load moves between runs; the turns spread it over the modes.
        r: dict = {}
        for _ in range(args.repeat):
            for m in modes:
                got = run(arch, m, args.recompute, args.seq, args.micro, args.steps)
                if m not in r or got["step_ms"] < r[m]["step_ms"]:
                    r[m] = got
        half = r["tp1"]["layer_saved"] / 2
        for m in modes:
            label = {"tp1": "tp1", "sharded": "tp2+SP sharded", "torch": "tp2+SP torch"}[m]
            ratio = "" if m == "tp1" else f"{r[m]['layer_saved'] / half:.3f}"
            vs = "" if m == "tp1" else f"{r[m]['step_ms'] / r['sharded']['step_ms']:.2f}"
            print(
                f"{arch:<6} {label:<16} {r[m]['layer_saved'] / 1024:>10.1f} {ratio:>9} {r[m]['step_ms']:>9.1f} {vs:>11}"
            )
        ok &= r["sharded"]["layer_saved"] <= 1.05 * half
        drift = max(abs(a - b) for a, b in zip(r["tp1"]["losses"], r["sharded"]["losses"]))
        print(f"{arch}: max |loss(tp1) - loss(tp2+SP)| over {args.steps} steps = {drift:.2e}")
    print(f"sharded saves <= 1.05 x tp1/2 per layer: {'OK' if ok else 'NO'}")


if __name__ == "__main__":
    main()
