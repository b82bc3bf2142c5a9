"""Sequence/context parallelism: saved-activation bytes per rank against the planner, and ring vs Ulysses time.

    python benchmarks/sp.py            # everything (about 3-4 min on 2 idle cores)
    python benchmarks/sp.py --quick    # activations only, plus a short op timing (about 1 min)

Every sp rank is a real gloo process (`partrain.runtime.spawn.run_spawned`, one torch thread
each) that builds the model with partrain's own code: `build_meta_model` -> `apply_sp` (the sp
attention wiring of `partrain.parallel.context_parallel`) -> `materialize`; the rank's tokens are
cut by `SequenceShard.take`, positions and loss come from `SequenceShard.forward_loss`.

1. Activations: bytes saved for backward during one microbatch's forward + loss, per rank
   (`partrain.runtime.activations.SavedActivations`: each storage once, parameters and their
   views excluded), at sp=1, sp=2 Ulysses and sp=2 ring, for llama-tiny (GQA: 4 heads, 2 KV heads)
   and gpt2-tiny, fp32 and bf16 autocast, against the planner (`estimate(v, mixed="autocast")`,
   "activations" of the worst rank). Checks: predicted within 15% of measured; measured sp=2
   within 15% of measured sp=1 / 2.
2. Step time (not with --quick): forward + backward + gradient all-reduce over the sp group (DDP) +
   AdamW of a compute-bound Llama (hidden 256, 4 layers, 8 heads / 4 KV heads, 1024 tokens),
   median over the timed steps, slowest rank; sp=1 (rank 0 alone), sp=2 Ulysses and sp=2 ring
   alternate step by step in the same two processes, same data. Ideal sp=2 / sp=1 on 2 free
   cores: 0.5 (each rank has half the tokens).
3. Op: `ring_attention` / `ulysses_attention` forward + backward alone at 2048 tokens
   (8 heads x 64) against full SDPA on the whole sequence, timed in the same two processes.

The "other load" column is the cores used by other processes meanwhile (benchmarks/_machine_load.py):
on this 2-core machine, timings taken with other load above ~0.3 cores are not worth comparing.
Exit code 0 when the activation checks hold, 3 when one misses.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TIME_MODEL = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    bos_token_id=0,
    eos_token_id=0,
)
ACT_MODELS = ("llama-tiny", "gpt2-tiny")
ACT_SEQ, ACT_MICRO = 512, 2
TOLERANCE = 0.15


# ---- what one rank runs --------------------------------------------------------------------------


def _build(cfg, mode: str, rank: int, world: int, seq: int):
    import torch.distributed as dist

    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize
    from partrain.parallel.context_parallel import SequenceShard, apply_sp

    model = build_meta_model(cfg)
    shard = SequenceShard(mode=mode, size=world, rank=rank, group=dist.group.WORLD) if world > 1 else None
    apply_sp(model, get_adapter(model), shard, seq)
    return materialize(model, cfg, seed=3, device="cpu").train(), shard


def _loss(model, shard, x, y):
    from partrain.models.loss import forward_loss

    if shard is None:
        return forward_loss(model, x, y)
    return shard.forward_loss(model, shard.take(x), shard.take(y))


def _saved_bytes(model_name: str, mode: str, precision: str, rank: int, world: int) -> int:
    import contextlib

    import torch

    from partrain.runtime.activations import SavedActivations
    from partrain.simulate.measure import model_config

    cfg = model_config(model_name)
    model, shard = _build(cfg, mode, rank, world, ACT_SEQ)
    ids = torch.randint(0, 256, (ACT_MICRO, ACT_SEQ + 1), generator=torch.Generator().manual_seed(0))
    cast = contextlib.nullcontext() if precision == "fp32" else torch.autocast("cpu", dtype=torch.bfloat16)
    with SavedActivations(model.parameters()) as counted, cast:
        loss = _loss(model, shard, ids[:, :-1], ids[:, 1:])
    loss.backward()  # the graph was complete
    return counted.total


def _activations_child(rank: int, world: int) -> dict:
    """sp=1 on rank 0 alone, then sp=2 with both ranks, every model and precision."""
    import torch.distributed as dist

    out = {}
    for model_name in ACT_MODELS:
        for precision in ("fp32", "bf16"):
            if rank == 0:
                out[f"{model_name}/{precision}/1/-"] = _saved_bytes(model_name, "ring", precision, 0, 1)
            dist.barrier()
            for mode in ("ulysses", "ring"):
                out[f"{model_name}/{precision}/2/{mode}"] = _saved_bytes(model_name, mode, precision, rank, world)
    return out


def _steps_child(rank: int, world: int, seq: int, steps: int) -> dict:
    """Median step time of sp=1 (rank 0 alone, rank 1 waiting at a barrier), sp=2 Ulysses and sp=2
    ring; the three alternate step by step so that load drifts hit them alike."""
    import torch
    import torch.distributed as dist

    from partrain.blueprint.config.schema import ModelConfig

    cfg = ModelConfig(arch="llama", config=TIME_MODEL)
    runs = {}
    if rank == 0:
        model, _ = _build(cfg, "ring", 0, 1, seq)
        runs["sp=1"] = (model, None, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False))
    for mode in ("ulysses", "ring"):
        model, shard = _build(cfg, mode, rank, world, seq)
        ddp = torch.nn.parallel.DistributedDataParallel(model)  # the gradient all-reduce over sp
        runs[f"sp=2 {mode}"] = (ddp, shard, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False))
    gen = torch.Generator().manual_seed(0)
    times = {name: [] for name in ("sp=1", "sp=2 ulysses", "sp=2 ring")}
    for _ in range(steps):
        ids = torch.randint(0, 256, (1, seq + 1), generator=gen)
        for name in times:
            dist.barrier()
            if name in runs:
                model, shard, opt = runs[name]
                t0 = time.perf_counter()
                _loss(model, shard, ids[:, :-1], ids[:, 1:]).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                times[name].append(time.perf_counter() - t0)
    skip = 2 if steps > 4 else 1
    return {name: statistics.median(t[skip:]) for name, t in times.items() if t}


def _op_child(rank: int, world: int, seq: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from partrain.parallel.sequence_attention import ring_attention, ulysses_attention

    gen = torch.Generator().manual_seed(rank)
    shape = (1, 8, seq // world, 64)
    q, k, v = (torch.randn(*shape, generator=gen, requires_grad=True) for _ in range(3))
    qf, kf, vf = (torch.randn(1, 8, seq, 64, generator=gen, requires_grad=True) for _ in range(3))

    def sdpa(a, b, c):
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)

    cases = {
        "full SDPA, whole sequence": lambda: sdpa(qf, kf, vf).sum().backward(),
        "ring (zig-zag, fused CPU blocks)": lambda: (
            ring_attention(q, k, v, None, causal=True, zigzag=True).sum().backward()
        ),
        "ring (zig-zag, fp32 math blocks)": lambda: (
            ring_attention(q, k, v, None, causal=True, zigzag=True, block_kernel="math").sum().backward()
        ),
        "ulysses (SDPA on head shards)": lambda: ulysses_attention(q, k, v, None, sdpa).sum().backward(),
    }
    out = {}
    for name, fn in cases.items():
        ts = []
        for _ in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        out[name] = statistics.median(ts[1:])
    return out


# ---- the parent --------------------------------------------------------------------------------


def _spawn(fn, world: int, *args, settle_s: float = 5.0):
    from _machine_load import ForeignLoad, settle

    from partrain.runtime.spawn import run_spawned

    settle(settle_s)
    with tempfile.TemporaryDirectory() as folder, ForeignLoad() as load:
        results = run_spawned(fn, world, Path(folder), *args, timeout_s=1200)
    return results, load.cores


def _predicted(model_name: str, sp: int, mode: str, precision: str) -> int:
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner.estimate import estimate
    from partrain.blueprint.validate import validate

    v = validate(
        compose(
            [
                f"model={model_name}",
                "cluster=local-cpu",
                f"cluster.devices_per_node={sp}",
                "parallel.dp=1",
                f"parallel.sp={sp}",
                f"parallel.sp_mode={mode}",
                f"train.seq_len={ACT_SEQ}",
                f"train.micro_batch_size={ACT_MICRO}",
                f"train.global_batch_size={ACT_MICRO}",
                f"train.precision={precision}",
            ]
        )
    )
    return estimate(v, mixed="autocast")["memory_bytes"]["activations"]


def activations(settle_s: float) -> bool:
    results, load = _spawn(_activations_child, 2, settle_s=settle_s)
    merged = {key: [r[key] for r in results if key in r] for key in results[0]}
    print(f"1. saved activations per rank, one microbatch of {ACT_MICRO} x {ACT_SEQ} tokens (MiB = 2**20 bytes)")
    print(
        f"{'model':<11} {'prec':<5} {'sp':>2} {'mode':<8} {'measured MiB':>13} {'predicted MiB':>14} "
        f"{'pred/meas':>9} {'meas / sp1':>10} {'check':>6}"
    )
    ok = True
    for key, values in merged.items():
        model_name, precision, sp, mode = key.split("/")
        sp = int(sp)
        measured = max(values)
        same = len(set(values)) == 1
        predicted = _predicted(model_name, sp, mode if sp > 1 else "ring", precision)
        base = max(merged[f"{model_name}/{precision}/1/-"])
        ratio = measured / base
        good = abs(predicted / measured - 1) <= TOLERANCE and abs(ratio * sp - 1) <= TOLERANCE and same
        ok &= good
        print(
            f"{model_name:<11} {precision:<5} {sp:>2} {mode:<8} {measured / 2**20:>13.3f} {predicted / 2**20:>14.3f} "
            f"{predicted / measured:>9.3f} {ratio:>10.3f} {'ok' if good else 'MISS':>6}"
            + ("" if same else "  (ranks differ)")
        )
    print(f"   (other load during the runs: {load:.2f} cores)")
    return ok


def step_times(seq: int, steps: int, settle_s: float) -> None:
    results, load = _spawn(_steps_child, 2, seq, steps, settle_s=settle_s)
    base = results[0]["sp=1"]
    print(
        f"2. step time, Llama hidden 256, 4 layers, 8 heads / 4 KV heads, 1 x {seq} tokens, fp32, "
        f"median of {steps} steps less warm-up, slowest rank (other load {load:.2f} cores)"
    )
    print(f"{'layout':<16} {'step ms':>9} {'vs sp=1':>8}")
    for name in ("sp=1", "sp=2 ulysses", "sp=2 ring"):
        t = max(r[name] for r in results if name in r)
        print(f"{name:<16} {t * 1e3:>9.1f} {t / base:>8.2f}")
    print(
        "   sp=1 runs on rank 0 while rank 1 waits, alternating with the sp=2 steps; "
        "ideal sp=2 / sp=1 = 0.50 (half the tokens per rank) with two free cores"
    )


def op_times(seq: int, reps: int, settle_s: float) -> None:
    results, load = _spawn(_op_child, 2, seq, reps, settle_s=settle_s)
    print(
        f"3. attention op alone, forward + backward, {seq} tokens, 8 heads x 64, causal, fp32, sp=2, "
        f"median of {reps}, slowest rank (other load {load:.2f} cores)"
    )
    full = max(r["full SDPA, whole sequence"] for r in results)
    print(f"{'op':<36} {'ms':>8} {'vs full SDPA':>13}")
    for name in results[0]:
        t = max(r[name] for r in results)
        print(f"{name:<36} {t * 1e3:>8.1f} {t / full:>13.2f}")
    print(
        "   full SDPA runs on each of the two processes at the same time, so all rows share the same contention;"
        " ideal for sp=2: 0.50 (the zig-zag split gives each rank half the causal work)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="activations and a short op timing only")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length of the step-time runs")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--settle", type=float, default=5.0, help="wait up to this many s for a quiet machine before each run"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    ok = activations(args.settle)
    if not args.quick:
        step_times(args.seq, args.steps, args.settle)
    op_times(2048, 2 if args.quick else 5, args.settle)
    print(f"activation checks: {'all hold' if ok else 'MISSED'}; {time.perf_counter() - started:.0f} s")
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
