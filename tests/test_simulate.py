"""`partrain plan --simulate`: the real wrappers at full world size on torch's fake process group.

The issue's check: per-rank parameter bytes of the simulation equal the planner's analytic count
exactly, for TP, PP and FSDP layouts at world sizes up to 1024 on a Llama-3-70B-sized model, in
under a minute on this machine. Nothing is allocated (meta device) and no process is started.
"""

from __future__ import annotations

import json

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.planner.simulated import default_ranks, grouped_params
from partrain.blueprint.validate import validate
from partrain.simulate.fake_world import simulate

LLAMA_70B_1024 = [
    "model=llama3-70b",
    "cluster=h100x1024",
    "train.seq_len=4096",
    "train.precision=bf16",
    "train.micro_batch_size=1",
    "train.global_batch_size=1024",
]

# (name, overrides, extra ranks to simulate beside the first and last rank of each pipeline stage)
LAYOUTS = {
    # FSDP over all 1024 ranks: Llama-3's 128256-row embedding splits unevenly (126 rows, the last
    # ranks fewer), so the last rank differs from rank 0.
    "fsdp-1024": (["parallel.zero_stage=3", "parallel.dp=1024"], []),
    "tp8-fsdp128": (["parallel.tp=8", "parallel.zero_stage=3", "parallel.dp=128"], [8]),
    "tp8-pp8-zero2": (["parallel.tp=8", "parallel.pp=8", "parallel.zero_stage=2", "parallel.dp=16"], []),
    "tp8-pp4x2-zero1": (
        [
            "parallel.tp=8",
            "parallel.pp=4",
            "parallel.dp=32",
            "parallel.zero_stage=1",
            "parallel.pp_schedule=interleaved-1f1b",
            "parallel.pp_virtual_stages=2",
        ],
        [],
    ),
    "tp4-pp16-hybrid": (
        [
            "parallel.tp=4",
            "parallel.pp=16",
            "parallel.dp=16",
            "parallel.dp_shard=4",
            "parallel.zero_stage=3",
            "parallel.tp_sequence_parallel=true",
        ],
        [],
    ),
    "pp2-zbv-ddp": (
        [
            "parallel.tp=8",
            "parallel.pp=2",
            "parallel.dp=64",
            "parallel.pp_schedule=zbv",
            "parallel.pp_virtual_stages=2",
        ],
        [],
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_llama3_70b_at_1024_ranks_matches_the_planner_exactly(name):
    overrides, extra = LAYOUTS[name]
    v = validate(compose(LLAMA_70B_1024 + overrides))
    assert v.world_size == 1024
    ranks = default_ranks(v.layout) + extra
    sim = simulate(v, ranks)
    for r in sim.ranks:
        assert r.simulated["param_elements"] == r.analytic["param_elements"], (name, r.rank)
        assert r.simulated["params"] == r.analytic["params"], (name, r.rank)
        # A rank holds a 1/N-ish share: far below the 70.6e9 parameters of the whole model.
        assert r.simulated["param_elements"] < 70.6e9 / min(v.layout.tp * v.layout.pp, 1024) * 1.2
    assert sim.exact
    # Each parameter's local shape is the real shard: sum of bytes = reported parameter bytes.
    r0 = sim.ranks[0]
    assert sum(p.bytes for p in r0.params) == r0.simulated["params"]
    if name == "fsdp-1024":  # the embedding's 128256 rows split unevenly: each rank's shard is its own
        emb = {r.rank: next(p for p in r.params if p.name.endswith("embed_tokens.weight")) for r in sim.ranks}
        assert emb[0].local_shape == [126, 8192]  # ceil(128256 / 1024) rows
        assert emb[1023].local_shape[0] < 126
        assert sim.ranks[0].simulated["param_elements"] != sim.ranks[-1].simulated["param_elements"]


def test_gpt2_tied_weights_and_fused_qkv_over_pipeline_and_tp():
    """GPT-2: fused c_attn sharded by heads, tied embedding/head on the first and last stage (and
    once on a V-schedule rank holding both)."""
    for overrides in (
        ["parallel.tp=4", "parallel.pp=4", "parallel.dp=4", "parallel.zero_stage=0"],
        [
            "parallel.tp=2",
            "parallel.pp=2",
            "parallel.dp=16",
            "parallel.zero_stage=3",
            "parallel.pp_schedule=zbv",
            "parallel.pp_virtual_stages=2",
        ],
    ):
        v = validate(
            compose(
                [
                    "model=gpt2-small",
                    "cluster.devices_per_node=64",
                    "train.global_batch_size=64",
                    "train.micro_batch_size=1",
                ]
                + overrides
            )
        )
        sim = simulate(v, default_ranks(v.layout))
        assert sim.exact, [(r.rank, r.simulated, r.analytic) for r in sim.ranks]
        names = {p.name for p in sim.ranks[0].params}
        assert "transformer.wte.weight" in names


def test_shipped_gpt3_recipe_simulates_with_megatron_sp():
    """GPT-2-style Megatron-SP is built (partrain.parallel.megatron_sp): the simulation runs the real
    wrappers with it, and the parameter shards are those of plain TP (SP moves activations only)."""
    v = validate(compose(["recipe=gpt3-175b-h100"]))
    sim = simulate(v, [0])
    assert sim.exact and not any("sequence parallelism" in n for n in sim.notes)


def test_grouped_params_fold_layer_indices():
    v = validate(compose(["recipe=gpt-3d"]))
    sim = simulate(v, [0])
    groups = grouped_params(sim.ranks[0].params)
    layers = [g for g in groups if ".*." in g["name"]]
    assert layers and all(g["count"] >= 1 for g in layers)
    assert sum(g["bytes"] for g in groups) == sim.ranks[0].simulated["params"]


def test_cli_simulates_llama3_70b_on_1024_ranks(run_partrain):
    # Its speed is measured by benchmarks/search_speed.py (target < 60 s), not timed here.
    ran = run_partrain(
        "plan", "recipe=llama3-70b-h100", "cluster=h100x1024", "parallel.dp=-1", "--simulate", "--json", timeout=120
    )
    assert ran.code == 0, ran.stderr
    report = json.loads(ran.stdout)
    sim = report["simulation"]
    assert sim["world_size"] == 1024 and sim["exact"]
    assert [r["coords"]["pp"] for r in sim["ranks"]] == [0, 0, 1, 1, 2, 2, 3, 3]  # first and last rank of each stage
    for r in sim["ranks"]:
        assert r["exact"] and r["simulated"]["params"] == r["analytic"]["params"]
        assert all(len(p["local_shape"]) == len(p["shape"]) for p in r["params"])
    assert ran.spawned == [] and ran.created() == []


def test_cli_terminal_tables(cli):
    ran = cli("plan", "recipe=gpt-3d", "--simulate-rank", "0", "--simulate-rank", "7")
    assert ran.code == 0, ran.stderr
    assert "simulated ranks" in ran.stdout and "rank 0: parameters" in ran.stdout
    assert ran.stdout.count("yes") >= 2


@pytest.mark.parametrize(
    "args, key",
    [
        (["recipe=gpt-3d", "--simulate-rank", "8"], "--simulate-rank"),
        (["recipe=gpt-3d", "--simulate-rank", "-1"], "--simulate-rank"),
    ],
)
def test_cli_bad_simulation_requests_exit_2(cli, args, key):
    ran = cli("plan", *args)
    assert ran.code == 2
    assert key in ran.stderr + ran.stdout and "Traceback" not in ran.stderr
    assert ran.created() == []


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.zero_stage=0"],
        ["parallel.zero_stage=3"],
        ["parallel.zero_stage=3", "parallel.pp=2", "parallel.dp=1", "peft.target_modules=[q_proj,down_proj]"],
    ],
    ids=["ddp-tp2", "fsdp-tp2", "pp2-tp2-fsdp-two-targets"],
)
def test_lora_ranks_hold_what_the_planner_counts(overrides):
    """LoRA (peft=lora): the frozen base keeps its parameters but no gradient or optimizer state; the
    adapters, split as partrain.parallel.lora splits them, take both. Simulated == analytic, exactly."""
    base = ["recipe=llama-fsdp-tp", "parallel.tp_sequence_parallel=false", "peft=lora", *overrides]
    v = validate(compose(base))
    full = simulate(validate(compose([o for o in base if not o.startswith(("peft", "parallel.zero"))])), [0])
    for rank in simulate(v).ranks:
        assert rank.simulated == rank.analytic, rank.rank
        assert 0 < rank.simulated["grads"] < rank.simulated["params"] / 4  # adapters only
    assert simulate(v, [0]).ranks[0].simulated["param_elements"] > full.ranks[0].simulated["param_elements"]
