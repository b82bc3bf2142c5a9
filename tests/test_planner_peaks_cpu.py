"""The planner's forward and backward transient peaks (planner/peaks.py) against the CPU allocator.

One bf16-autocast training microbatch of a 2-layer HF model (partrain's loss and recompute
wrapping) with a 16000-token vocabulary (so the loss terms are large) runs under torch.profiler
with memory events; the allocator's running total gives the peak above what was allocated before
(weights; gradients are None after zero_grad):
- up to the end of the forward and loss: the planner's saved activations + `forward_transient`
  (the logits and their fp32 copy; with full recompute autocast's cached weight copies, without
  which the llama case would be 7% under);
- during the backward: + `backward_transient` (the fp32 loss gradients here: these layers are small).
The H200 counterpart of the forward's peak is tests/test_planner_gpu_calibration.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from partrain.blueprint.planner.estimate import estimate_spec
from partrain.blueprint.planner.memory_calibration import calib_spec
from partrain.blueprint.planner.peaks import backward_transient, forward_transient
from partrain.blueprint.planner.rank_state import pipeline_ranks
from partrain.blueprint.planner.step_inputs import step_inputs
from partrain.models.adapters import get_adapter
from partrain.models.loss import forward_loss
from partrain.parallel.recompute import apply_recompute

VOCAB, HIDDEN, FFN, SEQ, MICRO = 16000, 256, 1024, 128, 2
MARK = 123457
"""Size of a marker allocation between the forward and the backward (bytes; no op allocates it)."""


def _model(arch: str, recompute: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            attn_implementation="sdpa",
            use_cache=False,
        )
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            n_positions=SEQ,
            n_inner=FFN,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
            use_cache=False,
        )
        model = GPT2LMHeadModel(cfg)
    model.train()
    apply_recompute(model, get_adapter(model), recompute)  # partrain's own wrapping
    return model


def _measured_peaks(model) -> tuple:
    """(forward peak, backward peak) of allocated bytes above the start, from the profiler's events."""
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (MICRO, SEQ), generator=g) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # warm up (lazy buffers), then measure a clean step
        loss = forward_loss(model, x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = forward_loss(model, x, y)
        marker = torch.empty(MARK, dtype=torch.uint8)
        del marker
        loss.backward()
    allocs = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            allocs.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        stack.extend(node.children)
    allocs.sort()
    base = allocs[0][2] - allocs[0][1]
    split = next(i for i, a in enumerate(allocs) if a[1] == MARK)
    return max(a[2] for a in allocs[:split]) - base, max(a[2] for a in allocs[split + 2 :]) - base


@pytest.mark.parametrize("arch,recompute", [("llama", "full"), ("gpt2", "none")])
def test_forward_and_backward_peaks_match_the_cpu_allocator(arch, recompute):
    fwd, bwd = _measured_peaks(_model(arch, recompute))
    row = dict(arch=arch, vocab=VOCAB, hidden=HIDDEN, heads=4, kv_heads=2 if arch == "llama" else 4, ffn=FFN)
    spec = calib_spec(dict(row, seq=SEQ, micro=MICRO, recompute=recompute))
    spec = dataclasses.replace(spec, cluster=dataclasses.replace(spec.cluster, device="cpu"))
    s, rank = step_inputs(spec), pipeline_ranks(spec)[0]
    saved = estimate_spec(spec, detail=False)["memory_bytes"]["activations"]
    planned_fwd = saved + forward_transient(spec, rank, s)
    planned_bwd = saved + backward_transient(spec, rank, s)
    ratios = (planned_fwd / fwd, planned_bwd / bwd)
    assert all(r == pytest.approx(1.0, abs=0.01) for r in ratios), (arch, recompute, fwd, bwd, ratios)
