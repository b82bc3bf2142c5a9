"""Baseline for benchmarks/ep.py: transformers' own expert parallelism, no partrain code except the data loader.

    torchrun --standalone --nproc-per-node=2 hf_ep.py SPEC.json OUT.json [PROGRESS]

SPEC.json (written by ep.py): the HF checkpoint folder both sides start from (`init_dir`), the data
meta path, seq_len, global/micro batch, steps, seed, AdamW settings, grad_clip, ep.

The model: `AutoModelForCausalLM.from_pretrained(init_dir, distributed_config=DistributedConfig(
ep_size=N, fsdp_size=N, ep_implementation="all_to_all"))`, the way transformers 5 documents EP:
dense parameters FSDP2-sharded over the N ranks, routed experts split over ep (each rank
owns E/N experts; efsdp = fsdp x tp / ep = 1), tokens exchanged with `all_to_all_single_autograd`.
`output_router_logits=True`, so HF adds router_aux_loss_coef x its load-balancing loss (partrain
adds the same coefficient by default). Each rank takes its contiguous share of every global batch
(partrain's TokenBatches.rank_batch: the rows partrain's dp ranks take), microbatches with loss / n,
gradient clipping over every (DTensor) gradient, AdamW foreach=False.

Timing, rank 0, as partrain's `step_time_s`: perf_counter from before zero_grad and the data
fetch to after optimizer.step, no barrier. OUT.json: per-step times, LM losses (cross-entropy only,
as partrain reports), per-rank model-state bytes (params + grads + AdamW state, local shards, after
step 1), peak RSS, and the token bytes each rank sent to other ranks through HF's
`all_to_all_single_autograd` in forward (its backward is the same exchange reversed: the same bytes).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hf_tp import lr_at, make_optimizer, open_batches, state_bytes  # sibling module: the same loop pieces as tp.py


def count_all_to_all(counter: dict) -> None:
    """Wrap HF's token all-to-all to add the bytes this rank sends to other ranks (forward calls)."""
    import transformers.distributed.expert_parallel as hf_ep

    inner = hf_ep.all_to_all_single_autograd

    def counted(x, out_sizes, in_sizes, group):
        me = dist.get_rank(group)
        row = x[0].numel() * x.element_size() if x.shape[0] else 0
        counter["sent_bytes"] += sum(n for j, n in enumerate(in_sizes) if j != me) * row
        counter["calls"] += 1
        return inner(x, out_sizes, in_sizes, group)

    hf_ep.all_to_all_single_autograd = counted


def build_model(spec: dict, world: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    dc = DistributedConfig(ep_size=spec["ep"], fsdp_size=world, ep_implementation="all_to_all")
    model = AutoModelForCausalLM.from_pretrained(
        spec["init_dir"], distributed_config=dc, dtype=torch.float32, attn_implementation=spec["attn_implementation"]
    )
    model.config.use_cache = False
    model.config.output_router_logits = True
    model.train()
    return model


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Global L2 norm of every gradient (DTensors on the dense and the expert meshes), then scale.
    Each DTensor's norm is reduced over its own mesh (full_tensor), then the squares are summed."""
    grads = [p.grad for p in parameters if p.grad is not None]
    square = torch.zeros((), dtype=torch.float32)
    for g in grads:
        n = torch.linalg.vector_norm(g)
        n = n.full_tensor() if hasattr(n, "full_tensor") else n
        square = square + n.float() ** 2
    total = square.sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale)
    return float(total)


def run(spec: dict, progress_path: str = "") -> dict:
    from torch.distributed.tensor import DTensor

    world, rank = dist.get_world_size(), dist.get_rank()
    counter = {"sent_bytes": 0, "calls": 0}
    count_all_to_all(counter)
    model = build_model(spec, world)
    experts = [n for n, p in model.named_parameters() if ".experts." in n and isinstance(p, DTensor)]
    if not experts:
        raise RuntimeError("transformers did not shard the experts: its expert parallelism is not active")
    local_experts = {n: tuple(p.to_local().shape) for n, p in model.named_parameters() if n in experts[:1]}
    optimizer = make_optimizer(model, spec)
    batches = open_batches(spec)
    b = spec["micro_batch_size"]
    coef = float(model.config.router_aux_loss_coef)
    times, losses, mem, sent_per_step = [], [], 0, []
    progress = open(progress_path, "a", buffering=1) if rank == 0 and progress_path else None
    for step in range(spec["steps"]):
        t0 = time.perf_counter()
        before = counter["sent_bytes"]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, spec)
        optimizer.zero_grad(set_to_none=True)
        inputs, labels = batches.rank_batch(step, rank, world)
        micro = list(zip(inputs.split(b), labels.split(b)))
        loss_sum = 0.0
        for x, y in micro:
            position_ids = torch.arange(x.shape[1]).unsqueeze(0)
            out = model(input_ids=x, position_ids=position_ids)
            lm = F.cross_entropy(out.logits.float().flatten(0, 1), y.flatten(), ignore_index=-100)
            loss = lm + coef * out.aux_loss if out.aux_loss is not None else lm
            (loss / len(micro)).backward()
            loss_sum += lm.item()
        clip_grad_norm(model.parameters(), spec["grad_clip"])
        optimizer.step()
        times.append(time.perf_counter() - t0)
        sent_per_step.append(counter["sent_bytes"] - before)
        mean = torch.tensor([loss_sum / len(micro)])
        dist.all_reduce(mean)  # not timed: the reported loss is the mean over ranks, as partrain's
        losses.append(float(mean) / world)
        if step == 0:
            mem = state_bytes(model, optimizer)
        if progress is not None:
            progress.write(json.dumps({"step": step + 1, "step_time_s": times[-1]}) + "\n")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = [None] * world
    dist.all_gather_object(
        gathered,
        {
            "rank": rank,
            "model_state_bytes": mem,
            "peak_rss_bytes": peak,
            "a2a_forward_sent_bytes_per_step": sent_per_step,
        },
    )
    return {
        "step_time_s": times,
        "losses": losses,
        "ranks": gathered,
        "expert_dtensors": len(experts),
        "local_expert_shape": local_experts,
        "aux_loss_coef": coef,
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    spec_path, out_path = sys.argv[1], sys.argv[2]
    progress_path = sys.argv[3] if len(sys.argv) > 3 else ""
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from _rank_exit import run_rank_and_exit  # sibling module (torchrun runs this file as a script)

    def work() -> dict:
        if not dist.is_initialized():
            import datetime

            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=spec.get("timeout_s", 120)))
        return run(spec, progress_path)

    run_rank_and_exit(work, out_path)


if __name__ == "__main__":
    main()
