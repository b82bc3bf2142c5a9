"""Rules for the `peft` group (LoRA adapters on a frozen base), checked before any process starts.

The values themselves (method, r, alpha, dropout, target_modules, and LoRA keys set while
peft.method=none, which would otherwise be silently unused), each reported as one problem naming the
key. LoRA composes with every layout `train` runs (dp: DDP, ZeRO-1/2/3, HSDP, every dp_sync; tp with
and without Megatron-SP; every pipeline schedule; Ulysses and ring context parallelism; expert
parallelism; recompute, compile, fp16/bf16 with either param_dtype): parity-tested against one
process in tests/test_lora.py; and train.float8 (the frozen base's matmuls in float8: tests/test_float8.py).
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

from partrain.blueprint.config.schema import PeftConfig, RunConfig
from partrain.blueprint.families import FAMILIES
from partrain.blueprint.families.llama import DENSE_MLP
from partrain.blueprint.model_facts import ModelFacts

LORA_TARGETS: Dict[str, Tuple[str, ...]] = {arch: f.lora_projections for arch, f in FAMILIES.items()}
"""Family -> the projections LoRA can adapt, which are also the default target_modules (each family's
`lora_projections`, partrain/blueprint/families/)."""

_DEFAULTS = PeftConfig()


def lora_targets(arch: str, target_modules) -> Tuple[str, ...]:
    """The projection names that get adapters: peft.target_modules, or the family's default."""
    return tuple(target_modules) if target_modules else LORA_TARGETS.get(arch, ())


def peft_problems(c, run: RunConfig, facts: Optional[ModelFacts], degrees: Optional[dict] = None) -> None:
    """Append every problem of run.peft to the collector `c` (`check(ok, key, value, rule, fix)`);
    `degrees` (the resolved parallel degrees) is not needed by any rule now."""
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
    if known is None:  # a family partrain supports but has no LoRA targets for
        c.add(
            "peft.method",
            f.method,
            f"LoRA targets are known for {', '.join(LORA_TARGETS)} models, not {facts.arch}",
            "use one of those families, or peft=none",
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
    dense_mlp = facts.shared_expert_ffn > 0 or facts.moe_layers < facts.n_layers
    c.check(
        not (facts.is_moe and f.target_modules and set(f.target_modules) <= set(DENSE_MLP) and not dense_mlp),
        "peft.target_modules",
        list(f.target_modules),
        f"names only dense MLP projections, and this {facts.arch} model has none (its routed experts get no "
        "adapters): nothing would train",
        "add attention projections, e.g. peft.target_modules=[q_proj,v_proj], or [] for the default",
    )
