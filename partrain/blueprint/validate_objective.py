"""Rules for train.objective (lm, dpo, simpo) and the data and layouts the preference objectives take.

dpo and simpo train on preference pairs (data.format=preference), two padded rows each, in one
microbatch (partrain.data.preference_batches); their loss needs the whole sequence and the whole model in
one forward (partrain.train.preference), so this version runs them under dp, ZeRO/FSDP/HSDP, tp (with
Megatron-SP), sp (Ulysses and ring: each row's slices summed over the sp group), ep and pp (every
schedule: the last stage computes the pairs' loss, its target carrying dpo's reference), and refuses pp
with sp together by name. dpo's reference is the base model with the LoRA
adapters off, or in full fine-tuning the reference log-probabilities computed before step 1
(partrain.train.reference_logps).
data.format=auto is checked again once the first row names the format (`objective_format_problem`).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

from partrain.blueprint.config.schema import RunConfig
from partrain.blueprint.validate_data_format import PAIRED_FORMATS

PREFERENCE_OBJECTIVES = ("dpo", "simpo")


def reference_kind(train, peft_method: str) -> Optional[str]:
    """Where dpo's reference log-probabilities come from (train.preference_reference with auto resolved):
    adapters, table or copy; None for the objectives without a reference."""
    if train.objective != "dpo":
        return None
    if train.preference_reference == "auto":
        return "adapters" if peft_method == "lora" else "table"
    return train.preference_reference


def objective_format_problem(fmt: str, objective: str) -> Optional[Tuple[str, str, str, str]]:
    """(key, value, rule, fix) when the (resolved) data format does not suit train.objective, else None."""
    if objective in PREFERENCE_OBJECTIVES and fmt not in PAIRED_FORMATS and fmt != "auto":
        return (
            "data.format",
            fmt,
            f"train.objective={objective} trains on preference pairs ({{prompt, chosen, rejected}} rows)",
            "give preference rows (data.format=preference or auto), or set train.objective=lm",
        )
    if objective == "lm" and fmt in PAIRED_FORMATS:
        return (
            "train.objective",
            objective,
            "preference rows (chosen and rejected answers) are trained by a preference objective, not next-token loss",
            "set train.objective=dpo (with peft=lora) or train.objective=simpo",
        )
    return None


def objective_problems(c, run: RunConfig, degrees: Optional[dict]) -> None:
    """Append the problems of train.objective and its settings to the collector `c`."""
    t, d = run.train, run.data
    fmt = "text" if d.format == "auto" and d.source == "builtin" else d.format
    problem = objective_format_problem(fmt, t.objective)
    if problem is not None:
        c.add(*problem)
    if t.objective not in PREFERENCE_OBJECTIVES:
        return
    c.check(
        math.isfinite(t.preference_beta) and t.preference_beta > 0,
        "train.preference_beta",
        t.preference_beta,
        "must be > 0 (the scale of the margin inside the sigmoid)",
        "e.g. train.preference_beta=0.1 (dpo) or 2.0 (simpo)",
    )
    c.check(
        0 <= t.preference_label_smoothing < 0.5,
        "train.preference_label_smoothing",
        t.preference_label_smoothing,
        "must be within [0, 0.5) (the share of pairs assumed mislabelled)",
        "e.g. train.preference_label_smoothing=0.1, or 0 for plain DPO",
    )
    c.check(
        math.isfinite(t.simpo_gamma),
        "train.simpo_gamma",
        t.simpo_gamma,
        "must be a finite number",
        "e.g. train.simpo_gamma=0.5",
    )
    c.check(
        t.preference_reference == "auto" or t.objective == "dpo",
        "train.preference_reference",
        t.preference_reference,
        f"only dpo has a reference (train.objective={t.objective} has none)",
        "drop train.preference_reference, or set train.objective=dpo",
    )
    c.check(
        t.preference_reference != "adapters" or run.peft.method == "lora",
        "train.preference_reference",
        t.preference_reference,
        "the reference with the adapters switched off needs LoRA adapters (peft=lora)",
        "set peft=lora, or train.preference_reference=table (precomputed) or copy (a frozen copy)",
    )
    c.check(
        t.micro_batch_size % 2 == 0,
        "train.micro_batch_size",
        t.micro_batch_size,
        f"counts rows, and train.objective={t.objective} keeps each pair's two rows (chosen, rejected) in one "
        "microbatch, so it must be even",
        f"e.g. train.micro_batch_size={t.micro_batch_size + 1}",
    )
    c.check(
        not d.packing,
        "data.packing",
        d.packing,
        "preference pairs are read one padded example per row; packing them is not built yet",
        "set data.packing=false",
    )
    c.check(
        not d.streaming,
        "data.streaming",
        d.streaming,
        "preference pairs are read from the examples cache; streaming them is not built yet",
        "set data.streaming=false",
    )
    if degrees is not None:
        _layout_problems(c, run, degrees)


def _layout_problems(c, run: RunConfig, degrees: dict) -> None:
    """The preference objectives' rules on the parallel degrees."""
    t = run.train
    pp, sp = degrees.get("pp", 1), degrees.get("sp", 1)
    c.check(
        pp == 1 or reference_kind(t, run.peft.method) != "copy",
        "train.preference_reference",
        t.preference_reference,
        f"a frozen reference copy runs beside the policy in one forward; with parallel.pp={pp} it is not built yet",
        "set train.preference_reference=table (precomputed; pp takes it) or adapters (peft=lora), or parallel.pp=1",
    )
    c.check(
        pp == 1 or sp == 1,
        "parallel.sp",
        sp,
        f"with parallel.pp={pp}, train.objective={t.objective} scores whole rows on the last stage; with sequence "
        "parallelism too it is not built yet",
        "set parallel.sp=1 (pp with dp, ZeRO/FSDP, tp and ep take it), or parallel.pp=1 (sp takes it)",
    )
