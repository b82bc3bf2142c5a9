"""Baseline for benchmarks/tp.py: transformers' own tensor parallelism, no partrain code except the data loader.

    torchrun --standalone --nproc-per-node=2 hf_tp.py SPEC.json OUT.json [pretrained|from-config] [PROGRESS]

SPEC.json (written by tp.py from the composed partrain config): the HF checkpoint folder both
sides start from (`init_dir`, written with save_pretrained), the data meta path, seq_len,
global/micro batch, steps, seed, AdamW settings, grad_clip.

- pretrained (default): `AutoModelForCausalLM.from_pretrained(init_dir, tp_plan="auto")`, the way
  transformers documents TP (needs accelerate). HF's Llama plan: q/k/v, gate/up colwise, o/down
  rowwise, embedding `embedding_rowwise` (vocab-sharded DTensor parameters), norms replicated
  (plain tensors), lm_head `colwise_gather_output` (the full logits on every rank).
- from-config: the workaround for `from_config` (which rejects tp_plan): build the model, then
  `prepare_distribute_model(DistributedConfig(tp_size=N))` + `maybe_distribute_model`, then load
  the same weights.

Every rank trains on the whole global batch (TP has no data parallelism), in microbatches of
micro_batch_size with loss / n, cross-entropy on the gathered logits, gradient clipping to
grad_clip (norm over DTensor and plain gradients: `clip_grad_norm_` rejects the mix), AdamW
foreach=False. Timing, rank 0, as partrain's `step_time_s`: perf_counter from before zero_grad
and the data fetch to after optimizer.step, no barrier. OUT.json: per-step times and losses,
per-rank model-state bytes (params + grads + AdamW state, local shards, after step 1) and peak RSS.
With a PROGRESS path (4th argument), rank 0 also appends one line per finished step there.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F


def lr_at(step: int, spec: dict) -> float:
    """Warmup + cosine, the same schedule partrain uses."""
    lr, warm, total, floor = spec["lr"], spec["warmup_steps"], spec["steps"], spec["lr"] * spec["min_lr_ratio"]
    if warm and step < warm:
        return lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_model(spec: dict, mode: str, world: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    if mode == "pretrained":
        model = AutoModelForCausalLM.from_pretrained(
            spec["init_dir"], tp_plan="auto", dtype=torch.float32, attn_implementation=spec["attn_implementation"]
        )
    elif mode == "from-config":
        from safetensors.torch import load_file
        from transformers.distributed import DistributedConfig

        config = AutoConfig.from_pretrained(spec["init_dir"])
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(
            config, attn_implementation=spec["attn_implementation"], dtype=torch.float32
        )
        cls = type(model)
        dc, _, mesh_manager = cls.prepare_distribute_model(DistributedConfig(tp_size=world))
        model = cls.maybe_distribute_model(model, dc, mesh_manager)
        # The same starting weights as the pretrained path: copy each rank's part of the full tensors.
        from torch.distributed.tensor import DTensor

        full = load_file(os.path.join(spec["init_dir"], "model.safetensors"))
        with torch.no_grad():
            for name, p in model.named_parameters():
                value = full[name]
                if isinstance(p, DTensor):
                    from torch.distributed.tensor import distribute_tensor

                    value = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None).to_local()
                    p.to_local().copy_(value)
                else:
                    p.copy_(value)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    model.config.use_cache = False
    model.train()
    return model


def make_optimizer(model: torch.nn.Module, spec: dict) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=spec["lr"],
        betas=(spec["beta1"], spec["beta2"]),
        eps=spec["eps"],
        foreach=False,
    )


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Global L2 norm over DTensor (sharded) and plain (replicated) gradients, then scale.

    `torch.nn.utils.clip_grad_norm_` fails on HF's TP model ("aten._foreach_norm.Scalar got mixed
    torch.Tensor and DTensor": the norms stay plain tensors), so: one norm per kind, the DTensor
    one reduced by full_tensor() (one all-reduce), replicated ones counted once.
    """
    from torch.distributed.tensor import DTensor

    sharded, plain = [], []
    for p in parameters:
        if p.grad is not None:
            (sharded if isinstance(p.grad, DTensor) else plain).append(p.grad)
    square = torch.zeros((), dtype=torch.float32)
    if sharded:
        norm = torch.nn.utils.get_total_norm(sharded, norm_type=2.0)
        square = square + norm.full_tensor() ** 2
    if plain:
        square = square + torch.nn.utils.get_total_norm(plain, norm_type=2.0) ** 2
    total = square.sqrt()
    if max_norm > 0:
        for grads in (sharded, plain):
            if grads:
                torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total)
    return float(total)


def loss_of(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Labels from TokenBatches are already shifted: plain cross-entropy on the (gathered) logits.
    position_ids = torch.arange(x.shape[1]).unsqueeze(0)
    logits = model(input_ids=x, position_ids=position_ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)


def state_bytes(model: torch.nn.Module, optimizer) -> int:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for st in optimizer.state.values():
        for t in st.values():
            if torch.is_tensor(t) and t.dim() > 0:
                total += local(t).numel() * t.element_size()
    return total


def open_batches(spec: dict):
    from partrain.data import TokenBatches, open_packed

    packed = open_packed(spec["meta_path"])
    return TokenBatches.from_packed(packed, spec["seq_len"], spec["global_batch_size"], spec["seed"])


def run(spec: dict, mode: str, progress_path: str = "") -> dict:
    from torch.distributed.tensor import DTensor

    world = int(os.environ["WORLD_SIZE"])
    model = build_model(spec, mode, world)
    rank = dist.get_rank()
    sharded = [n for n, p in model.named_parameters() if isinstance(p, DTensor)]
    if not sharded:
        raise RuntimeError("transformers did not shard any parameter: its tensor parallelism is not active")
    optimizer = make_optimizer(model, spec)
    batches = open_batches(spec)
    b = spec["micro_batch_size"]
    times, losses, mem = [], [], 0
    # One line per finished step (rank 0), so tp.py can read the workers' CPU time at step boundaries.
    progress = open(progress_path, "a", buffering=1) if rank == 0 and progress_path else None
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        optimizer.zero_grad(set_to_none=True)
        inputs, labels = batches.rank_batch(step, 0, 1)  # every TP rank sees the whole batch
        micro = list(zip(inputs.split(b), labels.split(b)))
        loss_sum = 0.0
        for x, y in micro:
            loss = loss_of(model, x, y)
            (loss / len(micro)).backward()
            loss_sum += loss.item()
        clip_grad_norm(model.parameters(), spec["grad_clip"])
        optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss_sum / len(micro))
        if step == 0:
            mem = state_bytes(model, optimizer)
        if progress is not None:
            progress.write(json.dumps({"step": step + 1, "step_time_s": times[-1]}) + "\n")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "model_state_bytes": mem, "peak_rss_bytes": peak})
    return {
        "step_time_s": times,
        "losses": losses,
        "ranks": gathered,
        "mode": mode,
        "sharded_params": len(sharded),
        "params": sum(1 for _ in model.parameters()),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    mode = sys.argv[3] if len(sys.argv) > 3 else "pretrained"
    progress_path = sys.argv[4] if len(sys.argv) > 4 else ""
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from _rank_exit import (
        run_rank_and_exit,  # sibling module (torchrun runs this file as a script)
    )

    def work() -> dict:
        if not dist.is_initialized():
            import datetime

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout_s", 120)))
        return run(spec, mode, progress_path)

    run_rank_and_exit(work, out_path)


if __name__ == "__main__":
    main()
