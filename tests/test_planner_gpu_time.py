"""The planner's compute time against one H200's measurements (issue 15, item 2: time).

Fixtures: `fixtures/gpu_h200_calib.jsonl` is `shared/reference/gpu-h200/calib.jsonl` as measured
(bf16 GEMM rates by shape, one HF decoder layer's forward + backward time); the compute profile
`fixtures/gpu_h200_compute_profile.json` is made from it by `profile_from_calib`, so these checks go
through the same `cluster.compute_profile` path a user's `partrain bench compute` profile does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partrain.blueprint.compute_profile import gemm_rates, load_profile, profile_from_calib
from partrain.blueprint.planner.compute_model import compute_model, fit_report, shape_of_row

FIXTURES = Path(__file__).parent / "fixtures"
CALIB = FIXTURES / "gpu_h200_calib.jsonl"
PROFILE = FIXTURES / "gpu_h200_compute_profile.json"

LLAMA_886M = [
    "model=llama-tiny",
    "model.config.vocab_size=32000",
    "model.config.hidden_size=2048",
    "model.config.intermediate_size=5632",
    "model.config.num_hidden_layers=16",
    "model.config.num_attention_heads=16",
    "model.config.num_key_value_heads=8",
    "model.config.max_position_embeddings=2048",
    "cluster.nodes=1",
    "cluster.devices_per_node=1",
    "cluster.device=cuda",
    "cluster.backend=nccl",
    "cluster.device_memory_gib=139",
    "cluster.peak_tflops=989",
    "train.seq_len=2048",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
    "train.precision=bf16",
    "parallel.dp=1",
    "parallel.tp=1",
    "parallel.pp=1",
    "train.loss_chunk_tokens=0",  # measured before the chunked loss existed: the plain head
    "train.compile=false",  # and eagerly
]
MEASURED_886M = {"none": 56287, "full": 44646, "zero3": 48351}
"""tokens/s of partrain on one H200 (shared/reference/gpu-h200/README.md)."""


def _layer_rows():
    """The calibration's layer rows as the profile holds them (with the dropout / autocast facts)."""
    rows = load_profile(PROFILE)["layers"]
    measured = [json.loads(line) for line in CALIB.read_text().splitlines() if '"kind": "layer"' in line]
    assert [r["layer_fwd_bwd_s"] for r in rows] == [m["layer_fwd_bwd_s"] for m in measured]
    return rows


def test_fixture_profile_is_the_calibration_converted():
    made = profile_from_calib(CALIB.read_text().splitlines(), source=load_profile(PROFILE)["source"])
    assert made == json.loads(PROFILE.read_text())
    assert len(made["gemm"]) == 7 and len(made["layers"]) == 14


def test_gemm_rates_follow_the_measured_rows():
    rows = load_profile(PROFILE)["gemm"]
    rates = gemm_rates(rows)
    assert 700e12 < rates.peak < 900e12  # large bf16 matmuls on an H200 (README: ~790 TFLOP/s)
    for r in rows:
        assert rates.time(r["m"], r["k"], r["n"]) == pytest.approx(r["seconds"], rel=0.03)
    # between and beyond the rows: monotone in size, never above the fitted peak
    small, big = rates.time(4096, 2048, 2048), rates.time(32768, 8192, 8192)
    assert rates.time(8192, 2048, 2048) > small and 2 * 32768 * 8192 * 8192 / big < rates.peak


def test_every_layer_row_within_20_percent():
    model = compute_model(str(PROFILE))
    errors = []
    for r in _layer_rows():
        pred = model.layer_time(shape_of_row(r), r["recompute"])
        errors.append(pred / r["layer_fwd_bwd_s"] - 1)
        print(
            f"{r['arch']} h{r['hidden']} s{r['seq']} b{r['micro']} {r['recompute']}: "
            f"measured {r['layer_fwd_bwd_s'] * 1e3:.2f} ms, predicted {pred * 1e3:.2f} ms ({errors[-1]:+.1%})"
        )
        assert abs(errors[-1]) < 0.20, (r, pred)
    assert fit_report(str(PROFILE))["worst"] == pytest.approx(max(abs(e) for e in errors), rel=1e-6)


@pytest.mark.parametrize("variant", ["none", "full", "zero3"])
def test_886m_tokens_per_s_within_20_percent(cli, variant):
    extra = {"none": [], "full": ["parallel.recompute=full"], "zero3": ["parallel.zero_stage=3"]}[variant]
    prof = f"cluster.compute_profile={PROFILE}"
    res = cli("plan", *LLAMA_886M, *extra, prof, "--json")
    assert res.code == 0, res.stderr
    est = json.loads(res.stdout)["estimate"]
    assert est["compute_source"] == f"profile:{PROFILE}"
    assert est["tokens_per_s"] == pytest.approx(MEASURED_886M[variant], rel=0.20)
    assert est["time_breakdown_s"]["optimizer"] > 0
    assert any("compute timed from the profile" in n for n in est["notes"])
    assert est["assumptions"]["compute_model"]["layer_fit_worst_error"] < 0.20
    if variant == "none":  # the nominal path is unchanged (83,959 tokens/s predicted before the profile)
        nominal = json.loads(cli("plan", *LLAMA_886M, "--json").stdout)["estimate"]
        assert nominal["compute_source"] == "nominal"
        assert nominal["tokens_per_s"] == pytest.approx(83959, rel=0.001)
        assert nominal["time_breakdown_s"]["optimizer"] == 0.0


@pytest.mark.parametrize(
    "value, rule",
    [
        ("/nonexistent/profile.json", "no such file"),
        ("BADJSON", "is not JSON"),
        ("CPU", "was measured on cpu"),
        ("FP32", "measured fp32 matmuls, but train.precision is bf16"),
    ],
)
def test_bad_compute_profile_exits_2(cli, tmp_path, value, rule):
    if value == "BADJSON":
        value = str(tmp_path / "bad.json")
        Path(value).write_text("{not json")
    elif value in ("CPU", "FP32"):
        prof = json.loads(PROFILE.read_text())
        prof["device" if value == "CPU" else "dtype"] = {"type": "cpu", "name": "x"} if value == "CPU" else "fp32"
        value = str(tmp_path / "p.json")
        Path(value).write_text(json.dumps(prof))
    res = cli("plan", *LLAMA_886M, f"cluster.compute_profile={value}", "--json")
    assert res.code == 2, res.stderr
    err = json.loads(res.stdout)["errors"][0]
    assert err["key"] == "cluster.compute_profile" and err["value"] == value
    assert rule in err["rule"] and "partrain bench compute" in err["fix"]
