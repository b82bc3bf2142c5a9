"""GPT-2 for the planner: config facts, parameter tensors (HF Conv1D weights, stored [in, out]) and
the "gpt2" block shape. The runtime side (module paths, TP plan) is partrain/models/families/gpt2.py.

Tensor parallelism: c_attn weight dim 1, attn.c_proj weight dim 0, mlp.c_fc weight dim 1 + bias, mlp.c_proj
weight dim 0, wte dim 0 (tied with lm_head); c_attn's fused q|k|v bias, c_proj biases, norms and wpe
replicated.
"""

from __future__ import annotations

from typing import Any, Dict, List

from partrain.blueprint.families.base import (
    Family,
    ModelExtras,
    TensorSpec,
    Values,
    layer_count,
    must_divide,
    optional_int,
    positive_int,
)


def facts(values: Values, arch: str) -> Dict[str, Any]:
    hidden, heads = positive_int(values, "n_embd", arch), positive_int(values, "n_head", arch)
    must_divide(heads, hidden, "model.config.n_head", f"must divide the hidden size n_embd={hidden}")
    return dict(
        n_layers=layer_count(values, "n_layer", arch),
        hidden=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        ffn=optional_int(values, "n_inner", arch) or 4 * hidden,
        vocab=positive_int(values, "vocab_size", arch),
        max_positions=positive_int(values, "n_positions", arch),
        tied_embeddings=bool(values.get("tie_word_embeddings", True)),
        norm="layernorm",
        gated_mlp=False,
        qkv_bias=True,
        learned_positions=True,
    )


def extras(values: Values, facts: Any, attn_impl: str) -> ModelExtras:
    return ModelExtras(
        activation=str(values.get("activation_function") or "gelu_new"),
        resid_dropout=float(values.get("resid_pdrop") or 0) > 0,
        embd_dropout=float(values.get("embd_pdrop") or 0) > 0,
        attn_dropout=float(values.get("attn_pdrop") or 0) > 0,
        attn_impl=attn_impl,
        out_bias=True,
        mlp_bias=True,
    )


def default_extras(facts: Any) -> ModelExtras:
    return ModelExtras(activation="gelu_new", out_bias=True, mlp_bias=True)


def embed_tensors(f: Any) -> List[TensorSpec]:
    return [
        TensorSpec("transformer.wte.weight", (f.vocab, f.hidden), "embed", tp_dim=0),
        TensorSpec("transformer.wpe.weight", (f.max_positions, f.hidden), "embed"),
    ]


def layer_tensors(f: Any, x: ModelExtras, i: int) -> List[TensorSpec]:
    h, ffn = f.hidden, f.ffn
    p = f"transformer.h.{i}."
    L = lambda name, shape, tp_dim=None: TensorSpec(p + name, shape, "layer", i, tp_dim)  # noqa: E731
    return [
        L("ln_1.weight", (h,)),
        L("ln_1.bias", (h,)),
        L("attn.c_attn.weight", (h, 3 * h), 1),
        L("attn.c_attn.bias", (3 * h,)),  # whole on every tp rank (parallel/tp_ops.local_fused_bias)
        L("attn.c_proj.weight", (h, h), 0),
        L("attn.c_proj.bias", (h,)),
        L("ln_2.weight", (h,)),
        L("ln_2.bias", (h,)),
        L("mlp.c_fc.weight", (h, ffn), 1),
        L("mlp.c_fc.bias", (ffn,), 0),
        L("mlp.c_proj.weight", (ffn, h), 0),
        L("mlp.c_proj.bias", (h,)),
    ]


def final_norm_tensors(f: Any) -> List[TensorSpec]:
    return [
        TensorSpec("transformer.ln_f.weight", (f.hidden,), "final"),
        TensorSpec("transformer.ln_f.bias", (f.hidden,), "final"),
    ]


CONV1D = ("c_attn", "c_proj", "c_fc")
"""GPT-2's Conv1D projections; `c_proj` names both attention's output and the MLP's down projection."""

GPT2 = Family(
    name="gpt2",
    arch="gpt2",
    facts=facts,
    extras=extras,
    default_extras=default_extras,
    embed_tensors=embed_tensors,
    layer_tensors=layer_tensors,
    final_norm_tensors=final_norm_tensors,
    config_keys=dict(
        hidden="n_embd", layers="n_layer", heads="n_head", ffn="n_inner", vocab="vocab_size", positions="n_positions"
    ),
    block="gpt2",
    lora_projections=CONV1D,
    conv1d_projections=CONV1D,
)
