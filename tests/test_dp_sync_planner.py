"""The planner's alpha-beta model of the dp_sync strategies (pure arithmetic) and `partrain bench
dp-sync` end to end: real bytes counted beside the prediction, bad input refused before any process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from partrain.blueprint.planner.dp_sync_cost import sync_cost
from partrain.blueprint.planner.spec import ClusterSpec

G = 1e8


def cluster(nodes: int, per_node: int, alpha: float = 0.0) -> ClusterSpec:
    lat = (
        ("inter/send_recv", alpha),
        ("intra/send_recv", alpha),
        ("inter/all_reduce", alpha),
        ("intra/all_reduce", alpha),
    )
    return ClusterSpec(nodes, per_node, "cpu", 1e9, 1e12, intra_bw=100e9, inter_bw=10e9, latencies=lat)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_sends_two_n_minus_one_over_n_and_pays_two_n_minus_one_alphas(n):
    c = cluster(1, n, alpha=1e-5)
    cost = sync_cost("ring", c, list(range(n)), G, buckets=3)
    assert cost.bytes_per_rank == cost.busiest_bytes == pytest.approx(2 * (n - 1) / n * G)
    assert cost.seconds == pytest.approx(3 * 2 * (n - 1) * 1e-5 + cost.bytes_per_rank / 100e9)


def test_hierarchical_moves_a_node_share_across_nodes():
    c = cluster(2, 4)
    ranks = list(range(8))
    flat, hier = sync_cost("ring", c, ranks, G), sync_cost("hierarchical", c, ranks, G)
    assert flat.inter_node_bytes == pytest.approx(2 * 7 / 8 * G)
    assert hier.inter_node_bytes == pytest.approx(2 * 1 / 2 * G / 4)  # a ring of 2 nodes over G/4
    assert hier.seconds < flat.seconds
    # One node: hierarchical is the flat ring.
    one = cluster(1, 8)
    assert sync_cost("hierarchical", one, ranks, G).bytes_per_rank == pytest.approx(flat.bytes_per_rank)


def test_parameter_server_bottleneck_grows_with_workers_and_shrinks_with_servers():
    busiest = [sync_cost("parameter-server", cluster(1, n), list(range(n)), G).busiest_bytes for n in (2, 4, 8)]
    assert busiest == pytest.approx([1 * G, 3 * G, 7 * G])
    two = sync_cost("parameter-server", cluster(1, 8), list(range(8)), G, servers=2)
    assert two.busiest_bytes == pytest.approx(7 * G / 2 + G / 2)  # pulls of its half + its push of the other half
    dedicated = sync_cost("parameter-server", cluster(1, 8), list(range(8)), G, servers=1, dedicated=True)
    assert dedicated.busiest_bytes == pytest.approx(7 * G) and dedicated.bytes_per_rank == pytest.approx(14 * G / 8)


def test_plan_charges_the_parameter_server_bottleneck(cli):
    args = ["recipe=gpt-dp", "parallel.dp=8", "train.global_batch_size=32", "cluster.devices_per_node=8"]
    times = {}
    for s in ("allreduce", "parameter-server"):
        ran = cli("plan", *args, f"parallel.dp_sync={s}", "cluster.intra_node_gbps=0.01", "--json")
        assert ran.code == 0, ran.stderr
        times[s] = json.loads(ran.stdout)["estimate"]["step_time_s"]
    assert times["parameter-server"] > times["allreduce"]


def test_bench_refuses_bad_input_before_any_process(cli):
    ran = cli("bench", "dp-sync", "recipe=gpt-dp", "parallel.dp_bucket_mb=-1")
    assert ran.code == 2 and ran.spawned == [] and "parallel.dp_bucket_mb" in ran.stderr


def test_bench_measures_dedicated_servers_that_train_refuses():
    from partrain.bench.dp_sync_parent import validated

    run = validated(
        [
            "recipe=gpt-dp",
            "parallel.dp=2",
            "cluster.devices_per_node=2",
            "parallel.dp_sync=parameter-server",
            "parallel.ps_placement=dedicated",
        ],
        [],
    )
    assert run.parallel.ps_placement == "dedicated"


@pytest.mark.slow
def test_bench_counts_real_bytes_beside_the_plan(tmp_path):
    args = ["recipe=gpt-dp", "parallel.dp=2", "cluster.devices_per_node=2", "--iters", "1", "--warmup", "0"]
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "partrain.cli", "bench", "dp-sync", *args, "--out", str(out), "--json"]
    ran = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    rep = json.loads(ran.stdout)
    assert json.loads(out.read_text())["rows"] == rep["rows"]
    g = rep["grad_bytes"]
    rows = {r["strategy"]: r for r in rep["rows"]}
    assert rows["ring"]["bytes_per_rank"] == pytest.approx(g, rel=1e-3)  # 2(N-1)/N = 1 at N = 2
    assert rows["ring"]["predicted"]["bytes_per_rank"] == pytest.approx(g)
    ps = rows["parameter-server x1"]
    assert ps["busiest_rank"] == 0 and ps["busiest_bytes"] == pytest.approx(g, rel=1e-3)
    assert rows["parameter-server x1 dedicated"]["busiest_bytes"] == pytest.approx(g, rel=1e-3)
