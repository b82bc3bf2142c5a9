"""The planner's prediction of the GPU memory calibration rows (`kind=layer` of calib.jsonl, written
by shared/reference/gpu-h200/calib.py; kept as tests/fixtures/gpu_h200_calib.jsonl).

Each row is an HF decoder layer family (Llama or GPT-2: hidden, heads, kv_heads, ffn, vocab 32000)
run on CUDA with fp32 weights under bf16 autocast and SDPA (partrain's zero-0 runtime: the
planner's mixed="autocast"), micro x seq tokens, recompute none or full. What calib.py measured:

- `layer_saved_bytes`: saved-tensor hooks around one layer's forward (weights excluded, autocast's
  16-bit copies included): the planner's per-layer count (`step_inputs` -> `memory.layer_activations`);
- `model_saved_bytes`: the same around a 2-layer model's forward and loss: the planner's saved
  activations of the rank (layers + `memory.end_activations`);
- `step_peak_bytes_above_states`: torch.cuda.max_memory_allocated minus what was allocated before,
  read right after that forward and loss (before the backward, not after it): the
  planner's saved activations plus its forward transient (`peaks.forward_transient`).

Two terms belong to calib.py's harness, not to partrain's runtime, and are added here only:
- the layer alone gets rotary cos/sin built from position ids expanded to [micro, seq] (fp32,
  micro x seq x head_dim each; the model and partrain build them once per sequence, [1, seq]), and
  they are saved with it when it is not recomputed;
- calib.py passes labels to the HF model, whose forward holds the final norm's fp32 output
  (`last_hidden_state`) while it computes the loss; partrain computes the loss after the model
  returned, when that tensor is gone.
"""

from __future__ import annotations

from typing import Dict, Mapping

from partrain.blueprint.families import family
from partrain.blueprint.model_facts import model_facts
from partrain.blueprint.planner.estimate import estimate_spec
from partrain.blueprint.planner.peaks import forward_transient
from partrain.blueprint.planner.rank_state import pipeline_ranks
from partrain.blueprint.planner.spec import GIB, ClusterSpec, PlanSpec, model_extras
from partrain.blueprint.planner.step_inputs import step_inputs

CALIB_VOCAB = 32000
CALIB_LAYERS = 2
"""calib.py's model: 2 decoder layers, a vocabulary of 32000 (what model_saved and the peak count)."""

H200 = ClusterSpec(
    nodes=1,
    devices_per_node=1,
    device="cuda",
    device_memory_bytes=141 * GIB,
    peak_flops=989e12,
    intra_bw=450e9,
    inter_bw=50e9,
)


def calib_spec(row: Mapping) -> PlanSpec:
    """The PlanSpec of a calib row's 2-layer model on one H200 (bf16 autocast, zero 0); the row may
    name another "vocab" (calib.py: 32000)."""
    arch, seq, vocab = row["arch"], int(row["seq"]), int(row.get("vocab", CALIB_VOCAB))
    sizes = dict(hidden=row["hidden"], ffn=row["ffn"], layers=CALIB_LAYERS, heads=row["heads"])
    config = family(arch).hf_config(**sizes, kv_heads=row.get("kv_heads"), vocab=vocab, positions=seq)
    facts = model_facts(arch, config)
    micro = int(row["micro"])
    return PlanSpec(
        facts=facts,
        extras=model_extras(arch, config, None, facts),
        cluster=H200,
        tp=1,
        pp=1,
        dp=1,
        recompute=row["recompute"],
        seq=seq,
        mbs=micro,
        global_batch=micro,
        precision="bf16",
        mixed="autocast",
    )


def predict_calib_row(row: Mapping) -> Dict[str, float]:
    """The planner's figures for one `kind=layer` row (same keys as the row; see module docstring).
    "planner_*" keys are the planner's own numbers without calib.py's harness terms."""
    spec = calib_spec(row)
    f, s = spec.facts, step_inputs(spec)
    rank = pipeline_ranks(spec)[0]  # pp = 1: the rank holds the embedding, both layers and the head
    layer = s.acts[False][0]
    saved = estimate_spec(spec, detail=False)["memory_bytes"]["activations"]
    peak = saved + forward_transient(spec, rank, s)
    rotary = 2 * s.tokens * f.head_dim * 4 if family(f.arch).block != "gpt2" and spec.recompute != "full" else 0.0
    last_hidden = s.tokens * f.hidden * s.dt.resid
    return {
        "layer_saved_bytes": layer + rotary,
        "model_saved_bytes": saved,
        "step_peak_bytes_above_states": peak + last_hidden,
        "planner_layer_saved_bytes": layer,
        "planner_step_peak_bytes_above_states": peak,
    }
