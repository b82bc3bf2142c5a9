"""Baseline training loops for benchmarks/dp.py: no partrain code except the data loader.

    python hf_loop.py SPEC.json OUT.json plain                         (one process)
    torchrun --standalone --nproc-per-node=2 hf_loop.py SPEC.json OUT.json accelerate-ddp
    torchrun --standalone --nproc-per-node=2 hf_loop.py SPEC.json OUT.json accelerate-fsdp

SPEC.json (written by dp.py from the composed partrain config): arch, HF config kwargs, data meta
path, seq_len, global/micro batch, steps, seed, lr, AdamW betas/eps/weight decay, grad_clip.

- plain: the HF model from AutoModelForCausalLM.from_config, AdamW(foreach=False), microbatches
  with loss / n, torch.nn.utils.clip_grad_norm_, optimizer.step. Nothing else.
- accelerate-ddp: `Accelerator(gradient_accumulation_steps=n)`, `prepare(model, optimizer)`,
  `accumulate()` (no_sync on all but the last microbatch), `accelerator.backward`,
  `accelerator.clip_grad_norm_` when gradients are synced. Each rank takes its contiguous half
  of every global batch (partrain's TokenBatches.rank_batch, the same rows partrain uses).
- accelerate-fsdp: the same with `FullyShardedDataParallelPlugin(fsdp_version=2,
  auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True)` (one FSDP unit per
  decoder block plus the root, like partrain zero_stage=3).

Timing, rank 0, every step the same way as partrain's `step_time_s`: perf_counter from before
zero_grad / the data fetch to after optimizer.step, no barrier. OUT.json gets the per-step times,
losses, and the per-rank model-state bytes (params + grads + optimizer state, local shards).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F


def lr_at(step: int, spec: dict) -> float:
    """Warmup + cosine, the same schedule partrain uses (cheap; kept so the optimizer does the same work)."""
    lr, warm, total, floor = spec["lr"], spec["warmup_steps"], spec["steps"], spec["lr"] * spec["min_lr_ratio"]
    if warm and step < warm:
        return lr * (step + 1) / warm
    progress = min(1.0, (step - warm) / max(1, total - warm))
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_model(spec: dict) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(spec["seed"])
    config = AutoConfig.for_model(spec["arch"], **spec["config"])
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation=spec["attn_implementation"], dtype=torch.float32
    )
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


def loss_of(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Labels from TokenBatches are already shifted: plain cross-entropy on the logits.
    position_ids = torch.arange(x.shape[1]).unsqueeze(0)
    logits = model(input_ids=x, position_ids=position_ids).logits
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def state_bytes(model: torch.nn.Module, optimizer) -> int:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    inner = getattr(optimizer, "optimizer", optimizer)
    for st in inner.state.values():
        for t in st.values():
            if torch.is_tensor(t) and t.dim() > 0:
                total += local(t).numel() * t.element_size()
    return total


def open_batches(spec: dict):
    from partrain.data import TokenBatches, open_packed

    packed = open_packed(spec["meta_path"])
    return TokenBatches.from_packed(packed, spec["seq_len"], spec["global_batch_size"], spec["seed"])


def run_plain(spec: dict) -> dict:
    model = build_model(spec)
    optimizer = make_optimizer(model, spec)
    batches = open_batches(spec)
    b = spec["micro_batch_size"]
    times, losses, mem = [], [], 0
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        optimizer.zero_grad(set_to_none=True)
        inputs, labels = batches.rank_batch(step, 0, 1)
        micro = list(zip(inputs.split(b), labels.split(b)))
        loss_sum = 0.0
        for x, y in micro:
            loss = loss_of(model, x, y)
            (loss / len(micro)).backward()
            loss_sum += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec["grad_clip"])
        optimizer.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss_sum / len(micro))
        if step == 0:
            mem = state_bytes(model, optimizer)
    return {"step_time_s": times, "losses": losses, "ranks": [{"rank": 0, "model_state_bytes": mem}]}


def run_accelerate(spec: dict, fsdp: bool) -> dict:
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    world = int(os.environ["WORLD_SIZE"])
    b = spec["micro_batch_size"]
    rows = spec["global_batch_size"] // world
    n_micro = rows // b
    kwargs = {}
    plugin = None
    if fsdp:
        from accelerate import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap", reshard_after_forward=True
        )
        kwargs["fsdp_plugin"] = plugin
    # cpu=True: without it Accelerate ignores torchrun's env on a machine without an accelerator
    # and every process trains alone (DistributedType.NO).
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=n_micro, **kwargs)
    forced = False
    if fsdp and accelerator.distributed_type != DistributedType.FSDP:
        # Accelerate 1.15 turns FSDP on only for accelerator device types; on CPU it stays
        # MULTI_CPU (plain DDP). Switch its state to FSDP so prepare() takes its FSDP2 path
        # (fsdp2_prepare_model: fully_shard per decoder block, then the root), which runs on gloo.
        # Both singletons: AcceleratorState() re-copies PartialState's shared dict whenever it is
        # instantiated again (prepare() does), which would silently undo a change to one of them.
        from accelerate.state import PartialState

        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
        forced = True
    model = build_model(spec)
    optimizer = make_optimizer(model, spec)
    model, optimizer = accelerator.prepare(model, optimizer)
    batches = open_batches(spec)
    rank = accelerator.process_index
    times, losses, mem = [], [], 0
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        optimizer.zero_grad(set_to_none=True)
        inputs, labels = batches.rank_batch(step, rank, world)
        loss_sum = 0.0
        for x, y in zip(inputs.split(b), labels.split(b)):
            with accelerator.accumulate(model):
                loss = loss_of(model, x, y)
                accelerator.backward(loss)  # divides by gradient_accumulation_steps
                loss_sum += loss.item()
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), spec["grad_clip"])
                optimizer.step()  # a no-op until the last microbatch (AcceleratedOptimizer)
        times.append(time.perf_counter() - t0)
        losses.append(loss_sum / n_micro)
        if step == 0:
            mem = state_bytes(model, optimizer)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank, "model_state_bytes": mem})
    if fsdp and not accelerator.is_fsdp2:
        raise RuntimeError(f"Accelerate left FSDP2 mode during the run: {accelerator.distributed_type}")
    kind = "FSDP2" if fsdp else f"DDP (DistributedType.{str(accelerator.distributed_type).split('.')[-1]})"
    if forced:
        kind += " (forced on CPU: Accelerate 1.15 enables FSDP only for accelerator devices)"
    return {
        "step_time_s": times,
        "losses": losses,
        "ranks": gathered,
        "kind": kind,
        "distributed_type": str(accelerator.distributed_type),
    }


def main() -> None:
    spec_path, out_path, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if mode == "plain":
        result = run_plain(spec)
        result["threads"] = torch.get_num_threads()
        with open(out_path, "w") as f:
            json.dump(result, f)
        return
    from _rank_exit import (
        run_rank_and_exit,  # sibling module (torchrun runs this file as a script)
    )

    def work() -> dict:
        result = run_accelerate(spec, fsdp=(mode == "accelerate-fsdp"))
        result["threads"] = torch.get_num_threads()
        return result

    run_rank_and_exit(work, out_path)


if __name__ == "__main__":
    main()
