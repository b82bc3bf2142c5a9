"""Rules for the MoE routing keys (parallel.moe_capacity_factor, moe_aux_loss_coef, moe_z_loss_coef,
moe_bias_update_speed).

Kept apart from validate.py so the MoE rules read in one place. `moe_problems` appends to the
collector `validate` passes in (anything with `check(ok, key, value, rule, fix)`).

A dense model given a MoE key is refused (exit 2) rather than ignored: a silently unused knob
would let a user believe a capacity limit or an extra loss term was in force.
"""

from __future__ import annotations

import math
from typing import Optional

from partrain.blueprint.config.schema import ParallelConfig
from partrain.blueprint.families import family
from partrain.blueprint.model_facts import ModelFacts

MOE_KEYS = ("moe_capacity_factor", "moe_aux_loss_coef", "moe_z_loss_coef", "moe_bias_update_speed")
_DEFAULTS = {k: getattr(ParallelConfig(), k) for k in MOE_KEYS}


def moe_problems(c, p: ParallelConfig, facts: Optional[ModelFacts]) -> None:
    cf = p.moe_capacity_factor
    if cf is not None:
        c.check(
            math.isfinite(cf) and cf > 0,
            "parallel.moe_capacity_factor",
            cf,
            "must be > 0 (capacity per expert = ceil(cf x tokens x top_k / experts)), or null for dropless routing",
            "e.g. parallel.moe_capacity_factor=1.25, or parallel.moe_capacity_factor=null (no token dropped)",
        )
    for key in ("moe_aux_loss_coef", "moe_z_loss_coef"):
        value = getattr(p, key)
        if value is not None:
            c.check(
                math.isfinite(value) and value >= 0,
                f"parallel.{key}",
                value,
                "must be a finite number >= 0 (0 = off)",
                f"e.g. parallel.{key}=0.001"
                + (", or null for the model's router_aux_loss_coef" if key == "moe_aux_loss_coef" else ""),
            )
    speed = p.moe_bias_update_speed
    c.check(
        math.isfinite(speed) and speed >= 0,
        "parallel.moe_bias_update_speed",
        speed,
        "must be a finite number >= 0 (0 = the router bias stays as loaded)",
        "e.g. parallel.moe_bias_update_speed=0.001 (DeepSeek-V3's)",
    )
    if facts is not None and facts.is_moe and speed > 0:
        c.check(
            family(facts.arch).router_bias,
            "parallel.moe_bias_update_speed",
            speed,
            f"moves a router selection bias (DeepSeek-V3's e_score_correction_bias); {facts.arch}'s router has none",
            "drop parallel.moe_bias_update_speed, and balance with parallel.moe_aux_loss_coef instead",
        )
    if facts is None or facts.is_moe:
        return
    for key in MOE_KEYS:
        value = getattr(p, key)
        if value != _DEFAULTS[key]:
            c.check(
                False,
                f"parallel.{key}",
                value,
                f"is a mixture-of-experts setting; {facts.arch} has no experts",
                f"drop parallel.{key} (default {_DEFAULTS[key]!r}), or pick a MoE model (model=mixtral-tiny)",
            )
            break  # one message: the model choice is the one mistake
