"""`partrain bench compute` for real on this CPU (a tiny Llama, seconds) and the planner reading its
profile through `cluster.compute_profile`; bad profiles and bad bench input exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from partrain.bench.compute import gemm_shapes
from partrain.blueprint.compute_profile import load_profile
from partrain.blueprint.config.compose import compose
from partrain.blueprint.planner.spec import spec_from_validated
from partrain.blueprint.validate import validate

ROOT = Path(__file__).resolve().parents[1]
H200 = Path(__file__).parent / "fixtures" / "gpu_h200_compute_profile.json"
TINY = ["model=llama-tiny", "train.seq_len=64", "train.micro_batch_size=2", "train.global_batch_size=8"]
LAYER_KEYS = {"arch", "hidden", "heads", "kv_heads", "ffn", "seq", "micro", "tp", "recompute", "layer_fwd_bwd_s"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One real `partrain bench compute` run (a separate interpreter, this checkout first on the path)."""
    out = tmp_path_factory.mktemp("bench-compute") / "tiny.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "partrain.cli", "bench", "compute", *TINY, "--iters", "5", "--out", str(out), "--json"]
    ran = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=out.parent)
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    return out, json.loads(ran.stdout)


def _estimate(cli, *args):
    ran = cli("plan", *args, "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    return json.loads(ran.stdout)["estimate"]


def test_profile_keys_and_shapes(bench):
    path, report = bench
    profile = load_profile(path)
    assert report == {"path": str(path), **profile}
    assert profile["format"] == "partrain-compute-profile" and profile["version"] == 1
    assert profile["device"]["type"] == "cpu" and profile["device"]["name"]
    assert profile["torch"] and profile["date"] and profile["dtype"] == "fp32"
    assert profile["hbm_bytes_per_s"] > 1e8 and profile["hbm_source"] == "measured"
    # exactly the matmuls the planner times for this run: each projection, its two backward
    # transposes and the head, at micro batch x seq tokens
    spec = spec_from_validated(validate(compose(TINY)))
    assert [(r["m"], r["k"], r["n"]) for r in profile["gemm"]] == gemm_shapes(spec)
    assert (128, 128, 128) in gemm_shapes(spec) and (128, 128, 256) in gemm_shapes(spec)  # q, gate/up at 2 x 64
    for r in profile["gemm"]:
        assert r["seconds"] > 0 and r["tflops"] == pytest.approx(2 * r["m"] * r["k"] * r["n"] / r["seconds"] / 1e12)
    (layer,) = profile["layers"]
    assert LAYER_KEYS <= set(layer)
    assert (layer["arch"], layer["hidden"], layer["heads"], layer["kv_heads"]) == ("llama", 128, 4, 2)
    assert (layer["seq"], layer["micro"], layer["ffn"]) == (64, 2, 256)
    assert layer["layer_fwd_bwd_s"] > 0
    # saved for backward: at least the fp32 q, k, v, the MLP's gate/up/act/product and the norms' inputs
    tokens = 2 * 64
    assert layer["layer_saved_bytes"] >= tokens * 4 * (128 + 2 * 64 + 4 * 256 + 2 * 128)


def test_plan_uses_the_profile_and_predicts_the_step(cli, bench):
    path, profile = bench
    est = _estimate(cli, *TINY, f"cluster.compute_profile={path}")
    nominal = _estimate(cli, *TINY)
    assert est["compute_source"] == f"profile:{path}" and nominal["compute_source"] == "nominal"
    assert any("compute timed from the profile" in n for n in est["notes"])
    model = est["assumptions"]["compute_model"]
    assert model["source"] == str(path) and model["device"] == "cpu" and model["dtype"] == "fp32"
    # One layer row: the host cost alone fits it exactly (0.0) when the matmul sweep's device time is below
    # the row. Measured beside two other test workers on 2 cores, the sweep and the layer can run under
    # different contention and the row then falls outside that fit: the grid fit was 1.09% off on a clean CI
    # run. The bound is the report's own: above 20% the plan warns that the profile is not reproduced.
    assert model["layer_fit_worst_error"] < 0.2
    # The saturating fit extrapolates past the largest measured shape, and on 2 shared cores the
    # small shapes' times are noisy: its peak was seen at 1.27x the best measured rate. A wrong fit
    # (units, a sign) would be off by orders of magnitude.
    assert model["gemm_peak_tflops"] <= 2.0 * max(r["tflops"] for r in profile["gemm"])
    # compute of a step = microbatches x (layers x the measured layer + head and embedding), and
    # the optimizer update on top
    layer_s = profile["layers"][0]["layer_fwd_bwd_s"]
    layers_s = spec_from_validated(validate(compose(TINY))).microbatches * 4 * layer_s
    tb = est["time_breakdown_s"]
    assert layers_s <= tb["compute"] <= 1.5 * layers_s
    assert tb["optimizer"] > 0 and est["step_time_s"] == pytest.approx(sum(tb.values()), rel=1e-9)
    assert est["tokens_per_s"] == pytest.approx(8 * 64 / est["step_time_s"])


@pytest.mark.parametrize("case", ["missing", "folder", "not-json", "gpu-profile", "bad-row"])
def test_bad_compute_profile_exits_2(cli, tmp_path, case):
    value = {"missing": str(tmp_path / "nope.json"), "folder": str(tmp_path), "gpu-profile": str(H200)}.get(case)
    if case == "not-json":
        value = str(tmp_path / "p.json")
        Path(value).write_text("[1, 2")
    if case == "bad-row":
        prof = json.loads(H200.read_text())
        prof.update(device={"type": "cpu", "name": "x"}, dtype="fp32")
        prof["gemm"][0]["seconds"] = -1
        value = str(tmp_path / "p.json")
        Path(value).write_text(json.dumps(prof))
    ran = cli("plan", *TINY, f"cluster.compute_profile={value}", "--json")
    assert ran.code == 2, ran.stdout + ran.stderr
    (err,) = json.loads(ran.stdout)["errors"]
    assert err["key"] == "cluster.compute_profile" and err["value"] == value
    rule = {
        "missing": "no such file",
        "folder": "is not a file",
        "not-json": "is not JSON",
        "gpu-profile": "was measured on cuda (NVIDIA H200), but the cluster's devices are cpu",
        "bad-row": "gemm[0].seconds = -1 is not a positive finite number",
    }[case]
    assert rule in err["rule"] and "partrain bench compute" in err["fix"]


@pytest.mark.parametrize(
    "args, key",
    [(["--iters", "0"], "--iters"), (["cluster.device=cuda", "cluster.backend=nccl"], "cluster.device")],
)
def test_bad_bench_input_exits_2(cli, args, key):
    ran = cli("bench", "compute", *TINY, *args, "--json")
    assert ran.code == 2, ran.stdout + ran.stderr
    assert json.loads(ran.stdout)["errors"][0]["key"] == key
    assert not ran.created() and not ran.spawned


def test_cpu_ranks_sharing_cores_compute_slower(cli, bench):
    """A CPU profile records its threads and the machine's cores; ranks that share cores (more
    processes than cores, as gpt-3d's 8 on 2 cores) compute proportionally slower."""
    from partrain.blueprint.planner.compute_model import ComputeModel

    model = ComputeModel(rates=None, hbm=1.0, device="cpu", constants=None, source="", threads=1, cores=2)
    assert model.cpu_sharing(2) == 1.0 and model.cpu_sharing(8) == 4.0 and model.cpu_sharing(1) == 0.5
    assert ComputeModel(None, 1.0, "cuda", None, "", threads=1, cores=2).cpu_sharing(8) == 1.0
    assert ComputeModel(None, 1.0, "cpu", None, "").cpu_sharing(8) == 1.0  # older profiles: no scaling
    path, profile = bench
    assert profile["cpu_cores"] >= 1 and profile["threads"] >= 1
    per_microbatch = {}
    for devices, batch in ((2, 8), (8, 16)):  # dp = devices, micro 2: one or two microbatches
        est = _estimate(
            cli,
            *TINY,
            f"cluster.devices_per_node={devices}",
            f"train.global_batch_size={batch}",
            f"cluster.compute_profile={path}",
        )
        per_microbatch[devices] = est["time_breakdown_s"]["compute"] / (batch // (devices * 2))
        # more ranks than cores: the report says the step is their CPU work over the cores (cpu_host.py)
        shared = [n for n in est["notes"] if "CPU cores: the step is at least their CPU work" in n]
        assert len(shared) == (devices > profile["cpu_cores"])
    fitted = ComputeModel(None, 1.0, "cpu", None, "", threads=profile["threads"], cores=profile["cpu_cores"])
    expected = fitted.cpu_sharing(8) / fitted.cpu_sharing(2)
    assert per_microbatch[8] / per_microbatch[2] == pytest.approx(expected, rel=1e-6)


def test_cpu_profile_measures_the_per_call_host_work(bench):
    """On CPU the bench times what planner/cpu_host.py charges ranks that share cores: the optimizer
    step and the gradient clip per parameter tensor, plain and DTensor, and what the TP wrappers add to
    a layer and to the embedding, head and loss. No order between plain and DTensor is asserted: since
    the optimizer steps DTensors' local shards the two differ by less than the machine's noise (a
    clean-clone CI run measured 35 us per DTensor against 44 us plain)."""
    _, profile = bench
    host = profile["host"]
    for key in ("optimizer_s_per_tensor", "clip_s_per_tensor"):
        assert 0 < host[key]["plain"] < 0.01 and 0 < host[key]["dtensor"] < 0.05
    assert 0 <= host["tp_layer_s"] < 1 and 0 <= host["tp_ends_s"] < 1


def test_cpu_profile_measures_the_node_s_real_rank_steps(bench):
    """On CPU the bench runs the node's real rank steps at once on the fake process group and keeps
    measurements only: the layout (as the planner's fields), and per rank its pipeline rank and CPU per step.
    The planner derives its factor from them at plan time (test_host_work.py)."""
    from partrain.bench.cpu.rank_steps import node_ranks
    from partrain.blueprint.compute_profile import RANK_STEPS_LAYOUT_KEYS

    _, profile = bench
    block = profile["host"]["rank_steps"]
    v = validate(compose(TINY))
    assert block["ranks"] == node_ranks(v) and len(block["ranks"]) == min(v.layout.world_size, 2)
    assert all(0 < s < 10 for s in block["measured_cpu_s"]) and block["pp_ranks"] == [0] * len(block["ranks"])
    assert "factor" not in block and "counted_cpu_s" not in block  # nothing the planner's formula computed
    spec = spec_from_validated(v)
    assert block["spec"] == {k: getattr(spec, k, v.run.cluster.devices_per_node) for k in RANK_STEPS_LAYOUT_KEYS}
    assert "micro 2 x seq 64" in block["layout"]


def test_pipeline_rank_steps_run_on_the_fake_process_group():
    """A pipeline's stages on the fake process group: every rank's 1F1B step runs (its sends and receives
    return at once) and takes CPU; layouts the fake group cannot stand in for say why."""
    from partrain.bench.cpu.rank_steps import measure_node, why_not

    pipeline = ["model=gpt2-tiny", "cluster.devices_per_node=2", "parallel.pp=2", "parallel.dp=1"]
    small = ["train.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=4"]
    v = validate(compose(pipeline + small))
    assert why_not(v, 1e6) is None
    measured, error = measure_node(v, 1)
    assert error == "" and sorted(measured) == [0, 1] and all(s > 0 for s in measured.values())
    assert "peers" in why_not(validate(compose(pipeline + small + ["train.precision=bf16"])), 1e6)
    assert "expert parallelism" in why_not(validate(compose(["recipe=mixtral-ep"])), 1e6)
    assert "free memory" in why_not(v, 1e15)


def test_cpu_profile_measures_what_a_worker_holds_beyond_tensors(cli, bench, tmp_path):
    """On a CPU the planner counts each rank's "process" term: the runtime's resident memory and the
    library code its steps page in, as the profile measured them (nominal without a profile), and the
    heap glibc keeps; on a GPU cluster the term is 0. A profile with a broken "process" block exits 2."""
    from partrain.blueprint.planner.cpu_host import (
        HEAP_FIXED_BYTES,
        HEAP_PER_TRANSIENT_BYTE,
        NOMINAL_CODE_BYTES,
        NOMINAL_RUNTIME_BYTES,
    )

    path, profile = bench
    process = profile["process"]
    # torch + transformers alone are well over 100 MiB resident; the kernels paged in are a fraction of that
    assert 100 * 2**20 < process["runtime_rss_bytes"] < 4 * 2**30
    assert 0 < process["code_rss_bytes"] < process["runtime_rss_bytes"] / 2
    measured = _estimate(cli, *TINY, f"cluster.compute_profile={path}")
    nominal = _estimate(cli, *TINY)
    want = process["runtime_rss_bytes"] + process["code_rss_bytes"]
    for est, expected, source in (
        (measured, want, f"measured by the compute profile {path}"),
        (nominal, NOMINAL_RUNTIME_BYTES + NOMINAL_CODE_BYTES, "nominal"),
    ):
        m = est["memory_bytes"]
        for stage in (m, *est["memory_bytes_per_stage"]):  # plus the heap glibc keeps (an empirical rule)
            heap = HEAP_FIXED_BYTES + HEAP_PER_TRANSIENT_BYTE * (stage["activations"] + stage["transient"])
            assert stage["process"] == pytest.approx(expected + heap, abs=2)
        assert m["total"] == sum(m[k] for k in ("params", "grads", "optimizer", "activations", "transient", "process"))
        assert any(n.startswith("process: ") and source in n for n in est["notes"])
    gpu = _estimate(cli, *TINY, "cluster=h100x8", "cluster.devices_per_node=1")
    assert gpu["memory_bytes"]["process"] == 0 and not any(n.startswith("process: ") for n in gpu["notes"])
    broken = dict(profile, process={"runtime_rss_bytes": 0, "code_rss_bytes": 1})
    broken.pop("path", None)
    bad = tmp_path / "broken.json"
    bad.write_text(json.dumps(broken))
    ran = cli("plan", *TINY, f"cluster.compute_profile={bad}", "--json")
    assert ran.code == 2, ran.stdout + ran.stderr
    (err,) = json.loads(ran.stdout)["errors"]
    assert err["key"] == "cluster.compute_profile" and "runtime_rss_bytes" in err["rule"]
