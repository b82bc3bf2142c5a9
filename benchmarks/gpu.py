"""partrain on one GPU against a plain HF training loop: tokens/s, MFU and peak memory side by side.

    python benchmarks/gpu.py                          # CUDA: the 886M Llama of shared/reference/gpu-h200
    python benchmarks/gpu.py --device cpu --tiny      # a tiny Llama on CPU: checks the script works

Variants: partrain eager and compiled (`train.compile`), zero_stage 0 and 3 (FSDP2 on one rank),
recompute none and full; the plain loop (HF model, autocast, fused AdamW, the way
shared/reference/gpu-h200/hf_loop.py trains) eager and with each decoder layer compiled. Every
variant trains the same model shape on the same token batches; ratios are to the plain eager loop
measured in the same invocation. On CUDA each variant runs in its own process (clean peak memory
and compile caches); with --tiny they share this one.

No Hydra: the run config is built from partrain's schema dataclasses, so the script needs only
torch, transformers and partrain's source on PYTHONPATH (see benchmarks/README.md, "GPU").
MFU counts 6 x parameters (without the input embedding) x tokens + 12 x layers x hidden x seq x
tokens (attention, non-causal count, as the reference does) against --peak-tflops.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # partrain from this checkout

BIG = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16)
BIG.update(num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
TINY.update(vocab_size=256, max_position_embeddings=128, tie_word_embeddings=False)

PARTRAIN = {
    # name: (compile, zero_stage, recompute)
    "partrain eager z0": (False, 0, "none"),
    "partrain compiled z0": (True, 0, "none"),
    "partrain eager z3": (False, 3, "none"),
    "partrain compiled z3": (True, 3, "none"),
    "partrain eager full-recompute": (False, 0, "full"),
    "partrain compiled full-recompute": (True, 0, "full"),
}
HF = {"hf eager": False, "hf compiled": True}
VARIANTS = list(HF) + list(PARTRAIN)


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny Llama, short sequences (CPU smoke run)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps per variant (default 30 / 3 tiny)")
    p.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 2048 / 32 tiny)")
    p.add_argument("--micro", type=int, default=0, help="sequences per microbatch (default 4 / 2 tiny)")
    p.add_argument("--accum", type=int, default=2, help="microbatches per step")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's bf16 peak (H200: 989)")
    p.add_argument("--backend", default="", help="torch.compile backend (default inductor; aot_eager on CPU)")
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # run one variant, print its JSON
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    a = p.parse_args(argv)
    a.steps = a.steps or (3 if a.tiny else 30)
    a.seq = a.seq or (32 if a.tiny else 2048)
    a.micro = a.micro or (2 if a.tiny else 4)
    a.backend = a.backend or ("inductor" if a.device == "cuda" else "aot_eager")
    a.precision = "bf16" if a.device == "cuda" else "fp32"
    a.model = dict(TINY if a.tiny else BIG)
    return a


def _batches(a):
    """The token batches every variant trains on: [micro x accum, seq] per step, seeded."""
    g = torch.Generator().manual_seed(0)
    vocab, rows = a.model["vocab_size"], a.micro * a.accum
    return [torch.randint(0, vocab, (rows, a.seq), generator=g) for _ in range(a.steps)]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(step, a) -> dict:
    """Median step time over the steps after the first two (compilation, allocator warm-up)."""
    if a.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for ids in _batches(a):
        _sync(a.device)
        t0 = time.perf_counter()
        losses.append(step(ids))
        _sync(a.device)
        times.append(time.perf_counter() - t0)
    steady = times[2:] if len(times) > 3 else times[-1:]
    out = {"median_step_s": statistics.median(steady), "first_step_s": times[0], "loss": losses[-1]}
    if a.device == "cuda":
        out["peak_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def _flops_per_step(model: torch.nn.Module, a) -> float:
    embed = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embed
    tokens = a.seq * a.micro * a.accum
    m = a.model
    return 6 * params * tokens + 12 * m["num_hidden_layers"] * m["hidden_size"] * a.seq * tokens


def run_hf(a, compiled: bool) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**a.model, attn_implementation="sdpa", use_cache=False)).to(a.device)
    if compiled:
        for layer in model.model.layers:
            layer.compile(backend=a.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=a.device == "cuda")
    dtype = torch.bfloat16 if a.precision == "bf16" else None

    def step(ids: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=a.device)
        for x in ids.to(a.device).split(a.micro):
            with torch.autocast(a.device, dtype=dtype, enabled=dtype is not None):
                loss = model(input_ids=x, labels=x).loss / a.accum
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(total)

    out = _measure(step, a)
    out["flops_per_step"] = _flops_per_step(model, a)
    return out


def _run_config(a, compiled: bool, zero: int, recompute: str, float8: bool = False):
    from partrain.blueprint.config.schema import ClusterConfig, ModelConfig, ParallelConfig, RunConfig, TrainConfig

    cuda = a.device == "cuda"
    cluster = ClusterConfig(nodes=1, devices_per_node=1, device=a.device, backend="nccl" if cuda else "gloo")
    if cuda:
        cluster.peak_tflops, cluster.device_memory_gib = a.peak_tflops, 139.0
    train = TrainConfig(
        seq_len=a.seq,
        micro_batch_size=a.micro,
        global_batch_size=a.micro * a.accum,
        steps=a.steps,
        precision=a.precision,
        compile="true" if compiled else "false",
        compile_backend=a.backend,
        float8=float8,
    )
    model = ModelConfig(arch="llama", config=dict(a.model, bos_token_id=0, eos_token_id=0), name="bench-llama")
    parallel = ParallelConfig(dp=1, tp=1, pp=1, zero_stage=zero, recompute=recompute)
    return RunConfig(model=model, cluster=cluster, parallel=parallel, train=train)


def run_partrain(a, compiled: bool, zero: int, recompute: str, float8: bool = False) -> dict:
    """partrain's own path (validate -> mesh -> shard -> materialize -> wrap -> engine) on one rank."""
    import torch.nn.functional as F

    from partrain.blueprint.validate import validate
    from partrain.runtime.cuda_defaults import apply_device_defaults
    from partrain.runtime.mesh import build_mesh
    from partrain.train.assemble import build_engine

    v = validate(_run_config(a, compiled, zero, recompute, float8))
    device = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(device)
    apply_device_defaults(device)
    torch.manual_seed(v.run.train.seed)
    engine = build_engine(v, build_mesh(v.layout, device.type), device)

    def step(ids: torch.Tensor) -> float:
        engine.optimizer.zero_grad(set_to_none=True)
        loss = engine.forward_backward(ids, F.pad(ids[:, 1:], (0, 1), value=-100))
        engine.clip(1.0)
        engine.optimizer.step()
        return loss

    out = _measure(step, a)
    out["flops_per_step"] = _flops_per_step(engine.model_parts[0], a)
    return out


def run_variant(a, name: str) -> dict:
    if name in HF:
        row = run_hf(a, HF[name])
    else:
        row = run_partrain(a, *PARTRAIN[name])
    tokens = a.seq * a.micro * a.accum
    row.update(name=name, tokens_per_s=tokens / row["median_step_s"])
    row["mfu"] = row.pop("flops_per_step") / row["median_step_s"] / (a.peak_tflops * 1e12)
    return row


def _process_group(a):
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="partrain-gpu-bench-"), "store"), 1)
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", store=store, rank=0, world_size=1)


def _in_subprocess(argv, name: str) -> dict:
    cmd = [sys.executable, __file__, *argv, "--one", name]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"name": name, "error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def _table(rows, base) -> str:
    head = f"{'variant':34} {'tokens/s':>10} {'vs hf':>7} {'MFU':>6} {'peak alloc':>11} {'reserved':>9} {'1st step':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['name']:34} failed: {r['error']}")
            continue
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        mem = f"{r['peak_alloc_gib']:.2f} GiB" if "peak_alloc_gib" in r else "-"
        res = f"{r['peak_reserved_gib']:.2f}" if "peak_reserved_gib" in r else "-"
        lines.append(
            f"{r['name']:34} {r['tokens_per_s']:>10,.0f} {ratio:>6.3f}x {r['mfu']:>6.1%} {mem:>11} {res:>9}"
            f" {r['first_step_s']:>8.1f}s"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = _args(argv)
    if a.one:
        _process_group(a)
        print(json.dumps(run_variant(a, a.one)))
        return 0
    names = [n.strip() for n in a.only.split(",") if n.strip()] or VARIANTS
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        print(f"unknown variants {unknown}; known: {VARIANTS}", file=sys.stderr)
        return 2
    print(f"torch {torch.__version__}, device {a.device}, model {a.model}, seq {a.seq} x micro {a.micro} x {a.accum}")
    rows = []
    for name in names:
        if a.tiny:  # one process: the smoke run must stay quick
            _process_group(a)
            rows.append(run_variant(a, name))
            torch._dynamo.reset()
            gc.collect()
        else:
            rows.append(_in_subprocess([x for x in argv if x != "--json"], name))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    base = next((r for r in rows if r["name"] == "hf eager" and "error" not in r), None)
    print(json.dumps(rows, indent=1) if a.json else _table(rows, base))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
