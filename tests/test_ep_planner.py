"""Expert parallelism before launch: the MoE config keys' rules, the planner's expert accounting and
`plan --simulate` with ep > 1.

Bad MoE/ep inputs are refused through the real CLI in-process (exit 2, one message naming the key,
nothing created, no process started), as tests/test_validate.py does for the other keys.
"""

from __future__ import annotations

import json
import math

import pytest

from partrain.config.compose import compose
from partrain.config.validate import validate

GPT = "recipe=gpt-3d"  # dense: 8 ranks = dp2 x tp2 x pp2
MOE = "recipe=mixtral-ep"  # 2 ranks = dp2, ep2; 4 experts, top-2
QWEN = ["model=qwen2-moe-tiny", "cluster.devices_per_node=6", "parallel.dp=6", "train.micro_batch_size=1",
        "train.global_batch_size=6"]  # 8 experts; dp x sp = 6

# (name, arguments after `partrain train`, the key the one error must name, words the fix must contain)
BAD = [
    ("cf-zero", [MOE, "parallel.moe_capacity_factor=0"], "parallel.moe_capacity_factor", "null"),
    ("cf-negative", [MOE, "parallel.moe_capacity_factor=-1.5"], "parallel.moe_capacity_factor", "1.25"),
    ("cf-nan", [MOE, "parallel.moe_capacity_factor=nan"], "parallel.moe_capacity_factor", "1.25"),
    ("cf-not-a-number", [MOE, "parallel.moe_capacity_factor=abc"], "parallel.moe_capacity_factor", ""),
    ("aux-negative", [MOE, "parallel.moe_aux_loss_coef=-0.01"], "parallel.moe_aux_loss_coef", "router_aux_loss_coef"),
    ("z-negative", [MOE, "parallel.moe_z_loss_coef=-1"], "parallel.moe_z_loss_coef", "0.001"),
    ("z-inf", [MOE, "parallel.moe_z_loss_coef=inf"], "parallel.moe_z_loss_coef", "0.001"),
    ("dense-cf", [GPT, "parallel.moe_capacity_factor=1.25"], "parallel.moe_capacity_factor", "model=mixtral-tiny"),
    ("dense-aux", [GPT, "parallel.moe_aux_loss_coef=0.01"], "parallel.moe_aux_loss_coef", "model=mixtral-tiny"),
    ("dense-z", [GPT, "parallel.moe_z_loss_coef=0.001"], "parallel.moe_z_loss_coef", "model=mixtral-tiny"),
    ("dense-ep", [GPT, "parallel.ep=2"], "parallel.ep", "model=mixtral-tiny"),
    ("ep-zero", [MOE, "parallel.ep=0"], "parallel.ep", "parallel.ep=1"),
    ("ep-vs-experts", QWEN + ["parallel.ep=3"], "parallel.ep", "valid ep here: 1, 2"),
    ("ep-vs-dp-sp", [MOE, "parallel.dp=1", "parallel.sp=2", "parallel.ep=4", "train.global_batch_size=4"], "parallel.ep",
     "valid ep here: 1, 2"),
]


def _refused(ran, key: str, fix_words: str) -> None:
    out = ran.stdout + ran.stderr
    assert ran.code == 2, out
    assert "Traceback" not in out
    assert ran.created() == [] and ran.spawned == []
    report = json.loads(ran.stdout)
    assert report["valid"] is False and [e["key"] for e in report["errors"]] == [key], report
    error = report["errors"][0]
    assert error["rule"] and key in error["message"] and fix_words in error["fix"] + error["rule"], error


@pytest.mark.parametrize("name,args,key,fix", BAD, ids=[row[0] for row in BAD])
def test_bad_moe_input_refused(cli, name, args, key, fix):
    _refused(cli("train", *args, "--json"), key, fix)
    human = cli("train", *args, "--dry-run")
    assert human.code == 2 and human.stderr.strip().startswith(f"error: {key}="), human.stderr


@pytest.mark.parametrize("overrides", [
    [MOE, "parallel.moe_capacity_factor=1.25", "parallel.moe_aux_loss_coef=0", "parallel.moe_z_loss_coef=0.001"],
    [MOE, "parallel.moe_capacity_factor=0.5"],
    QWEN + ["parallel.ep=2"],
    [GPT, "parallel.moe_capacity_factor=null", "parallel.moe_aux_loss_coef=null", "parallel.moe_z_loss_coef=0"],  # defaults
])
def test_good_moe_input_accepted(overrides):
    validate(compose(overrides))
