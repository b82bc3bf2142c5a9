"""Planner and `plan --simulate` for sequence/context parallelism (no processes: fake process group).

sp moves no parameters (weights are replicated over sp like over dp; only FSDP shards over dp x sp),
so a simulated rank holds what the same rank holds without sp; activations, communication and the
step time are what sp changes. The planner's activation bytes per rank are checked against
saved-tensor hooks in real sp processes by `benchmarks/sp.py` (exact on llama-tiny and gpt2-tiny).
"""

from __future__ import annotations

import json

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.planner.estimate import estimate
from partrain.blueprint.validate import validate
from partrain.simulate.fake_world import simulate

TINY = ["model=llama-tiny", "cluster=local-cpu", "train.seq_len=256", "train.micro_batch_size=1"]


def _run(sp: int, dp: int, zero: int, mode: str = "ulysses", extra=()):
    world = sp * dp
    return validate(
        compose(
            TINY
            + [
                f"cluster.devices_per_node={world}",
                f"parallel.sp={sp}",
                f"parallel.dp={dp}",
                f"parallel.sp_mode={mode}",
                f"parallel.zero_stage={zero}",
                f"train.global_batch_size={dp}",
                *extra,
            ]
        )
    )


def _per_rank(v):
    sim = simulate(v)
    for r in sim.ranks:
        assert r.simulated == r.analytic, r.rank  # parameters, gradients and optimizer state alike
    return [r.simulated for r in sim.ranks]


@pytest.mark.parametrize("zero, dp_without_sp", [(0, 2), (1, 2), (3, 4)])
def test_simulated_rank_holds_what_it_holds_without_sp(zero, dp_without_sp):
    """sp=2 x dp=2 against sp=1: DDP and ZeRO-1 (sharded over dp only) compare with dp=2; FSDP shards
    over dp x sp, so it compares with dp=4 (the same shard group size)."""
    with_sp = _per_rank(_run(2, 2, zero, "ring"))
    without = _per_rank(_run(1, dp_without_sp, zero))
    assert with_sp == without


def test_cli_simulates_sp(cli):
    ran = cli("plan", "recipe=llama-long-sp", "--simulate", "--json")
    assert ran.code == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["simulation"]["exact"] and report["simulation"]["world_size"] == 4


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_activation_bytes_per_rank_fall_as_one_over_sp(mode):
    """Saved activations of a rank hold seq/sp tokens. What does not fall: the KV heads repeated
    before the sp attention (GQA: 2 KV heads of 4 saved at the query width) and Ulysses' second
    copy of the attention output."""
    degrees = (1, 2, 4) if mode == "ring" else (1, 2)  # Ulysses: llama-tiny's 2 KV heads allow sp <= 2
    acts = {sp: estimate(_run(sp, 1, 0, mode), mixed="autocast")["memory_bytes"]["activations"] for sp in degrees}
    assert 0.5 <= acts[2] / acts[1] < 0.6
    if mode == "ring":
        assert 0.25 <= acts[4] / acts[1] < 0.3
        assert acts[4] / acts[2] == pytest.approx(0.5, rel=0.02)


@pytest.mark.parametrize("repeats_kv", [True, False])
def test_sp_communication_per_mode(repeats_kv, monkeypatch):
    """Bytes one rank sends per step, by hand: llama-tiny (4 heads x 32 = 128 query width, 2 KV
    heads), 4 layers, 256 tokens over sp=2 -> 128 local tokens, fp32, one microbatch. K and V are
    query-sized while the wiring repeats the KV heads, half that when the ops get them unrepeated
    (sp=2 divides the 2 KV heads, so Ulysses needs no repeat either)."""
    from partrain.blueprint.planner import memory

    monkeypatch.setattr(memory, "SP_REPEATS_KV", repeats_kv)
    q_bytes = 128 * 128 * 4  # one query-sized tensor of the rank
    kv_bytes = q_bytes if repeats_kv else q_bytes // 2
    layers = 4
    uly = estimate(_run(2, 1, 0, "ulysses"))
    # 4 all-to-alls forward (q, k, v, output) + 4 backward, each sending (sp-1)/sp of its tensor.
    assert uly["comm_bytes_per_step"]["sp"] == pytest.approx(layers * 2 * (2 * q_bytes + 2 * kv_bytes) / 2)
    ring = estimate(_run(2, 1, 0, "ring"))
    # K/V pair (sp-1) times forward and backward, fp32 dK/dV pair sp times backward.
    assert ring["comm_bytes_per_step"]["sp"] == pytest.approx(layers * (2 * 1 * 2 * kv_bytes + 2 * 2 * kv_bytes))
    # Full recompute re-runs the forward's exchanges.
    rec = estimate(_run(2, 1, 0, "ulysses", ["parallel.recompute=full"]))
    assert rec["comm_bytes_per_step"]["sp"] == pytest.approx(layers * 3 * (2 * q_bytes + 2 * kv_bytes) / 2)
    # Saved K/V follow the same width: the unrepeated ring keeps 2 x (q - kv) bytes less per layer.
    acts = estimate(_run(2, 1, 0, "ring"), mixed="autocast")["memory_bytes"]["activations"]
    monkeypatch.setattr(memory, "SP_REPEATS_KV", not repeats_kv)
    other = estimate(_run(2, 1, 0, "ring"), mixed="autocast")["memory_bytes"]["activations"]
    assert abs(acts - other) == layers * 2 * (q_bytes - q_bytes // 2)


def test_ring_traffic_hides_behind_attention_blocks():
    """Llama-3-8B, 8192 tokens, tp4 x sp2 on one H100 node: the ring's K/V transfers hide behind
    the attention blocks; what shows is the last dK/dV hop of each layer (fp32, 2 x 4096 tokens x
    1024 query width per rank), which nothing overlaps. Ulysses' all-to-alls are on the critical path."""
    base = [
        "model=llama3-8b",
        "cluster=h100x8",
        "train.seq_len=8192",
        "train.micro_batch_size=1",
        "train.global_batch_size=1",
        "train.precision=bf16",
        "parallel.dp=1",
        "parallel.tp=4",
        "parallel.sp=2",
    ]
    ring = estimate(validate(compose(base + ["parallel.sp_mode=ring"])))
    uly = estimate(validate(compose(base + ["parallel.sp_mode=ulysses"])))
    link = 450e9  # h100x8 NVLink GB/s per direction
    for est in (ring, uly):
        assert est["comm_bytes_per_step"]["sp"] > 0
    from partrain.blueprint.planner.memory import SP_REPEATS_KV

    kv_width = 1024 if SP_REPEATS_KV else 256  # 32 query / 8 KV heads of 128 over tp=4
    last_hops = 32 * 2 * 4096 * kv_width * 4 / link
    assert ring["time_breakdown_s"]["sp"] == pytest.approx(last_hops, rel=0.01)
    assert ring["time_breakdown_s"]["sp"] < 0.5 * ring["comm_bytes_per_step"]["sp"] / link
    assert uly["time_breakdown_s"]["sp"] == pytest.approx(uly["comm_bytes_per_step"]["sp"] / link, rel=0.01)
