"""Parameter counts and FLOPs.

Published formulas (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", section 5.1 and appendix), for GPT layers with l layers, hidden h,
vocabulary V, sequence s, batch B:

- parameters P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))
- FLOPs per iteration with full activation recomputation (4 passes over the layers, 3 over the
  logit layer): F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); without recomputation (3 passes):
  72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
- end-to-end training time ~ 8 T P / (n X) with recomputation (T tokens, n GPUs, X FLOP/s each).

Counted FLOPs (`layer_forward_flops`, `head_forward_flops`): 2 FLOPs per multiply-accumulate of
every matmul a layer really runs - q/k/v/o projections (GQA: k and v are narrower), the MLP (two
matrices, or three for SwiGLU), for MoE the router, the top-k experts and the shared expert - plus
the attention scores QK^T and AV, 4 s h_q per token counted over the full s x s square as in
Narayanan et al. (the usual MFU convention; causal kernels skip about half). Norms, activations,
softmax and the loss are not counted. For a GPT layer this is exactly 24 B s h^2 + 4 B s^2 h per
layer, so the counted totals equal Narayanan's formula.

Backward = 2 x forward. Model FLOPs (MFU) = 3 x forward; hardware FLOPs add the recomputed
forward (full: the layers again; selective: the attention scores again).
"""

from __future__ import annotations

import functools

from partrain.blueprint.families import family
from partrain.blueprint.model_facts import ModelFacts
from partrain.blueprint.planner.params import layer_is_sparse
from partrain.blueprint.planner.spec import ModelExtras, default_extras


def narayanan_params(l: int, h: int, V: int, s: int) -> float:
    return 12 * l * h * h * (1 + 13 / (12 * h) + (V + s) / (12 * l * h))


def narayanan_flops(B: int, s: int, l: int, h: int, V: int, recompute: bool = True) -> float:
    """FLOPs of one training iteration of a GPT model (Narayanan et al. 2021)."""
    if recompute:
        return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def korthikanti_selective_hardware_flops(B: int, s: int, l: int, h: int, V: int) -> float:
    """Hardware FLOPs per iteration with selective recomputation as Korthikanti et al. 2022 count
    them for their HFU (Table 5): 72 B s l h^2 (1 + s/(3h) + V/(12 l h)), i.e. the attention-score
    term counted twice. partrain's counted hardware FLOPs add only the recomputed forward of the
    attention core (4 B s^2 h per layer, a third of that extra): `step_flops`."""
    return 72 * B * s * l * h * h * (1 + s / (3 * h) + V / (12 * l * h))


def narayanan_training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """End-to-end training time 8 T P / (n X) in days (with activation recomputation)."""
    return 8 * tokens * params / (gpus * flops_per_gpu) / 86400


def attention_proj_macs(f: ModelFacts) -> int:
    """Multiply-accumulates per token of q, k, v, o projections."""
    h, q, kv = f.hidden, f.heads * f.head_dim, f.kv_heads * f.head_dim
    return h * q + 2 * h * kv + q * h


def mlp_macs(f: ModelFacts, x: ModelExtras, sparse: bool) -> int:
    """Multiply-accumulates per token of the MLP (MoE: router + top-k experts + shared expert)."""
    h = f.hidden
    if sparse:
        macs = h * f.n_experts + f.experts_per_token * 3 * h * f.ffn
        if family(f.arch).shared_expert and f.shared_expert_ffn:
            macs += 3 * h * f.shared_expert_ffn + h
        return macs
    ffn = x.dense_ffn or f.ffn
    return (3 if f.gated_mlp else 2) * h * ffn


def layer_forward_flops(f: ModelFacts, x: ModelExtras, tokens: float, seq: int, sparse: bool = False) -> dict:
    """Forward FLOPs of one decoder layer for `tokens` tokens of sequences of length `seq`:
    {"attn_proj", "attn_core", "mlp"} (sum them for the layer)."""
    q = f.heads * f.head_dim
    return {
        "attn_proj": 2.0 * tokens * attention_proj_macs(f),
        "attn_core": 4.0 * tokens * seq * q,
        "mlp": 2.0 * tokens * mlp_macs(f, x, sparse),
    }


def head_forward_flops(f: ModelFacts, tokens: float) -> float:
    return 2.0 * tokens * f.hidden * f.vocab


def model_forward_flops(f: ModelFacts, x: ModelExtras | None, tokens: float, seq: int) -> dict:
    """Forward FLOPs of the whole model: {"layers", "attn_core", "head"} ("layers" includes attn_core)."""
    x = x or default_extras(f)
    layers = core = 0.0
    cache = {}
    for i in range(f.n_layers):
        sparse = layer_is_sparse(f, x, i)
        if sparse not in cache:
            cache[sparse] = layer_forward_flops(f, x, tokens, seq, sparse)
        parts = cache[sparse]
        layers += sum(parts.values())
        core += parts["attn_core"]
    return {"layers": layers, "attn_core": core, "head": head_forward_flops(f, tokens)}


@functools.lru_cache(maxsize=4096)
def step_flops(
    f: ModelFacts, x: ModelExtras | None, global_batch: int, seq: int, recompute: str = "none", recompute_every: int = 1
) -> dict:
    """{"model": FLOPs of one step for MFU (3 passes), "hardware": with recomputation}."""
    fw = model_forward_flops(f, x, global_batch * seq, seq)
    model = 3 * (fw["layers"] + fw["head"])
    hardware = model
    if recompute == "full":
        hardware += fw["layers"] / max(1, recompute_every)
    elif recompute == "selective":
        hardware += fw["attn_core"] / max(1, recompute_every)
    return {"model": model, "hardware": hardware}
