"""A CPU node whose ranks outnumber its cores: the planner's step is at least the ranks' CPU work over
the cores (planner/host_work.py), from the compute profile's "host" block and the comm profile's CPU
per call. Pure planner: synthetic comm profiles, a recorded CPU compute profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_comm import synthetic

from partrain.bench.busy_node import busy_groups
from partrain.blueprint.comm_profile import OPS, planner_busy, planner_cpu_costs, ring_steps
from partrain.blueprint.config.compose import compose
from partrain.blueprint.planner.host_work import _param_tensors
from partrain.blueprint.planner.rank_state import pipeline_ranks
from partrain.blueprint.planner.spec import spec_from_validated
from partrain.blueprint.validate import validate

CPU_PROFILE = Path(__file__).parent / "fixtures" / "cpu_gpt3d_compute_profile.json"
GPU_CLUSTER = {"name": "h100x8", "nodes": 1, "devices_per_node": 8, "backend": "nccl", "device": "cuda"}
LINKS = {op: 0.2 for op in OPS}  # GB/s, about what gloo reaches on the reference VM


def _estimate(cli, *args):
    ran = cli("plan", *args, "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    return json.loads(ran.stdout)["estimate"]


def test_cpu_per_ring_step_from_the_comm_profile(tmp_path):
    assert [ring_steps("all_reduce", n) for n in (2, 8)] == [2, 14]
    assert [ring_steps(op, 8) for op in ("all_gather", "reduce_scatter", "all_to_all", "send_recv")] == [7, 7, 7, 1]
    costs = dict(planner_cpu_costs(synthetic(tmp_path / "cpu.json", LINKS, cpu_s=1e-3)))
    # groups of 2: an all-reduce is 2 ring steps, the others 1
    assert costs["intra/all_reduce"] == pytest.approx(0.5e-3)
    assert costs["intra/send_recv"] == costs["intra/all_gather"] == pytest.approx(1e-3)
    assert planner_cpu_costs(synthetic(tmp_path / "none.json", LINKS)) == ()  # measured before cpu_s existed
    # a GPU's host CPU is not its device: never charged
    assert planner_cpu_costs(synthetic(tmp_path / "gpu.json", LINKS, cluster=GPU_CLUSTER, cpu_s=1e-3)) == ()


def test_the_step_is_the_ranks_cpu_over_the_cores(cli, tmp_path):
    """gpt-3d: 8 ranks on the profile's 2 cores. Each collective call costs its measured CPU: with c CPU-s
    per call of a 2-rank group, a rank's step holds 2 microbatches x (9 TP all-reduces + 1 pipeline send)
    + 1 DP all-reduce + the loop's own: the stop agreement over all 8 (14 ring steps: 7c), the loss
    broadcast (c) and 2 pipeline all-reduces (gradient norm, tied weights), the TP all-reduce of the
    gradient norm, and on the last stage loss parallel's 3 per microbatch: 32c and 38c, 35c a rank on
    average, x 8 ranks / 2 cores = 140c added to the step."""
    base = ["recipe=gpt-3d", f"cluster.compute_profile={CPU_PROFILE}"]
    est = {
        c: _estimate(cli, *base, f"cluster.comm_profile={synthetic(tmp_path / f'c{c}.json', LINKS, cpu_s=c)}")
        for c in (1e-3, 2e-3)
    }
    for e in est.values():
        assert e["time_breakdown_s"]["cpu_shared"] > 0  # the CPU work, not the critical path, sets the step
        assert sum(e["time_breakdown_s"].values()) == pytest.approx(e["step_time_s"])
        (note,) = [n for n in e["notes"] if "processes per node share 2 CPU cores" in n]
        assert "collective calls" in note and "TP wrappers" in note
    assert est[2e-3]["step_time_s"] - est[1e-3]["step_time_s"] == pytest.approx(140 * 1e-3, rel=1e-6)


def _busy(cpu_s: float, inflation: float = 1.0) -> dict:
    return {
        "group_size": 2,
        "bytes": 4096,
        "work_s": 0.004,
        "iters": 20,
        "compute_inflation": inflation,
        "cpu_s": {op: cpu_s for op in OPS},
    }


def test_busy_block_of_the_comm_profile(tmp_path):
    assert busy_groups(1, 8) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert busy_groups(2, 3) == [[0, 1, 2], [3, 4, 5]]  # an odd node's last three form one group
    calls, inflation = planner_busy(synthetic(tmp_path / "busy.json", LINKS, cpu_s=1e-3, busy=_busy(2e-3, 1.3)))
    assert dict(calls) == {op: 2e-3 for op in OPS} and inflation == 1.3
    assert planner_busy(synthetic(tmp_path / "old.json", LINKS, cpu_s=1e-3)) == ((), 1.0)  # measured before it
    bad = dict(_busy(2e-3, float("nan")), cpu_s={"all_reduce": -1.0, "send_recv": 1e-3, "bogus": 1.0})
    assert planner_busy(synthetic(tmp_path / "bad.json", LINKS, cpu_s=1e-3, busy=bad)) == ((("send_recv", 1e-3),), 1.0)
    gpu = synthetic(tmp_path / "gpu.json", LINKS, cluster=GPU_CLUSTER, cpu_s=1e-3, busy=_busy(2e-3, 1.3))
    assert planner_busy(gpu) == ((), 1.0)  # a GPU's host CPU is not its device


def test_busy_node_calls_cost_their_measured_cpu_per_call(cli, tmp_path):
    """With a busy block every call inside the node costs its measured CPU b, whatever its group's size:
    gpt-3d's first stage makes 2 x (9 TP all-reduces + 1 pipeline send) + 1 DP all-reduce + the stop
    agreement over all 8 (one call now, not 14 ring steps) + the loss broadcast + 2 pipeline all-reduces +
    the gradient norm's TP all-reduce = 26 calls, the last stage 6 more (loss parallel): 29 a rank on
    average, x 8 ranks / 2 cores = 116 b. The inflation multiplies the rest of a rank's CPU."""
    base = ["recipe=gpt-3d", f"cluster.compute_profile={CPU_PROFILE}"]

    def step(b: float, inflation: float) -> float:
        comm = synthetic(tmp_path / f"c{b}-{inflation}.json", LINKS, cpu_s=1e-3, busy=_busy(b, inflation))
        e = _estimate(cli, *base, f"cluster.comm_profile={comm}")
        assert e["time_breakdown_s"]["cpu_shared"] > 0
        return e["step_time_s"]

    one, two = step(1e-3, 1.0), step(2e-3, 1.0)
    assert two - one == pytest.approx(116e-3, rel=1e-6)
    own = one - 116e-3  # the ranks' own CPU over the cores
    assert step(1e-3, 1.5) - one == pytest.approx(0.5 * own, rel=1e-6)


def test_measured_rank_steps_replace_the_busy_inflation(cli, tmp_path):
    """A compute profile's host.rank_steps factor (the profiled layout's real rank steps over their count)
    multiplies every rank's own CPU in place of the comm profile's busy-node inflation; the collective
    calls keep their measured CPU."""
    comm = synthetic(tmp_path / "comm.json", LINKS, cpu_s=1e-3, busy=_busy(1e-3, 1.5))
    profile = json.loads(CPU_PROFILE.read_text())
    profile["host"]["rank_steps"] = {
        "layout": "dp2 tp2 pp2",
        "ranks": [0],
        "measured_cpu_s": [2.0],
        "counted_cpu_s": [1.0],
        "factor": 2.0,
    }
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(profile))
    plain = synthetic(tmp_path / "plain.json", LINKS, cpu_s=1e-3, busy=_busy(1e-3, 1.0))
    steps = {
        (p, c): _estimate(cli, "recipe=gpt-3d", f"cluster.compute_profile={p}", f"cluster.comm_profile={c}")[
            "step_time_s"
        ]
        for p, c in ((CPU_PROFILE, plain), (measured, comm))
    }
    own = steps[(CPU_PROFILE, plain)] - 116e-3  # the ranks' own CPU over the cores, as counted
    assert steps[(measured, comm)] - 116e-3 == pytest.approx(2.0 * own, rel=1e-6)


def test_host_costs_scale_the_bound(cli, tmp_path):
    """Doubling the per-tensor optimizer cost of DTensors adds it once more for each DTensor a rank steps
    (gpt-3d's stages: 13 each, see the next test), x 8 ranks / 2 cores."""
    comm = synthetic(tmp_path / "comm.json", LINKS, cpu_s=1e-3)
    profile = json.loads(CPU_PROFILE.read_text())
    per_tensor = profile["host"]["optimizer_s_per_tensor"]["dtensor"]
    profile["host"]["optimizer_s_per_tensor"]["dtensor"] = 2 * per_tensor
    doubled = tmp_path / "doubled.json"
    doubled.write_text(json.dumps(profile))
    steps = [
        _estimate(cli, "recipe=gpt-3d", f"cluster.compute_profile={p}", f"cluster.comm_profile={comm}")["step_time_s"]
        for p in (CPU_PROFILE, doubled)
    ]
    assert steps[1] - steps[0] == pytest.approx(13 * per_tensor * 8 / 2, rel=1e-6)


def test_parameter_tensors_and_which_are_dtensors():
    spec = spec_from_validated(validate(compose(["recipe=gpt-3d"])))
    first, last = (_param_tensors(spec, r) for r in pipeline_ranks(spec))
    # 2 GPT-2 layers of 12 tensors (6 TP-sliced) + wte (sliced) and wpe; 2 layers + ln_f (2) + the tied head copy
    assert (len(first), sum(first)) == (26, 13)
    assert (len(last), sum(last)) == (27, 13)
    fsdp = spec_from_validated(validate(compose(["recipe=gpt-dp", "parallel.zero_stage=3"])))
    (only,) = [_param_tensors(fsdp, r) for r in pipeline_ranks(fsdp)]
    assert all(only) and len(only) == 4 * 12 + 2 + 2  # FSDP: every parameter is a DTensor


def test_no_bound_where_cores_are_not_shared_or_off_cpu(cli, tmp_path):
    comm = synthetic(tmp_path / "comm.json", LINKS, cpu_s=1e-3)
    dp = _estimate(cli, "recipe=gpt-dp", f"cluster.compute_profile={CPU_PROFILE}", f"cluster.comm_profile={comm}")
    assert not any("CPU cores" in n for n in dp["notes"])  # 2 ranks on 2 cores
    # without per-call costs the work is the compute model's own: never above its critical path
    bare = json.loads(CPU_PROFILE.read_text())
    del bare["host"]
    path = tmp_path / "bare.json"
    path.write_text(json.dumps(bare))
    est = _estimate(cli, "recipe=gpt-3d", f"cluster.compute_profile={path}")
    assert est["time_breakdown_s"]["cpu_shared"] == 0.0
    (note,) = [n for n in est["notes"] if "processes per node share 2 CPU cores" in n]
    assert "no host block" in note and "no collective CPU" in note


@pytest.mark.parametrize(
    "host",
    [
        {"optimizer_s_per_tensor": {"plain": 1e-4}, "clip_s_per_tensor": {"plain": 1e-5, "dtensor": 1e-5}},
        {
            "optimizer_s_per_tensor": {"plain": 1e-4, "dtensor": 1e-4},
            "clip_s_per_tensor": {"plain": 1e-5, "dtensor": 1e-5},
            "tp_layer_s": -1.0,
        },
        "fast",
        {
            "optimizer_s_per_tensor": {"plain": 1e-4, "dtensor": 1e-4},
            "clip_s_per_tensor": {"plain": 1e-5, "dtensor": 1e-5},
            "rank_steps": {"factor": 0.0},
        },
    ],
)
def test_a_broken_host_block_exits_2(cli, tmp_path, host):
    profile = dict(json.loads(CPU_PROFILE.read_text()), host=host)
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(profile))
    ran = cli("plan", "recipe=gpt-3d", f"cluster.compute_profile={path}")
    assert ran.code == 2 and "host" in ran.stderr and "Traceback" not in ran.stderr
