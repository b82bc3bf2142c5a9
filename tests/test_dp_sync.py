"""Data-parallel gradient synchronisation strategies (`parallel.dp_sync`) for real: gloo, several
processes, real send/recv and collectives.

Parity: per-step losses and gradient norms of every strategy at dp=4 (and hierarchical and the
parameter server on 2 nodes x 2 devices, the node structure simulated by the layout; ring with
tp=2, hierarchical with pp=2) within 1e-5 relative of the one-process run (fp32, 3 steps). All
cases share one 4-process launch (`partrain.testing.in_process.train_cases`). Bytes: what the
counters saw against the algorithms' arithmetic. The ring itself: odd world size and buffer
lengths against a plain sum.
"""

from __future__ import annotations

import pytest

from partrain.runtime.spawn import run_spawned
from partrain.testing.in_process import train_cases
from partrain.testing.parity import check_parity, reference_overrides, run_training

STEPS = 3
BASE = [
    "recipe=gpt-dp",
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "data.max_bytes=1000000",
    "train.eval_every=0",
    "train.eval_batches=0",
]
ONE_NODE = ["parallel.dp=4", "cluster.nodes=1", "cluster.devices_per_node=4"]
TWO_NODES = ["parallel.dp=4", "cluster.nodes=2", "cluster.devices_per_node=2"]
# allreduce (DDP) at dp=4 is tests/test_data_parallel.py's dp4-zero0.
CASES = {
    # A small bucket: several buckets launched from backward, split unevenly over 4 ranks.
    "ring-dp4": ONE_NODE + ["parallel.dp_sync=ring", "parallel.dp_bucket_mb=0.3"],
    "ring-dp4-zero1": ONE_NODE + ["parallel.dp_sync=ring", "parallel.zero_stage=1"],
    "hierarchical-dp4": ONE_NODE + ["parallel.dp_sync=hierarchical"],
    "parameter-server-dp4": ONE_NODE + ["parallel.dp_sync=parameter-server"],
    "hierarchical-2x2": TWO_NODES + ["parallel.dp_sync=hierarchical", "parallel.dp_bucket_mb=0.3"],
    "parameter-server-2x2": TWO_NODES + ["parallel.dp_sync=parameter-server", "parallel.ps_servers=2"],
    # The dp group as a sub-group of the grid: tensor-parallel DTensor gradients (one flat buffer after
    # backward), and pipeline stages with dp outermost (each dp group spans both nodes, one rank per node).
    "ring-dp2-tp2": ["parallel.dp=2", "parallel.tp=2", "cluster.devices_per_node=4", "parallel.dp_sync=ring"],
    "hierarchical-dp2-pp2-2x2": [
        "parallel.dp=2",
        "parallel.pp=2",
        "cluster.nodes=2",
        "cluster.devices_per_node=2",
        "parallel.order=[tp,sp,pp,dp]",
        "parallel.dp_sync=hierarchical",
    ],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = tmp_path_factory.mktemp("data-cache")
    base = BASE + [f"data.cache_dir={cache}"]
    reference = run_training(reference_overrides(base), tmp_path_factory.mktemp("ref") / "run", STEPS)
    cases = [base + overrides for overrides in CASES.values()]
    per_rank = run_spawned(
        train_cases, 4, tmp_path_factory.mktemp("spawn4"), str(reference.run_dir), cases, STEPS, timeout_s=540
    )
    return reference, {name: [rank[i] for rank in per_rank] for i, name in enumerate(CASES)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_strategy_matches_single_process(name, runs):
    reference, got = runs
    for rank, record in enumerate(got[name]):
        layout = type(reference)(record["losses"], record["grad_norms"], reference.run_dir, {})
        diffs = check_parity(reference, layout)
        if rank == 0:
            print(f"{name}: {diffs}")
    assert got[name][0]["losses"][-1] < got[name][0]["losses"][0]


def _grad_bytes(runs) -> int:
    reference, _ = runs
    # fp32 Adam: 16 bytes per parameter at rest, 4 of them the gradient.
    return reference.summary["ranks"][0]["model_state_bytes"] // 4


@pytest.mark.slow
def test_ring_sends_two_n_minus_one_over_n_of_the_gradients(runs):
    grads, n = _grad_bytes(runs), 4
    for name in ("ring-dp4", "hierarchical-dp4"):  # one node: hierarchical is the plain ring
        for record in runs[1][name]:
            per_step = record["counter"]["sent_bytes"] / STEPS
            # Chunk sizes differ by one element per bucket: 2(N-1)/N up to a few elements.
            assert abs(per_step / grads - 2 * (n - 1) / n) < 1e-3, (name, per_step, grads)


@pytest.mark.slow
def test_hierarchical_on_two_nodes_sends_less_across_nodes_than_in_total(runs):
    grads = _grad_bytes(runs)
    for record in runs[1]["hierarchical-2x2"]:
        # Intra-node ring of 2 over the whole buffer (2 x 1/2) + inter-node ring of 2 over half (2 x 1/4).
        per_step = record["counter"]["sent_bytes"] / STEPS
        assert abs(per_step / grads - 1.5) < 1e-3, (per_step, grads)
        assert record["overlap"]["buckets"] > STEPS  # several buckets per step, launched from backward


@pytest.mark.slow
def test_parameter_server_is_the_busiest_rank(runs):
    grads = _grad_bytes(runs)
    sent = [r["counter"]["sent_bytes"] / STEPS for r in runs[1]["parameter-server-dp4"]]
    # The one server (rank 0) sends every worker the whole model; a worker sends it its gradients.
    assert abs(sent[0] - 3 * grads) <= 64, sent
    assert all(abs(s - grads) <= 64 for s in sent[1:]), sent


def _ring_sums(rank: int, world: int) -> list:
    import torch

    from partrain.parallel.dp_sync.counter import CommCounter
    from partrain.parallel.dp_sync.ring import Ring

    ring = Ring(list(range(world)), rank, None, CommCounter())
    worst = 0.0
    for length in (1, 2, 7, 1000, 1001):  # fewer elements than ranks, and uneven chunks
        flat = torch.arange(length, dtype=torch.float64) * (rank + 1)
        ring.all_reduce(flat)
        want = torch.arange(length, dtype=torch.float64) * sum(range(1, world + 1))
        worst = max(worst, float((flat - want).abs().max()))
    return {"worst": worst, "sent": ring.counter.sent_bytes}


@pytest.mark.slow
def test_ring_is_exact_for_three_ranks_and_any_length(tmp_path):
    results = run_spawned(_ring_sums, 3, tmp_path)
    assert all(r["worst"] == 0.0 for r in results), results
    # Each chunk travels N-1 times in the reduce-scatter and N-1 times in the all-gather: 2(N-1) x the
    # buffer over all ranks, 2(N-1)/N of it per rank (empty chunks send nothing).
    assert sum(r["sent"] for r in results) == 2 * 2 * (1 + 2 + 7 + 1000 + 1001) * 8


# ---- what composes with what (validation, no process) ---------------------------------------------

DP4 = ["recipe=gpt-dp", "parallel.dp=4", "cluster.devices_per_node=4"]
REFUSED = [
    ("unknown", ["parallel.dp_sync=gossip"], "parallel.dp_sync"),
    ("bucket", ["parallel.dp_sync=ring", "parallel.dp_bucket_mb=0"], "parallel.dp_bucket_mb"),
    ("ring-fsdp", ["parallel.dp_sync=ring", "parallel.zero_stage=3"], "parallel.zero_stage"),
    ("ps-zero1", ["parallel.dp_sync=parameter-server", "parallel.zero_stage=1"], "parallel.zero_stage"),
    ("ps-too-many", ["parallel.dp_sync=parameter-server", "parallel.ps_servers=5"], "parallel.ps_servers"),
    ("ps-none", ["parallel.dp_sync=parameter-server", "parallel.ps_servers=0"], "parallel.ps_servers"),
    ("ps-dedicated", ["parallel.dp_sync=parameter-server", "parallel.ps_placement=dedicated"], "parallel.ps_placement"),
    ("ps-fp16", ["parallel.dp_sync=parameter-server", "train.precision=fp16"], "train.precision"),
    ("ps-ckpt", ["parallel.dp_sync=parameter-server", "checkpoint.every_steps=5"], "checkpoint.every_steps"),
    ("ps-tp", ["parallel.dp_sync=parameter-server", "parallel.dp=2", "parallel.tp=2"], "parallel.tp"),
    ("ring-sp", ["parallel.dp_sync=ring", "parallel.dp=2", "parallel.sp=2"], "parallel.sp"),
]


@pytest.mark.parametrize("name,extra,key", REFUSED, ids=[r[0] for r in REFUSED])
def test_unsupported_combinations_name_key_rule_and_fix(name, extra, key):
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose(DP4 + extra))
    problems = err.value.problems
    assert [p.key for p in problems] == [key], problems
    assert problems[0].rule and problems[0].fix


def test_hierarchical_needs_even_node_shares():
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.errors import ConfigError

    # 6 ranks = dp 3 x tp 2 on 2 nodes of 3 devices: dp group [0, 2, 4] puts 2 ranks on node 0, 1 on node 1.
    args = ["recipe=gpt-dp", "parallel.dp=3", "parallel.tp=2", "cluster.nodes=2", "cluster.devices_per_node=3"]
    args += ["train.global_batch_size=12"]
    with pytest.raises(ConfigError) as err:
        validate(compose(args + ["parallel.dp_sync=hierarchical", "cluster.allow_tp_across_nodes=true"]))
    assert [p.key for p in err.value.problems] == ["parallel.dp_sync"], err.value.problems


@pytest.mark.parametrize(
    "extra",
    [
        ["parallel.dp_sync=ring", "parallel.zero_stage=1"],
        ["parallel.dp_sync=hierarchical", "parallel.dp=2", "parallel.tp=2"],
        ["parallel.dp_sync=ring", "parallel.dp=2", "parallel.pp=2"],
        ["parallel.dp_sync=parameter-server", "parallel.ps_servers=4"],
    ],
)
def test_supported_combinations_validate(extra):
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate

    validate(compose(DP4 + extra))


def test_train_refuses_with_exit_2_before_any_process(cli):
    ran = cli("train", *DP4, "parallel.dp_sync=parameter-server", "parallel.zero_stage=2")
    assert ran.code == 2 and ran.spawned == [] and ran.created() == [], ran.stderr
    assert "parallel.zero_stage=2" in ran.stderr and "parameter-server" in ran.stderr
