"""Expert parallelism before launch: the MoE config keys' rules, the planner's expert accounting and
`plan --simulate` with ep > 1.

Bad MoE/ep inputs are refused through the real CLI in-process (exit 2, one message naming the key,
nothing created, no process started), as tests/test_validate.py does for the other keys.
"""

from __future__ import annotations

import json

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate

GPT = "recipe=gpt-3d"  # dense: 8 ranks = dp2 x tp2 x pp2
MOE = "recipe=mixtral-ep"  # 2 ranks = dp2, ep2; 4 experts, top-2
QWEN = [
    "model=qwen2-moe-tiny",
    "cluster.devices_per_node=6",
    "parallel.dp=6",
    "train.micro_batch_size=1",
    "train.global_batch_size=6",
]  # 8 experts; dp x sp = 6

# (name, arguments after `partrain train`, the key the one error must name, words the fix must contain)
BAD = [
    ("cf-zero", [MOE, "parallel.moe_capacity_factor=0"], "parallel.moe_capacity_factor", "null"),
    ("cf-negative", [MOE, "parallel.moe_capacity_factor=-1.5"], "parallel.moe_capacity_factor", "1.25"),
    ("cf-nan", [MOE, "parallel.moe_capacity_factor=nan"], "parallel.moe_capacity_factor", "1.25"),
    ("cf-not-a-number", [MOE, "parallel.moe_capacity_factor=abc"], "parallel.moe_capacity_factor", ""),
    ("aux-negative", [MOE, "parallel.moe_aux_loss_coef=-0.01"], "parallel.moe_aux_loss_coef", "router_aux_loss_coef"),
    ("z-negative", [MOE, "parallel.moe_z_loss_coef=-1"], "parallel.moe_z_loss_coef", "0.001"),
    ("z-inf", [MOE, "parallel.moe_z_loss_coef=inf"], "parallel.moe_z_loss_coef", "0.001"),
    ("bias-negative", [MOE, "parallel.moe_bias_update_speed=-0.001"], "parallel.moe_bias_update_speed", "0.001"),
    # Mixtral's router has no selection bias: auxiliary-loss-free balancing needs DeepSeek-V3's.
    ("bias-no-router-bias", [MOE, "parallel.moe_bias_update_speed=0.001"], "parallel.moe_bias_update_speed", "aux"),
    ("dense-bias", [GPT, "parallel.moe_bias_update_speed=0.001"], "parallel.moe_bias_update_speed", "mixtral"),
    ("dense-cf", [GPT, "parallel.moe_capacity_factor=1.25"], "parallel.moe_capacity_factor", "model=mixtral-tiny"),
    ("dense-aux", [GPT, "parallel.moe_aux_loss_coef=0.01"], "parallel.moe_aux_loss_coef", "model=mixtral-tiny"),
    ("dense-z", [GPT, "parallel.moe_z_loss_coef=0.001"], "parallel.moe_z_loss_coef", "model=mixtral-tiny"),
    ("dense-ep", [GPT, "parallel.ep=2"], "parallel.ep", "model=mixtral-tiny"),
    ("ep-zero", [MOE, "parallel.ep=0"], "parallel.ep", "parallel.ep=1"),
    ("ep-vs-experts", QWEN + ["parallel.ep=3"], "parallel.ep", "valid ep here: 1, 2"),
    (
        "ep-vs-dp-sp",
        [MOE, "parallel.dp=1", "parallel.sp=2", "parallel.ep=4", "train.global_batch_size=4"],
        "parallel.ep",
        "valid ep here: 1, 2",
    ),
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


@pytest.mark.parametrize(
    "overrides",
    [
        [MOE, "parallel.moe_capacity_factor=1.25", "parallel.moe_aux_loss_coef=0", "parallel.moe_z_loss_coef=0.001"],
        [MOE, "parallel.moe_capacity_factor=0.5"],
        QWEN + ["parallel.ep=2"],
        [
            GPT,
            "parallel.moe_capacity_factor=null",
            "parallel.moe_aux_loss_coef=null",
            "parallel.moe_z_loss_coef=0",
        ],  # defaults
    ],
)
def test_good_moe_input_accepted(overrides):
    validate(compose(overrides))


# --- the planner's expert accounting -----------------------------------------------------------------

from partrain.blueprint.planner.estimate import estimate  # noqa: E402
from partrain.blueprint.planner.moe import expert_capacity  # noqa: E402
from partrain.blueprint.planner.rank_state import predicted_rank_elements  # noqa: E402
from partrain.blueprint.planner.spec import spec_from_validated  # noqa: E402

# Planning sizes (meta only): Mixtral-8x7B and Qwen2-MoE-A2.7B shapes on 64 H100s.
MIXTRAL_8X7B = [
    "model=mixtral-tiny",
    "cluster=h100x64",
    "train.precision=bf16",
    "train.seq_len=4096",
    "train.micro_batch_size=1",
    "model.config.hidden_size=4096",
    "model.config.intermediate_size=14336",
    "model.config.num_hidden_layers=32",
    "model.config.num_attention_heads=32",
    "model.config.num_key_value_heads=8",
    "model.config.num_local_experts=8",
    "model.config.vocab_size=32000",
    "model.config.max_position_embeddings=32768",
]
QWEN2_MOE_A27B = [
    "model=qwen2-moe-tiny",
    "cluster=h100x64",
    "train.precision=bf16",
    "train.seq_len=4096",
    "train.micro_batch_size=1",
    "model.config.hidden_size=2048",
    "model.config.intermediate_size=5632",
    "model.config.moe_intermediate_size=1408",
    "model.config.shared_expert_intermediate_size=5632",
    "model.config.num_hidden_layers=24",
    "model.config.num_attention_heads=16",
    "model.config.num_key_value_heads=16",
    "model.config.num_experts=60",
    "model.config.num_experts_per_tok=4",
    "model.config.vocab_size=151936",
    "model.config.max_position_embeddings=8192",
]


def _plan(base, *extra):
    v = validate(compose(base + list(extra)))
    return v, estimate(v, mixed="zero")  # the published (16-bit) accounting these checks state


@pytest.mark.parametrize(
    "base,ep", [(MIXTRAL_8X7B, 2), (MIXTRAL_8X7B, 8), (QWEN2_MOE_A27B, 4), (QWEN2_MOE_A27B, 60 // 15)]
)
def test_expert_states_per_rank_are_total_over_ep(base, ep):
    args = ["parallel.dp=64", "train.global_batch_size=64"]
    _, one = _plan(base, *args)
    _, split = _plan(base, *args, f"parallel.ep={ep}")
    moe1, moe = one["moe"], split["moe"]
    assert moe["expert_params_total"] == moe1["expert_params_total"] == moe1["expert_params_per_rank"]
    assert moe["expert_params_per_rank"] * ep == moe["expert_params_total"]
    # Dense parameters do not change; the rank's parameters drop by exactly the experts it gave away.
    assert (
        one["memory_bytes"]["params"] - split["memory_bytes"]["params"]
        == (moe1["expert_params_per_rank"] - moe["expert_params_per_rank"]) * 2
    )  # bf16 "zero" accounting: 2 bytes


def test_zero_stages_shard_experts_over_their_replicas():
    """ep=8 of dp=64: each expert has edp = 8 replicas; ZeRO-1 and FSDP shard its states over them."""
    for zero in (1, 3):
        v, est = _plan(
            MIXTRAL_8X7B, "parallel.dp=64", "train.global_batch_size=64", "parallel.ep=8", f"parallel.zero_stage={zero}"
        )
        moe = est["moe"]
        assert moe["edp"] == moe["expert_shard"] == 8
        local = moe["expert_params_per_rank"]
        if zero == 1:  # parameters whole, Adam state of the expert group cut over edp
            assert moe["expert_state_bytes_per_rank"]["optimizer"] == pytest.approx(local / 8 * 12, rel=1e-6)
        else:
            # FSDP cuts the expert dim of the local [E/ep, ...] tensors (torch.chunk): 1 expert over 8 -> all on rank 0
            assert local == moe["expert_params_total"] // 8
            assert moe["expert_state_bytes_per_rank"]["params"] == local * 2
        # The runtime-accounting count (simulate's reference) agrees with the report block.
        p, _, _ = predicted_rank_elements(spec_from_validated(v, mixed="autocast"), v.layout, 0)
        assert p >= local


@pytest.mark.parametrize("cf", [None, 0.5, 1.0, 2.0])
def test_all_to_all_bytes_per_step(cf):
    """tokens x top_k x hidden x 2 bytes x (ep-1)/ep per all-to-all, 4 per MoE layer and microbatch
    (dispatch + combine, forward + backward); a capacity factor < 1 bounds the pairs sent."""
    extra = [] if cf is None else [f"parallel.moe_capacity_factor={cf}"]
    v, est = _plan(MIXTRAL_8X7B, "parallel.dp=64", "train.global_batch_size=128", "parallel.ep=8", *extra)
    tokens, k, h, e, ep = 4096, 2, 4096, 8, 8
    pairs = tokens * k if cf is None else min(tokens * k, e * expert_capacity(cf, tokens, k, e))
    one = pairs * h * 2 * (ep - 1) / ep
    assert est["moe"]["all_to_all_bytes_per_layer_microbatch"]["dispatch_forward"] == pytest.approx(one)
    assert est["comm_bytes_per_step"]["ep"] == pytest.approx(32 * 4 * one * v.microbatches)
    assert est["moe"]["kept_fraction"] == pytest.approx(1.0 if cf is None or cf >= 1 else cf)
    assert est["moe"]["receive_bound_pairs"] == (
        8 * tokens * k if cf is None else e * expert_capacity(cf, tokens, k, e)
    )


def test_all_to_all_time_at_the_ep_link():
    """ep inside a node runs at the intra-node bandwidth, an ep group spanning nodes at the inter-node one."""
    args = ["parallel.dp=64", "train.global_batch_size=64"]
    _, inside = _plan(MIXTRAL_8X7B, *args, "parallel.ep=8")
    assert inside["links"]["ep"].startswith("intra-node 450")
    assert inside["time_breakdown_s"]["ep"] == pytest.approx(inside["comm_bytes_per_step"]["ep"] / 450e9)
    _, across = _plan(MIXTRAL_8X7B, *args, "parallel.ep=8", "cluster.devices_per_node=4", "cluster.nodes=16")
    assert across["links"]["ep"].startswith("inter-node 50")
    assert across["time_breakdown_s"]["ep"] == pytest.approx(across["comm_bytes_per_step"]["ep"] / 50e9)


def test_expert_gradients_are_reduced_over_edp_only():
    args = ["parallel.dp=64", "train.global_batch_size=64", "train.precision=fp32"]
    _, one = _plan(MIXTRAL_8X7B, *args)
    _, split = _plan(MIXTRAL_8X7B, *args, "parallel.ep=8")
    dense = one["params_total"] - one["moe"]["expert_params_total"]
    ring = lambda n: 2 * (n - 1) / n  # noqa: E731
    assert one["comm_bytes_per_step"]["dp"] == pytest.approx(one["params_total"] * 4 * ring(64))
    assert split["comm_bytes_per_step"]["dp"] == pytest.approx(
        dense * 4 * ring(64) + split["moe"]["expert_params_per_rank"] * 4 * ring(8)
    )


# --- plan --simulate with ep > 1: the real apply_ep on meta at planning sizes ------------------------

from partrain.simulate.fake_world import simulate  # noqa: E402

EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


@pytest.mark.parametrize(
    "base,extra",
    [
        (MIXTRAL_8X7B, ["parallel.ep=8"]),
        (QWEN2_MOE_A27B, ["parallel.ep=4"]),
        # FSDP over edp = 32 cuts each rank's 4 local experts on dim 0 (torch.chunk): positions 0-3 of an
        # edp group hold one expert each, the rest none; the planner counts the same.
        (MIXTRAL_8X7B, ["parallel.ep=2", "parallel.zero_stage=3"]),
        # Hybrid sharding: dense states over dp_shard = 8, experts still over their whole edp group (8).
        (MIXTRAL_8X7B, ["parallel.ep=8", "parallel.zero_stage=3", "parallel.dp_shard=8"]),
    ],
)
def test_simulate_with_ep_matches_the_planner(base, extra):
    v = validate(compose(base + ["parallel.dp=64", "train.global_batch_size=64"] + extra))
    ep, est = v.layout.ep, estimate(v)
    sim = simulate(v, [0, 4, 63])  # rank 4: another position in its edp group than in its dense shard group
    for r in sim.ranks:
        assert r.exact and r.simulated["params"] == r.analytic["params"], r.rank
        experts = [p for p in r.params if p.name.endswith(EXPERT_TENSORS)]
        assert len(experts) == 2 * est["moe"]["moe_layers_total"]
        assert all(p.shape[0] == v.facts.n_experts for p in experts)
        if v.run.parallel.zero_stage == 0:
            assert all(p.local_shape[0] == v.facts.n_experts // ep for p in experts)
            expert_bytes = sum(p.bytes for p in experts)  # fp32 (the runtime's accounting)
            assert expert_bytes == pytest.approx(est["moe"]["expert_params_total"] * 4 / ep, rel=0.02)
            assert expert_bytes == est["moe"]["expert_params_per_rank"] * 4
    if v.run.parallel.zero_stage == 3 and ep == 2:
        held = {r.rank: sum(p.local_shape[0] for p in r.params if p.name.endswith(EXPERT_TENSORS)) for r in sim.ranks}
        assert held == {0: 2 * 32, 4: 2 * 32, 63: 0}  # edp positions 0-3 (ranks 0-7) hold one expert each


def test_plan_simulate_accepts_ep(cli):
    ran = cli("plan", MOE, "--simulate", "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    report = json.loads(ran.stdout)
    assert report["simulation"]["exact"] and report["estimate"]["moe"]["ep"] == 2


def test_capacity_below_one_shrinks_expert_activations():
    """Dropped pairs are neither sent nor run: cf=0.5 keeps half of the per-pair activations."""
    args = ["parallel.dp=64", "train.global_batch_size=64", "parallel.ep=8"]
    _, dropless = _plan(MIXTRAL_8X7B, *args)
    _, half = _plan(MIXTRAL_8X7B, *args, "parallel.moe_capacity_factor=0.5")
    _, roomy = _plan(MIXTRAL_8X7B, *args, "parallel.moe_capacity_factor=2.0")
    assert (
        half["memory_bytes"]["activations"]
        < dropless["memory_bytes"]["activations"]
        == roomy["memory_bytes"]["activations"]
    )
    assert half["comm_bytes_per_step"]["ep"] == pytest.approx(dropless["comm_bytes_per_step"]["ep"] / 2)
    assert (
        half["moe"]["receive_bound_pairs"]
        < roomy["moe"]["receive_bound_pairs"]
        < dropless["moe"]["receive_bound_pairs"]
    )
