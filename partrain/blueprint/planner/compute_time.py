"""Compute time of a pipeline rank's microbatch under a PlanSpec, from a fitted `ComputeModel`
(compute_model.py): its decoder layers, the last stage's head and loss, the first stage's
embedding, and the optimizer update per step."""

from __future__ import annotations

from partrain.blueprint.planner.compute_model import ComputeModel, LayerShape
from partrain.blueprint.planner.spec import PlanSpec

OPTIMIZER_BYTES_PER_PARAM = 60.0
"""Bytes torch's AdamW (foreach) moves per fp32 parameter and step: reads parameter, gradient and
two moments, writes three, plus its temporaries and the gradient-norm clip (about twice the minimal 28)."""


def shape_of_spec(spec: PlanSpec, sparse: bool, tokens: float) -> LayerShape:
    """The LayerShape of one of the spec's decoder layers on a rank. partrain's 16-bit runtime keeps
    fp32 weights under autocast for ZeRO 0/1; FSDP (ZeRO 2/3) computes with 16-bit parameters."""
    f, x = spec.facts, spec.extras
    c = 4 if spec.precision == "fp32" else 2
    experts = (f.n_experts, f.experts_per_token, f.shared_expert_ffn, spec.ep) if sparse else (0, 0, 0, 1)
    return LayerShape(
        arch=f.arch,
        hidden=f.hidden,
        q=f.heads * f.head_dim,
        kv=f.kv_heads * f.head_dim,
        ffn=(x.dense_ffn or f.ffn) if not sparse else f.ffn,
        seq=spec.seq,
        tokens=tokens,
        tp=spec.tp,
        gated=f.gated_mlp,
        activation=x.activation,
        dropout=x.resid_dropout,
        autocast=c == 2 and spec.zero_stage < 2,
        compute_bytes=c,
        experts=experts,
        fsdp=spec.zero_stage if spec.zero_stage >= 2 and c == 2 else 0,
    )


def head_time(model: ComputeModel, spec: PlanSpec, tokens: float) -> float:
    """Forward + backward of the last stage's extra work: final norm, head matmuls, fp32 loss."""
    f, tp, t = spec.facts, spec.tp, model.rates.time
    c = 4 if spec.precision == "fp32" else 2
    T, h, v = tokens, f.hidden, f.vocab / tp
    gemm = t(T, h, v) + t(T, v, h) + t(h, T, v)
    # logits (c), .float() (c + 4), log-softmax (8), its backward (12), the cast back (4 + c); norm 3 x 28 T h
    nbytes = (3 * c + 28) * T * v + 3 * 28 * T * h
    if c == 2 and spec.zero_stage < 2:
        nbytes += 26 * h * v  # autocast's weight cast and the weight gradient's cast and accumulation
    return gemm + model.bytes_time(nbytes)


def embed_time(model: ComputeModel, spec: PlanSpec, tokens: float) -> float:
    """The first stage's embedding: gather forward, dense gradient (zeroed, scattered, accumulated)."""
    f = spec.facts
    return model.bytes_time(16 * f.vocab * f.hidden / spec.tp + 8 * tokens * f.hidden)


def rank_microbatch_time(
    model: ComputeModel, spec: PlanSpec, dense: int, sparse: int, first: bool, last: bool, tokens: float
) -> float:
    """Seconds of one microbatch's forward + backward (+ recompute) on a pipeline rank with these layers."""
    share = 1.0 / max(1, spec.recompute_every)
    t = 0.0
    for is_sparse, n in ((False, dense), (True, sparse)):
        if n:
            t += n * model.layer_time(shape_of_spec(spec, is_sparse, tokens), spec.recompute, share)
    if last:
        t += head_time(model, spec, tokens)
    if first:
        t += embed_time(model, spec, tokens)
    return t * model.cpu_sharing(spec.cluster.devices_per_node)


def optimizer_time(model: ComputeModel, spec: PlanSpec, param_elements: float) -> float:
    """Seconds of one AdamW update over a rank's (fp32) parameters."""
    sharing = model.cpu_sharing(spec.cluster.devices_per_node)
    return model.bytes_time(OPTIMIZER_BYTES_PER_PARAM * param_elements) * sharing


def matmul_rate(model: ComputeModel, spec: PlanSpec, tokens: float) -> float:
    """Achieved FLOP/s at the layer's MLP input projection shape (what "rate" means with a profile)."""
    f = spec.facts
    m, k, n = tokens, f.hidden, max(1.0, (spec.extras.dense_ffn or f.ffn) / spec.tp)
    return 2 * m * k * n / model.rates.time(m, k, n)
