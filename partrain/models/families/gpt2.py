"""GPT-2 at runtime: module paths, and partrain's own tensor-parallel layer plan (HF ships none).

Attention is one fused Conv1D `c_attn` (weight stored [in, out]) holding Q, K and V side by side,
so its column split takes each rank's own heads of all three parts; `c_proj` is row-parallel, and
the MLP's `c_fc` column-, `c_proj` row-parallel. The planner's side is blueprint/families/gpt2.py.
"""

from __future__ import annotations

from partrain.models.families.base import Adapter, Conv1DBlock, Conv1DLayerPlan

TP_PLAN = Conv1DLayerPlan(
    blocks=(
        # The fused output is split into q, k, v by width: each rank holds embed_dim / tp of each.
        Conv1DBlock("attn", column=(("c_attn", 3),), row=("c_proj",), per_rank=("split_size", "num_heads")),
        Conv1DBlock("mlp", column=(("c_fc", 1),), row=("c_proj",)),
    ),
    sequence_norms=("ln_1", "ln_2"),
    sequence_dropouts=("attn.resid_dropout", "mlp.dropout"),
)

GPT2 = Adapter(
    family="gpt2",
    archs=("gpt2",),
    base_prefix="transformer",
    layer_prefix="transformer.h",
    embedding_paths=("transformer.wte", "transformer.wpe"),
    final_norm_path="transformer.ln_f",
    attention_attr="attn",
    conv1d_weights=True,
    fused_qkv_attr="attn.c_attn",
    layer_tp_plan=TP_PLAN,
)
