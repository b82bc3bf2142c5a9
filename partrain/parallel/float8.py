"""float8 training (`train.float8=true`): the decoder's linear layers run their matmuls in float8
through torchao's `Float8Linear` (dynamic scaling, `train.float8_recipe` tensorwise or rowwise).

Applied first in parallelize's order (after the pipeline split, before everything else), as
torchtitan does: every later wrapper (recompute, compile, FSDP2) then sees `Float8Linear` modules
that keep the same `weight` / `bias` Parameters under the same FQNs, in the training precision.
torchao casts to float8 inside each matmul only, so materialize, DCP checkpoints (resume is exact)
and `checkpoint export` handle plain bf16/fp32 weights, as without float8.

What is converted: every `nn.Linear` of the decoder layers. The embedding is not a linear layer; the
output head (`lm_head`: its logits feed the loss and are sensitive to float8's 3-bit mantissa) and
an MoE router (`gate` / `router`, Qwen2-MoE's `shared_expert_gate`: its top-k choice flips under
small errors) are excluded by module path, as torchtitan does. torchao's float8 matmul needs both
dimensions divisible by 16: a linear whose in or out features are not is skipped and counted
(`Float8Counts`, in the log).

MoE models: attention's projections and the shared expert's MLP (Qwen2-MoE) are nn.Linear and
convert. The routed experts are one module holding fused [experts, ...] weight tensors (HF's
`*Experts`, and expert parallelism's `RoutedExperts` that re-makes them later, after this step):
torchao's Float8Linear has no grouped-GEMM form for them, so they stay in the training precision,
as the routers do; both are counted in the log line (`moe_kept`).

Tensor parallelism (tp > 1, with or without Megatron-SP): partrain's TP projections are its own
local-tensor modules (tp_layers.py, megatron_sp.py), not the nn.Linear + DTensor `parallelize_module`
that torchao's float8 TP styles (Float8ColwiseParallel, ...) expect. Conversion still runs first:
when TP replaces a Float8Linear it keeps its float8 config and runs its matmuls on the local shards
through float8_tp.py, with every sharded operand's amax all-reduced over the TP group, so the
scales are the whole tensors' (what one process computes). Under tp a linear is converted only when
its dimensions divided by tp are still multiples of 16 (either may be the split one). FSDP's float8
all-gather is not combined with TP (its weight wrapper is not a TP DTensor): 2-D FSDP x TP gathers
bf16 and the TP module casts.

FSDP2 (zero_stage 2/3, tensorwise recipe): torchao's float8 all-gather
(`enable_fsdp_float8_all_gather`): each converted weight is a tensor subclass whose fp32 shard is
cast to float8 before the all-gather (half of bf16's bytes) with the whole weight's amax, so the
gathered weight is what one process casts. It keeps the Parameter's name, dtype and shape:
materialize, DCP save/resume and export see plain fp32 shards (tests/test_float8.py resumes one).
Rowwise scales are per row and are not all-gathered in float8 (torchao offers it for tensorwise
only): under rowwise FSDP gathers bf16 and torchao casts after the gather.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import List

from torch import nn

from partrain.blueprint.config.schema import TrainConfig

log = logging.getLogger(__name__)

EXCLUDED_LEAVES = ("lm_head", "gate", "router", "shared_expert_gate")
"""Module names (last FQN part) left in high precision: the output head and MoE routers (a router that
is an nn.Linear). A Llama MLP's `gate_proj` is a different name and is converted."""
ROUTED_EXPERTS = "experts"
"""The module name of an MoE layer's routed experts (fused weight tensors, never converted)."""
ROUTERS = ("gate", "router")
"""Module names of MoE routers (HF's `*TopKRouter`: not an nn.Linear, so torchao never asks about them)."""
FLOAT8_DIM_MULTIPLE = 16
"""torch._scaled_mm needs both matrix dimensions of the weight divisible by 16."""


@dataclass
class Float8Counts:
    """What convert_linears did to one module's linear layers (logged; tests read it)."""

    converted: List[str] = field(default_factory=list)
    skipped_dims: List[str] = field(default_factory=list)
    """Linears whose in/out features are not multiples of 16: they stay in high precision."""
    excluded: List[str] = field(default_factory=list)
    """The head and routers, by module path."""
    multiple: int = FLOAT8_DIM_MULTIPLE
    """What in/out features must be multiples of: 16, times tp under tensor parallelism (the shards')."""
    moe_kept: List[str] = field(default_factory=list)
    """MoE models: the routed-experts modules and the routers that are not nn.Linear, by module path
    (they stay in the training precision)."""

    def line(self) -> str:
        skipped = f" ({', '.join(self.skipped_dims[:4])}{', ...' if len(self.skipped_dims) > 4 else ''})"
        experts = sum(1 for fqn in self.moe_kept if fqn.rsplit(".", 1)[-1] == ROUTED_EXPERTS)
        moe = f", {experts} routed experts and {len(self.moe_kept) - experts} routers kept in high precision"
        return (
            f"float8: {len(self.converted)} linear layers converted, {len(self.skipped_dims)} skipped "
            f"(dims not divisible by {self.multiple}){skipped if self.skipped_dims else ''}, "
            f"{len(self.excluded)} excluded (head, router){moe if self.moe_kept else ''}"
        )


def _moe_kept(module: nn.Module) -> List[str]:
    """The routed experts and non-Linear routers of `module` (what stays in high precision in MoE layers)."""
    kept = []
    for fqn, child in module.named_modules():
        leaf = fqn.rsplit(".", 1)[-1]
        if leaf == ROUTED_EXPERTS or (leaf in ROUTERS and not isinstance(child, nn.Linear)):
            kept.append(fqn)
    return kept


def _classify(module: nn.Module, fqn: str, counts: Float8Counts) -> bool:
    """torchao's module_filter_fn: True to convert this linear; records why not otherwise."""
    if type(module) is not nn.Linear:  # torchao asks about nn.Linear only; subclasses are someone else's
        return False
    if fqn.rsplit(".", 1)[-1] in EXCLUDED_LEAVES:
        counts.excluded.append(fqn)
        return False
    if module.in_features % counts.multiple or module.out_features % counts.multiple:
        counts.skipped_dims.append(fqn)
        return False
    counts.converted.append(fqn)
    return True


def float8_config(recipe: str, fsdp_float8_all_gather: bool = False):
    """torchao's Float8LinearConfig for `train.float8_recipe` (dynamic scaling both ways)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig

    config = Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)


def apply_float8(
    module: nn.Module, train: TrainConfig, fsdp: bool = False, tp: int = 1, lora: bool = False
) -> Float8Counts:
    """Swap `module`'s eligible nn.Linear children for torchao's Float8Linear (on the meta device
    too: the Parameters are reused, so materialize fills them as before). Nothing without train.float8.
    `tp` > 1: the TP modules installed next take the float8 config over (float8_tp). `lora`: LoRA's
    projections take it over too (partrain.parallel.lora), and FSDP gathers their bases in bf16."""
    counts = Float8Counts(multiple=FLOAT8_DIM_MULTIPLE * tp)
    if not train.float8:
        return counts
    from torchao.float8 import convert_to_float8_training  # an extra: imported only when float8 is on

    # Not with LoRA: its projections cast their frozen base weight themselves (float8_tp), which needs the
    # plain weight, not torchao's all-gather wrapper.
    gather_float8 = fsdp and tp == 1 and train.float8_recipe == "tensorwise" and not lora
    counts.moe_kept = _moe_kept(module)
    convert_to_float8_training(
        module,
        config=float8_config(train.float8_recipe, gather_float8),
        module_filter_fn=lambda mod, fqn: _classify(mod, fqn, counts),
    )
    log.info(counts.line())
    return counts
