"""Validation of float8 training (`train.float8`, `train.float8_recipe`): what torchao's float8
linears cannot do, or partrain has not built, is refused before any process starts. Whether
torchao is installed and the GPU can run float8 (sm89+) is checked by the launch
(partrain.preflight.float8), which may import torch."""

from __future__ import annotations

from typing import Optional

from partrain.blueprint.config.schema import RunConfig
from partrain.blueprint.model_facts import ModelFacts
from partrain.blueprint.problems import ProblemCollector

FLOAT8_RECIPES = ("tensorwise", "rowwise")
OFF = "or train.float8=false"


def float8_problems(c: ProblemCollector, run: RunConfig, facts: Optional[ModelFacts], degrees: Optional[dict]) -> None:
    t = run.train
    c.check(
        t.float8_recipe in FLOAT8_RECIPES,
        "train.float8_recipe",
        t.float8_recipe,
        f"must be one of {', '.join(FLOAT8_RECIPES)} (torchao's dynamic-scaling recipes)",
        "train.float8_recipe=tensorwise",
    )
    if not t.float8:
        return
    c.check(
        t.precision == "bf16",
        "train.precision",
        t.precision,
        "float8 training runs the linears in float8 inside bf16 mixed precision; with fp32 the other "
        "matmuls would stay fp32 and fp16's loss scaling is not combined with float8's own scales",
        f"train.precision=bf16, {OFF}",
    )
    # Tensor parallelism composes (partrain.parallel.float8_tp: the TP projections cast with the whole
    # tensors' amax, all-reduced over the TP group), with or without Megatron-SP. LoRA composes (its
    # projections run the frozen base's matmul in float8, the adapters in bf16), and so do MoE models
    # (attention and shared-expert linears convert; routed experts and routers stay in bf16).
