"""What this version of partrain can train, said plainly.

The validator accepts every layout that is consistent; some consistent layouts use a technique
whose runtime is not built yet. The dry run lists them in its verdict and `partrain train` refuses
them with exit code 2 instead of silently dropping the feature.
"""

from __future__ import annotations

from typing import List

from partrain.blueprint.families import family
from partrain.blueprint.families.generic import GENERIC_PIPELINE, GENERIC_REFUSED
from partrain.blueprint.families.generic_template import TEMPLATE_RECORDS
from partrain.blueprint.precision_mode import run_uses_master_weights
from partrain.blueprint.validate import ValidatedRun

# Flipped to True by the module that implements each technique (kept here, one place to read).
IMPLEMENTED = {
    "tp": True,
    "pp": True,
    "sp": True,
    "ep": True,
    "recompute": True,
    "checkpoint": True,
    "fp16": True,
    "zero1-tp": True,
    "master-weights-ep": False,
    "tp-sp-learned-positions": True,
    "sp-sliding-window": False,
    "tp-sp-gathered-attention": False,
    "tp-sp-whole-attention": False,
    "sp-ring-dropout": False,
    "sp-ring-softcap": False,
    "sp-ring-sinks": False,
    "pp-generic": False,
    "tp-sp-template": False,
    "tp-template": False,
    "sp-template": False,
}


def zero1_with_tp_unsupported(zero_stage: int, tp: int) -> bool:
    """Whether ZeRO-1 with tensor parallelism is refused (the search's pre-pruning asks too). Both ZeRO-1
    optimizers shard the local tensors of DTensor parameters now, so never."""
    return zero_stage == 1 and tp > 1 and not IMPLEMENTED["zero1-tp"]


def unsupported_features(v: ValidatedRun) -> List[str]:
    layout, p = v.layout, v.run.parallel
    wanted = {
        "tp": (layout.tp > 1, f"parallel.tp={layout.tp} (tensor parallelism)"),
        "pp": (layout.pp > 1, f"parallel.pp={layout.pp} (pipeline parallelism)"),
        "sp": (layout.sp > 1, f"parallel.sp={layout.sp} (sequence/context parallelism)"),
        "ep": (layout.ep > 1, f"parallel.ep={layout.ep} (expert parallelism)"),
        "recompute": (p.recompute != "none", f"parallel.recompute={p.recompute}"),
        "fp16": (v.run.train.precision == "fp16", "train.precision=fp16 (loss scaling; use bf16)"),
        "zero1-tp": (
            zero1_with_tp_unsupported(p.zero_stage, layout.tp),
            "parallel.zero_stage=1 (ZeRO-1 together with tensor parallelism)",
        ),
        "master-weights-ep": (
            layout.ep > 1 and run_uses_master_weights(v),
            "train.param_dtype=16bit with parallel.ep > 1 (expert shards keep the autocast runtime; use fp32)",
        ),
        "tp-sp-learned-positions": (
            p.tp_sequence_parallel and layout.tp > 1 and v.facts.learned_positions,
            f"parallel.tp_sequence_parallel=true (Megatron-SP for {v.facts.arch}'s learned position embeddings)",
        ),
        "tp-sp-gathered-attention": (
            p.tp_sequence_parallel and layout.tp > 1 and family(v.run.model.arch).tp_plan_gathers,
            f"parallel.tp_sequence_parallel=true (Megatron-SP where {v.run.model.arch}'s tensor-parallel plan "
            "gathers column projections' outputs)",
        ),
        "tp-sp-whole-attention": (
            p.tp_sequence_parallel and layout.tp > 1 and not _tp_splits_attention(v),
            f"parallel.tp_sequence_parallel=true (Megatron-SP where {v.run.model.arch}'s tensor-parallel plan "
            "keeps attention whole)",
        ),
        **_sp_limits(v),
        **_generic_limits(v),
        "checkpoint": (
            v.run.checkpoint.every_steps > 0 or v.run.checkpoint.resume != "none",
            "checkpoint.every_steps / checkpoint.resume (distributed checkpoints)",
        ),
    }
    return [text for key, (used, text) in wanted.items() if used and not IMPLEMENTED[key]]


def _tp_splits_attention(v: ValidatedRun) -> bool:
    """Whether tensor parallelism splits attention's projections (transformers' plans for gpt-oss and
    DeepSeek-V3 keep attention whole: Megatron-SP's sequence shards would reach it ungathered)."""
    fam = family(v.run.model.arch)
    tensors = fam.layer_tensors(v.facts, fam.default_extras(v.facts), 0)
    return any(t.tp_dim is not None and "attn." in t.name for t in tensors)


def _generic_limits(v: ValidatedRun) -> dict:
    """The degrees a family on a generic path cannot take (families/generic.py, generic_template.py)."""
    arch, layout = v.run.model.arch, v.layout
    if not family(arch).generic:
        return {}
    limits = {}
    if arch not in GENERIC_PIPELINE:
        why = GENERIC_REFUSED["parallel.pp"].format(arch=arch).rstrip(",")
        limits["pp-generic"] = (layout.pp > 1, f"parallel.pp={layout.pp} ({why})")
    record = TEMPLATE_RECORDS.get(arch)
    if record is not None:
        limits["tp-sp-template"] = (
            v.run.parallel.tp_sequence_parallel and layout.tp > 1 and not record.megatron_sp,
            f"parallel.tp_sequence_parallel=true (Megatron-SP for {arch}, a family on the template path: partrain "
            "hands the residual back as sequence shards at o_proj and down_proj, and its tensor-parallel plan "
            "names its row projections otherwise or gathers outputs)",
        )
        limits["tp-template"] = (
            layout.tp > 1 and not record.tensor_parallel,
            f"parallel.tp={layout.tp} (tensor parallelism for {arch}, whose config class ships no "
            "tensor-parallel plan)",
        )
        limits["sp-template"] = (
            layout.sp > 1 and not record.attention_interface,
            f"parallel.sp={layout.sp} (sequence parallelism for {arch}, whose attention does not go through "
            "transformers' attention interface, where partrain's sp attention runs)",
        )
    return limits


def _sp_limits(v: ValidatedRun) -> dict:
    """What partrain's sp attention (parallel.context_parallel) does not do: sliding windows shorter
    than the sequence (it runs full causal attention), and attention dropout, capped attention scores or
    attention sinks inside ring attention."""
    layout, seq = v.layout, v.run.train.seq_len
    if layout.sp == 1:
        return {}
    from partrain.blueprint.model_facts import load_snapshot, merged_kwargs

    m = v.run.model
    cfg = merged_kwargs(m.arch, m.config or {}, m.pretrained, load_snapshot())
    window = cfg.get("sliding_window") or 0
    windowed = (
        family(m.arch).window_always
        or cfg.get("use_sliding_window")
        or "sliding_attention" in (cfg.get("layer_types") or [])
    )
    dropout = max(float(cfg.get("attention_dropout") or 0.0), float(cfg.get("attn_pdrop") or 0.0))
    return {
        "sp-sliding-window": (
            bool(windowed and 0 < window < seq),
            f"parallel.sp={layout.sp} (sequence parallelism with a sliding attention window of {window} tokens "
            f"< train.seq_len={seq}, i.e. model.config.sliding_window)",
        ),
        "sp-ring-dropout": (
            v.run.parallel.sp_mode == "ring" and dropout > 0,
            f"parallel.sp_mode=ring (attention dropout {dropout} inside ring attention; Ulysses supports it)",
        ),
        "sp-ring-softcap": (
            v.run.parallel.sp_mode == "ring" and bool(cfg.get("attn_logit_softcapping")),
            f"parallel.sp_mode=ring (attention scores capped by model.config.attn_logit_softcapping="
            f"{cfg.get('attn_logit_softcapping')} inside ring attention; Ulysses supports it)",
        ),
        "sp-ring-sinks": (
            v.run.parallel.sp_mode == "ring" and family(m.arch).attention_sinks,
            f"parallel.sp_mode=ring ({m.arch}'s attention sink logits inside ring attention; Ulysses supports them)",
        ),
    }
