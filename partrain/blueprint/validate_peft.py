"""Rules for the `peft` group (LoRA adapters on a frozen base), checked before any process starts.

Two kinds of rule, each reported as one problem naming the key:
- the values themselves (method, r, alpha, dropout, target_modules, and LoRA keys set while
  peft.method=none, which would otherwise be silently unused);
- the combinations partrain's LoRA runtime (`partrain.parallel.lora`) does not do yet. LoRA runs
  only where it is built and parity-tested (tests/test_lora.py); everything else is refused plainly
  rather than half-working.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

from partrain.blueprint.config.schema import PeftConfig, RunConfig
from partrain.blueprint.model_facts import ModelFacts
from partrain.blueprint.precision_mode import uses_master_weights
from partrain.blueprint.validate_runtime import compile_resolved

LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS: Dict[str, Tuple[str, ...]] = {"llama": LLAMA_PROJECTIONS}
"""Families LoRA is tested on -> their attention and MLP projections (the default target_modules).
GPT-2's fused Conv1D QKV (strided TP shards) and MoE experts are not built yet."""

LORA_PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
"""Pipeline schedules tested with LoRA. The zero-bubble ones split each backward into input and weight
gradients, which frozen base weights change (not tested yet)."""

_DEFAULTS = PeftConfig()


def lora_targets(arch: str, target_modules) -> Tuple[str, ...]:
    """The projection names that get adapters: peft.target_modules, or the family's default."""
    return tuple(target_modules) if target_modules else LORA_TARGETS.get(arch, ())


def peft_problems(c, run: RunConfig, facts: Optional[ModelFacts], degrees: Optional[dict]) -> None:
    """Append every problem of run.peft to the collector `c` (`check(ok, key, value, rule, fix)`)."""
    f = run.peft
    if f.method != "lora":
        for key in ("r", "alpha", "dropout", "target_modules"):
            value = getattr(f, key)
            if value != getattr(_DEFAULTS, key):
                c.check(
                    False,
                    f"peft.{key}",
                    value,
                    "is a LoRA setting; peft.method is none (full fine-tuning), so it would be unused",
                    f"add peft=lora, or drop peft.{key}",
                )
        return
    c.check(
        math.isfinite(f.alpha) and f.alpha > 0,
        "peft.alpha",
        f.alpha,
        "must be > 0 (adapter scale alpha / r)",
        "e.g. peft.alpha=16",
    )
    c.check(0 <= f.dropout < 1, "peft.dropout", f.dropout, "must be within [0, 1)", "e.g. peft.dropout=0.05")
    if facts is None:
        return
    known = LORA_TARGETS.get(facts.arch)
    if known is None or facts.is_moe:
        c.add(
            "peft.method",
            f.method,
            f"LoRA is built and tested for {', '.join(LORA_TARGETS)} models, not {facts.arch}"
            + (" (mixture of experts)" if facts.is_moe else ""),
            "use a llama model (e.g. model=llama-tiny), or peft=none",
        )
        return
    wrong = [t for t in f.target_modules if t not in known]
    c.check(
        not wrong and len(set(f.target_modules)) == len(f.target_modules),
        "peft.target_modules",
        list(f.target_modules),
        f"must name distinct projections of {facts.arch}: {', '.join(known)}",
        "e.g. peft.target_modules=[q_proj,v_proj], or [] for all of them",
    )
    _combination_problems(c, run, degrees)


def _combination_problems(c, run: RunConfig, degrees: Optional[dict]) -> None:
    p, t = run.parallel, run.train
    tp = degrees["tp"] if degrees else p.tp
    sp = degrees["sp"] if degrees else p.sp
    dp = degrees["dp"] if degrees else p.dp
    refuse = "with peft=lora is not built yet"
    c.check(sp == 1, "parallel.sp", sp, f"sequence/context parallelism {refuse}", "set parallel.sp=1")
    c.check(
        not (p.tp_sequence_parallel and tp > 1),
        "parallel.tp_sequence_parallel",
        p.tp_sequence_parallel,
        f"Megatron sequence parallelism {refuse}",
        "set parallel.tp_sequence_parallel=false",
    )
    c.check(not compile_resolved(run), "train.compile", t.compile, f"torch.compile {refuse}", "set train.compile=false")
    c.check(
        p.zero_stage != 1,
        "parallel.zero_stage",
        p.zero_stage,
        f"ZeRO-1 {refuse}",
        "use parallel.zero_stage=0 (DDP) or 3 (FSDP; the adapters' state is tiny anyway)",
    )
    dp_shard = p.dp_shard if p.dp_shard > 0 else dp
    c.check(
        dp_shard >= dp,
        "parallel.dp_shard",
        p.dp_shard,
        f"hybrid sharding (HSDP) {refuse}",
        "set parallel.dp_shard=-1",
    )
    c.check(
        p.dp_sync == "allreduce",
        "parallel.dp_sync",
        p.dp_sync,
        f"this gradient sync {refuse}",
        "parallel.dp_sync=allreduce",
    )
    c.check(
        p.recompute in ("none", "full"),
        "parallel.recompute",
        p.recompute,
        f"selective recompute {refuse}",
        "set parallel.recompute=full or none",
    )
    pp = degrees["pp"] if degrees else p.pp
    c.check(
        pp == 1 or p.pp_schedule in LORA_PP_SCHEDULES,
        "parallel.pp_schedule",
        p.pp_schedule,
        f"this pipeline schedule {refuse}",
        f"use one of {', '.join(LORA_PP_SCHEDULES)}",
    )
    c.check(
        not run.checkpoint.export_hf,
        "checkpoint.export_hf",
        True,
        f"the parallel HF export (it would write the base without the adapters) {refuse}",
        "set checkpoint.export_hf=false; export afterwards with partrain checkpoint export CK --peft OUT",
    )
    c.check(t.precision == "fp32", "train.precision", t.precision, f"mixed precision {refuse}", "train.precision=fp32")
    c.check(
        not uses_master_weights(t.precision, t.param_dtype, p.zero_stage, run.cluster.device),
        "train.param_dtype",
        t.param_dtype,
        f"16-bit parameters with master weights {refuse}",
        "set train.param_dtype=fp32",
    )
