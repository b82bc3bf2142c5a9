"""A CPU node whose ranks outnumber its cores: the planner's step is at least the ranks' CPU work over
the cores (planner/cpu_host.py), from the compute profile's "host" block and the comm profile's CPU
per call. Pure planner: synthetic comm profiles, a recorded CPU compute profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_bench_comm import synthetic

from partrain.blueprint.comm_profile import OPS, planner_cpu_costs, ring_steps
from partrain.blueprint.compute_profile import RANK_STEPS_LAYOUT_KEYS
from partrain.blueprint.config.compose import compose
from partrain.blueprint.planner.cpu_host import _param_tensors
from partrain.blueprint.planner.estimate import own_cpu_by_pp_rank
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


def _with_rank_steps(path: Path, block: dict) -> Path:
    profile = json.loads(CPU_PROFILE.read_text())
    profile["host"]["rank_steps"] = block
    path.write_text(json.dumps(profile))
    return path


def test_measured_rank_steps_scale_every_rank_s_own_cpu(cli, tmp_path):
    """A compute profile's host.rank_steps holds measurements only: the profiled layout and each rank's CPU
    per step. At plan time the planner counts that layout's own CPU from the profile's pieces and multiplies
    every rank's own CPU by measured / counted (here 2); the collective calls keep their measured CPU (140c,
    the test above). A block from before the layout was recorded (a stored factor) is ignored."""
    comm = synthetic(tmp_path / "comm.json", LINKS, cpu_s=1e-3)
    v = validate(compose(["recipe=gpt-3d", f"cluster.compute_profile={CPU_PROFILE}"]))
    spec = spec_from_validated(v)
    counted = own_cpu_by_pp_rank(spec)
    ranks = list(range(spec.world))
    pp_ranks = [v.layout.coords(r)["pp"] for r in ranks]
    fields = {k: getattr(spec, k, spec.cluster.devices_per_node) for k in RANK_STEPS_LAYOUT_KEYS}
    measured = _with_rank_steps(
        tmp_path / "measured.json",
        {
            "layout": "dp2 tp2 pp2",
            "spec": fields,
            "ranks": ranks,
            "pp_ranks": pp_ranks,
            "measured_cpu_s": [2 * counted[p] for p in pp_ranks],
        },
    )
    old = _with_rank_steps(tmp_path / "old.json", {"ranks": [0], "measured_cpu_s": [2.0], "factor": 2.0})
    est = {
        p: _estimate(cli, "recipe=gpt-3d", f"cluster.compute_profile={p}", f"cluster.comm_profile={comm}")
        for p in (CPU_PROFILE, measured, old)
    }
    own = est[CPU_PROFILE]["step_time_s"] - 140e-3  # the ranks' own CPU over the cores, as counted
    assert est[measured]["step_time_s"] - 140e-3 == pytest.approx(2.0 * own, rel=1e-6)
    assert est[old]["step_time_s"] == est[CPU_PROFILE]["step_time_s"]
    (note,) = [n for n in est[measured]["notes"] if "processes per node share 2 CPU cores" in n]
    assert "each rank's own work x2.00, the real rank steps of dp2 tp2 pp2 measured" in note


def test_host_costs_scale_the_bound(cli, tmp_path):
    """Doubling the per-tensor optimizer cost of DTensors adds it once more for each DTensor a rank steps
    (gpt-3d's stages: 11 each, see the next test), x 8 ranks / 2 cores."""
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
    assert steps[1] - steps[0] == pytest.approx(11 * per_tensor * 8 / 2, rel=1e-6)


def test_parameter_tensors_and_which_are_dtensors():
    spec = spec_from_validated(validate(compose(["recipe=gpt-3d"])))
    first, last = (_param_tensors(spec, r) for r in pipeline_ranks(spec))
    # 2 GPT-2 layers of 12 tensors (5 TP-sliced; c_attn's fused bias stays whole) + wte (sliced) and wpe;
    # 2 layers + ln_f (2) + the tied head copy
    assert (len(first), sum(first)) == (26, 11)
    assert (len(last), sum(last)) == (27, 11)
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


def test_accelerators_never_consult_the_cpu_host_model(monkeypatch):
    """The CPU host model is estimate.py's alone and is skipped off CPU: a GPU layout's estimate runs with
    every entry point of cpu_host made to fail, and counts no process memory and no shared-core time."""
    import importlib

    from partrain.blueprint.planner.estimate import estimate

    # the package's `estimate` (the function) hides the module of the same name from `import ... as`
    estimate_module = importlib.import_module("partrain.blueprint.planner.estimate")

    def consulted(*_, **__):
        raise AssertionError("the CPU host model was consulted for an accelerator")

    for name in ("process_bytes", "process_note", "rank_step_factor", "shared_core_step", "shared_cores_note"):
        monkeypatch.setattr(estimate_module, name, consulted)
    est = estimate(validate(compose(["recipe=llama3-8b-h100"])))
    assert est["memory_bytes"]["process"] == 0 and est["time_breakdown_s"]["cpu_shared"] == 0


def test_every_note_the_planner_makes_has_words(tmp_path):
    """The planner's notes are data (planner/notes.py); report/notes.py has a sentence for every code."""
    from partrain.blueprint.planner.estimate import estimate
    from partrain.blueprint.report.notes import RENDERERS, note_texts

    comm = synthetic(tmp_path / "comm.json", LINKS, cpu_s=1e-3)
    cases = [
        ["recipe=gpt-3d", f"cluster.compute_profile={CPU_PROFILE}", f"cluster.comm_profile={comm}"],
        ["recipe=mixtral-ep", "parallel.moe_capacity_factor=1.25", "train.precision=bf16"],
        ["recipe=llama-long-sp", "cluster.device_memory_gib=0.5"],
        ["recipe=llama3-8b-h100", "train.param_dtype=16bit", "parallel.zero_stage=1"],
        ["recipe=gpt-dp", "train.precision=bf16", "parallel.zero_stage=3"],
        ["recipe=mixtral-ep", "model=deepseek-v3-tiny"],
    ]
    codes = set()
    for overrides in cases:
        for mixed in ("autocast", "zero"):
            est = estimate(validate(compose(overrides)), mixed=mixed)
            codes.update(n["code"] for n in est["note_data"])
            texts = note_texts(est)
            assert len(texts) == len(est["note_data"]) and all(t and ": {" not in t for t in texts)
    assert codes == set(RENDERERS)
