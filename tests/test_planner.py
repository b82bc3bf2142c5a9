"""The planner against the papers' published numbers, against partrain's real shards and saved
activations, and its search (validity, completeness, speed).

Paper numbers are from memory of the papers and are marked where they are recalled rather than
derived; each is a published figure the formula must land on within 1% (or within the rounding
of the printed table).
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.schema import (
    ClusterConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)
from partrain.blueprint.model_facts import model_facts
from partrain.blueprint.planner import (
    estimate,
    model_state_bytes_per_rank,
    param_count,
    param_tensors,
    search,
)
from partrain.blueprint.planner.bubble import (
    bubble_fraction,
    bubble_overhead,
    greedy_counts,
    in_flight,
)
from partrain.blueprint.planner.flops import (
    korthikanti_selective_hardware_flops,
    narayanan_flops,
    narayanan_params,
    narayanan_training_days,
    step_flops,
)
from partrain.blueprint.planner.memory import (
    korthikanti_first_stage_bytes,
    korthikanti_layer_bytes,
    layer_activations,
    zero_model_state_bytes,
)
from partrain.blueprint.planner.search import SearchSpace, enumerate_specs
from partrain.blueprint.planner.spec import (
    GB,
    GIB,
    ModelExtras,
    model_extras,
    spec_from_validated,
)
from partrain.blueprint.report.notes import note_texts
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
MODEL_FILES = sorted(glob.glob(str(ROOT / "conf" / "model" / "*.yaml")))


def _model_cfg(path: str) -> ModelConfig:
    data = yaml.safe_load(Path(path).read_text())
    return ModelConfig(arch=data["arch"], config=data["config"], name=data["name"])


# ---- exact parameter tensors -----------------------------------------------------------------------


@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: Path(p).stem)
def test_param_tensors_match_the_meta_built_hf_model(path):
    from partrain.models.build import build_meta_model

    cfg = _model_cfg(path)
    facts = model_facts(cfg.arch, cfg.config)
    extras = model_extras(cfg.arch, cfg.config, None, facts)
    model = build_meta_model(cfg)
    real = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert param_tensors(facts, extras) == real
    assert param_count(facts, extras) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("tied", [False, True])
def test_the_generic_paths_families_match_their_meta_built_hf_model(tied):
    """Every family of the generic path (families/generic.py), built from its own config class at its base's
    tiny sizes: the planner's tensors are transformers' exactly, tied head or not."""
    from partrain.blueprint.families.generic import GENERIC_BASES
    from partrain.models.build import build_meta_model

    for arch, base in GENERIC_BASES.items():
        tiny = "qwen2-tiny" if base == "qwen2" else "qwen3-tiny" if base == "qwen3" else f"{base}-tiny"
        sizes = yaml.safe_load((ROOT / "conf" / "model" / f"{tiny}.yaml").read_text())["config"]
        head_dim = sizes["hidden_size"] // sizes["num_attention_heads"]
        dims = {"head_dim": head_dim} if base != "olmo2" else {}  # Olmo2Config has no head_dim field
        cfg = ModelConfig(arch=arch, config={**sizes, **dims, "tie_word_embeddings": tied}, name=arch)
        facts = model_facts(cfg.arch, cfg.config)
        extras = model_extras(cfg.arch, cfg.config, None, facts)
        real = [(name, tuple(p.shape)) for name, p in build_meta_model(cfg).named_parameters()]
        assert param_tensors(facts, extras) == real, arch


QWEN_MOE_VARIANTS = {
    "qwen2-moe-tiny": {},
    # Qwen3-MoE: head_dim apart from hidden / heads (q_norm / k_norm follow it), biases on q/k/v and o.
    "qwen3-moe-tiny": {"head_dim": 32, "attention_bias": True},
}


@pytest.mark.parametrize("name", list(QWEN_MOE_VARIANTS))
def test_qwen_moe_dense_layers_are_counted_from_the_hf_config(name):
    from partrain.models.build import build_meta_model

    cfg = _model_cfg(str(ROOT / "conf" / "model" / f"{name}.yaml"))
    extra = QWEN_MOE_VARIANTS[name]
    cfg = dataclasses.replace(
        cfg, config={**cfg.config, "num_hidden_layers": 4, "mlp_only_layers": [1], "decoder_sparse_step": 1, **extra}
    )
    facts = model_facts(cfg.arch, cfg.config)
    extras = model_extras(cfg.arch, cfg.config, None, facts)
    real = [(n, tuple(p.shape)) for n, p in build_meta_model(cfg).named_parameters()]
    assert param_tensors(facts, extras) == real


# ---- ZeRO (Rajbhandari et al. 2019) -----------------------------------------------------------------

# Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB (GB = 10**9 bytes).
# Table 1 (recalled): per-device GB for DP degree 1/4/16/64/256/1024 and 7.5B / 128B / 1T parameters.
ZERO_TABLE1 = {
    (7.5e9, 1): (120, 120, 120),
    (7.5e9, 4): (52.5, 41.3, 30),
    (7.5e9, 16): (35.6, 21.6, 7.5),
    (7.5e9, 64): (31.4, 16.6, 1.88),
    (7.5e9, 256): (30.4, 15.4, 0.47),
    (7.5e9, 1024): (30.1, 15.1, 0.12),
    (128e9, 1): (2048, 2048, 2048),
    (128e9, 64): (536, 284, 32),
    (128e9, 1024): (513, 257, 2),
    (1e12, 1): (16000, 16000, 16000),
    (1e12, 64): (4187, 2218, 250),
    (1e12, 1024): (4011, 2013, 15.6),
}


def _printed_tolerance(value: float) -> float:
    """Relative half-unit of the last printed digit, at least 1% (1.9 stands for 1.85 .. 1.95)."""
    text = f"{value}"
    decimals = len(text.split(".")[1]) if "." in text else 0
    return max(0.01, 0.5 * 10**-decimals / value)


def test_zero_figure1_numbers():
    got = [zero_model_state_bytes(7.5e9, 64, stage) / GB for stage in (0, 1, 2, 3)]
    for value, published in zip(got, (120, 31.4, 16.6, 1.9)):
        assert value == pytest.approx(published, rel=_printed_tolerance(published))
    assert got[3] == pytest.approx(1.875)


@pytest.mark.parametrize("psi,nd", sorted(ZERO_TABLE1))
def test_zero_table1_numbers(psi, nd):
    for stage, published in zip((1, 2, 3), ZERO_TABLE1[(psi, nd)]):
        assert zero_model_state_bytes(psi, nd, stage) / GB == pytest.approx(
            published, rel=_printed_tolerance(published)
        )


def _gpt_run(
    h: int,
    a: int,
    layers: int,
    gpus: int,
    batch: int,
    tp: int = 1,
    pp: int = 1,
    zero: int = 0,
    recompute: str = "full",
    schedule: str = "1f1b",
    v: int = 1,
    micro: int = 1,
    peak: float = 312.0,
    intra: float = 300.0,
    inter: float = 25.0,
    memory: float = 80.0,
    devices_per_node: int = 8,
    precision: str = "bf16",
) -> RunConfig:
    """A Narayanan et al. style GPT (vocab 51200, sequence 2048) on an A100 cluster (Selene)."""
    model = ModelConfig(
        arch="gpt2",
        name=f"gpt-h{h}",
        config=dict(
            vocab_size=51200,
            n_positions=2048,
            n_embd=h,
            n_layer=layers,
            n_head=a,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        ),
    )
    cluster = ClusterConfig(
        name="a100",
        nodes=max(1, gpus // devices_per_node),
        devices_per_node=min(gpus, devices_per_node),
        device="cuda",
        backend="nccl",
        device_memory_gib=memory,
        peak_tflops=peak,
        intra_node_gbps=intra,
        inter_node_gbps=inter,
    )
    par = ParallelConfig(
        dp=gpus // (tp * pp),
        tp=tp,
        pp=pp,
        zero_stage=zero,
        recompute=recompute,
        pp_schedule=schedule,
        pp_virtual_stages=v,
    )
    return RunConfig(
        model=model,
        cluster=cluster,
        parallel=par,
        train=TrainConfig(seq_len=2048, micro_batch_size=micro, global_batch_size=batch, precision=precision),
    )


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_estimated_model_states_follow_zero_per_stage(zero):
    """A 7.5B GPT on 64 GPUs (dp 64): the estimate's states equal ZeRO's formula on the exact count
    (stage 2: FSDP2 keeps the gathered 16-bit parameters from forward to backward: counted as transient)."""
    v = validate(_gpt_run(4096, 32, 36, 64, 512, zero=zero))
    est = estimate(v, mixed="zero")  # ZeRO's 2 + 2 + 12 bytes per parameter
    m = est["memory_bytes"]
    states = m["params"] + m["grads"] + m["optimizer"]
    psi = est["params_total"]
    if zero == 2:
        states += 2 * psi * (1 - 1 / 64)  # gathered parameters (in the transient column, with small extras)
        assert m["transient"] >= 2 * psi * (1 - 1 / 64)
    assert states == pytest.approx(zero_model_state_bytes(psi, 64, zero), rel=0.001)


# ---- Korthikanti et al. 2022 ----------------------------------------------------------------------

# Table 3 (recalled): the four GPT configurations, sequence 2048, t = 8.
KORTHIKANTI_MODELS = {
    "22B": (6144, 64, 48, 1),
    "175B": (12288, 96, 96, 8),
    "530B": (20480, 128, 105, 35),
    "1T": (25600, 160, 128, 64),
}


def test_korthikanti_per_layer_formulas():
    s, b = 2048, 1
    for _name, (h, a, layers, p) in KORTHIKANTI_MODELS.items():
        sbh = s * b * h
        attn = 5 * a * s / h
        assert korthikanti_layer_bytes(s, b, h, a) == pytest.approx(sbh * (34 + attn))
        assert korthikanti_layer_bytes(s, b, h, a, t=8) == pytest.approx(sbh * (10 + 24 / 8 + attn / 8))
        assert korthikanti_layer_bytes(s, b, h, a, t=8, sequence_parallel=True) == pytest.approx(sbh / 8 * (34 + attn))
        assert korthikanti_layer_bytes(s, b, h, a, t=8, sequence_parallel=True, recompute="selective") == pytest.approx(
            sbh / 8 * 34
        )
        assert korthikanti_layer_bytes(s, b, h, a, t=8, recompute="selective") == pytest.approx(sbh * (10 + 24 / 8))
        assert korthikanti_layer_bytes(s, b, h, a, t=8, recompute="full") == pytest.approx(2 * sbh)
        # 1F1B: the first stage holds p microbatches of L/p layers = L layers' worth.
        assert korthikanti_first_stage_bytes(s, b, h, a, layers, 8, p, True) == pytest.approx(
            layers * sbh / 8 * (34 + attn)
        )


def test_korthikanti_published_ratios():
    """Section 4 (recalled): 5as/h = 80 for GPT-3 175B and 64 for MT-NLG 530B, so selective recompute
    saves 70% and 65% of the activation memory."""
    for (h, a), attn, saved in (((12288, 96), 80, 0.70), ((20480, 128), 64, 0.65)):
        assert 5 * a * 2048 / h == pytest.approx(attn)
        full = korthikanti_layer_bytes(2048, 1, h, a, 8, True)
        selective = korthikanti_layer_bytes(2048, 1, h, a, 8, True, "selective")
        assert 1 - selective / full == pytest.approx(saved, abs=0.005)


# Table 3 + Table 5 (recalled): heads, hidden, layers, GPUs, global batch; iteration time (s) with full
# recompute and with sequence parallelism + selective recompute ("present work"), MFU and HFU of the
# latter (%), throughput increase (%). A100 peak 312 TFLOP/s, s = 2048, V = 51200.
KORTHIKANTI_TABLE5 = {
    "22B": (64, 6144, 48, 8, 4, 1.42, 1.10, 41.5, 43.7, 29.0),
    "175B": (96, 12288, 96, 64, 64, 18.13, 13.75, 51.4, 52.8, 31.8),
    "530B": (128, 20480, 105, 280, 280, 49.05, 37.83, 56.0, 57.0, 29.7),
    "1T": (160, 25600, 128, 512, 512, 94.42, 71.49, 56.3, 57.0, 32.1),
}


@pytest.mark.parametrize("name", list(KORTHIKANTI_TABLE5))
def test_korthikanti_table5_utilization_from_published_times(name):
    """The counted model FLOPs of each configuration, over its published iteration time, GPU count
    and A100 peak, give the published MFU within 1%; the paper's HFU formula its HFU."""
    a, h, l, gpus, B, t_full, t_present, mfu, hfu, gain = KORTHIKANTI_TABLE5[name]
    facts = model_facts("gpt2", dict(n_embd=h, n_head=a, n_layer=l, vocab_size=51200, n_positions=2048))
    flops = step_flops(facts, None, B, 2048, "selective")
    peak = gpus * 312e12
    assert flops["model"] / (t_present * peak) * 100 == pytest.approx(mfu, rel=0.01)
    assert korthikanti_selective_hardware_flops(B, 2048, l, h, 51200) / (t_present * peak) * 100 == pytest.approx(
        hfu, rel=0.01
    )
    assert (t_full / t_present - 1) * 100 == pytest.approx(gain, abs=0.15)
    # partrain counts only the recomputed attention-core forward: a third of the paper's extra.
    paper_extra = korthikanti_selective_hardware_flops(B, 2048, l, h, 51200) - flops["model"]
    assert flops["hardware"] - flops["model"] == pytest.approx(paper_extra / 3, rel=1e-9)


def test_in_flight_microbatches_give_korthikanti_interleaving_factor():
    for p, v, m in ((4, 2, 16), (8, 4, 64), (16, 2, 128)):
        assert in_flight("1f1b", p, 1, m, 0) == p  # the first 1F1B stage holds p microbatches
        assert in_flight("gpipe", p, 1, m, 0) == m
        layers_worth = in_flight("interleaved-1f1b", p, v, m, 0) * (1 / (p * v))  # chunk = L/(pv) layers
        assert layers_worth == pytest.approx(1 + (p - 1) / (p * v))


def _gpt_paper_spec(t: int):
    run = _gpt_run(12288, 96, 96, 64, 64, tp=t, pp=64 // t // 8 if t < 8 else 8)
    spec = spec_from_validated(validate(run), mixed="zero")  # the paper's 16-bit accounting
    # Korthikanti's assumptions: fused GeLU (keeps its input), dropout after attention and MLP and on
    # the attention probabilities, the s x s scores stored (no fused attention), 16-bit activations.
    extras = ModelExtras(
        activation="gelu", resid_dropout=True, attn_dropout=True, attn_impl="eager", out_bias=True, mlp_bias=True
    )
    return dataclasses.replace(spec, extras=extras)


@pytest.mark.parametrize("t", [1, 8])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_counted_gpt_layer_reduces_to_korthikanti(t, recompute):
    spec = _gpt_paper_spec(t)
    s, h, a = 2048, 12288, 96
    counted = layer_activations(spec, False, s, s).per_rank(t, False, recompute)
    paper = korthikanti_layer_bytes(s, 1, h, a, t, False, recompute)
    stats = s * (4 * 4 + (0 if recompute == "selective" else 0))  # layer-norm mean/rstd the paper neglects
    assert counted - stats == pytest.approx(paper, rel=1e-9)


# ---- Narayanan et al. 2021 -------------------------------------------------------------------------

# Table 1 (recalled): params (B), heads, hidden, layers, t, p, GPUs, batch, achieved TFLOP/s per GPU.
NARAYANAN_TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


@pytest.mark.parametrize("row", NARAYANAN_TABLE1, ids=lambda r: f"{r[0]}B")
def test_narayanan_parameter_counts(row):
    P, a, h, l = row[:4]
    assert narayanan_params(l, h, 51200, 2048) / 1e9 == pytest.approx(P, rel=_printed_tolerance(P))
    facts = model_facts("gpt2", dict(n_embd=h, n_head=a, n_layer=l, vocab_size=51200, n_positions=2048))
    # The exact HF count adds the final layer norm (2h) to the formula.
    assert param_count(facts) == pytest.approx(narayanan_params(l, h, 51200, 2048) + 2 * h, rel=1e-12)


@pytest.mark.parametrize("row", NARAYANAN_TABLE1, ids=lambda r: f"{r[0]}B")
def test_narayanan_flops_formula_equals_counted_flops(row):
    _, a, h, l, _, _, _, B, _ = row
    facts = model_facts("gpt2", dict(n_embd=h, n_head=a, n_layer=l, vocab_size=51200, n_positions=2048))
    full = step_flops(facts, None, B, 2048, "full")
    none = step_flops(facts, None, B, 2048, "none")
    assert full["hardware"] == pytest.approx(narayanan_flops(B, 2048, l, h, 51200, recompute=True), rel=1e-12)
    assert none["hardware"] == pytest.approx(narayanan_flops(B, 2048, l, h, 51200, recompute=False), rel=1e-12)
    assert full["model"] == none["model"]


def test_narayanan_training_time_estimates():
    """Section 5.1: GPT-3 175B on 300B tokens, 1024 GPUs at 140 TFLOP/s: 34 days; the 1T model on
    450B tokens, 3072 GPUs at 163 TFLOP/s: 84 days."""
    assert narayanan_training_days(300e9, 175e9, 1024, 140e12) == pytest.approx(34, rel=0.01)
    assert narayanan_training_days(450e9, 1e12, 3072, 163e12) == pytest.approx(84, rel=0.01)


def test_bubble_formulas():
    for p, m, v in ((8, 32, 2), (4, 4, 4), (64, 512, 2)):
        assert bubble_fraction("gpipe", p, 1, m) == pytest.approx((p - 1) / (m + p - 1))  # GPipe: (K-1)/(M+K-1)
        assert bubble_fraction("1f1b", p, 1, m) == pytest.approx((p - 1) / (m + p - 1))
        assert bubble_overhead("1f1b", p, 1, m) == pytest.approx((p - 1) / m)  # Narayanan et al.
        assert bubble_overhead("interleaved-1f1b", p, v, m) == pytest.approx((p - 1) / (v * m))
        assert bubble_fraction("interleaved-1f1b", p, v, m) == pytest.approx((p - 1) / (v * m + p - 1))


NARAYANAN_SPACE = SearchSpace(zero_stages=(0,), recompute=("full",), sequence_parallel=(False,))
"""What Megatron-LM offered in 2021: no ZeRO, full recompute, no sequence parallelism."""


@pytest.mark.parametrize("row", NARAYANAN_TABLE1, ids=lambda r: f"{r[0]}B")
def test_narayanan_published_layout_fits_and_search_agrees(row):
    """Their layout (t, p, d, batch; micro batch 1, 1F1B, full recompute) fits; the search over the same
    techniques finds nothing more than 10% faster; the predicted throughput is within 20% of the
    achieved TFLOP/s they report (Megatron-LM 2021 reduced gradients after the backward pass)."""
    P, a, h, l, t, p, n, B, achieved = row
    v = validate(_gpt_run(h, a, l, n, B, tp=t, pp=p))
    est = estimate(v, dp_overlap=False)
    assert est["fits"]
    predicted = est["hardware_flops_per_step"] / est["step_time_s"] / n / 1e12
    assert predicted == pytest.approx(achieved, rel=0.20)
    best = search(v, top_k=1, space=NARAYANAN_SPACE, dp_overlap=False)[0]
    assert best["estimate"]["step_time_s"] <= est["step_time_s"] * (1 + 1e-9)
    assert best["estimate"]["step_time_s"] >= 0.9 * est["step_time_s"], best["layout"]


def test_search_1t_gpt_on_4096_h100_fits():
    # Its speed is measured by benchmarks/search_speed.py (target < 2 s), not timed here.
    v = validate(_gpt_run(25600, 160, 128, 4096, 3072, tp=8, pp=64, peak=989.0, intra=450.0, inter=50.0, memory=79.6))
    found = search(v, top_k=10)
    assert found and found[0]["estimate"]["fits"]
    assert found[0]["estimate"]["memory_bytes"]["total"] <= 79.6 * GIB
    times = [c["estimate"]["step_time_s"] for c in found]
    assert all(
        later >= earlier * (1 - 1e-4) for earlier, later in zip(times, times[1:])
    )  # best first (near-ties reordered)
    assert all(c["why"] for c in found)


def test_estimate_of_a_1t_layout_is_complete():
    # Its speed is measured by benchmarks/search_speed.py (target < 0.5 s), not timed here.
    v = validate(_gpt_run(25600, 160, 128, 4096, 3072, tp=8, pp=64, peak=989.0, intra=450.0, inter=50.0))
    est = estimate(v)
    assert est["step_time_s"] > 0 and est["memory_bytes"]["total"] > 0


# ---- the search's candidates are exactly the valid layouts ----------------------------------------


def _tiny_run(model: str = "gpt2-tiny", devices: int = 8, batch: int = 8) -> RunConfig:
    return compose(
        [
            f"model={model}",
            "cluster=local-cpu",
            f"cluster.devices_per_node={devices}",
            "parallel.dp=-1",
            f"train.global_batch_size={batch}",
            "train.micro_batch_size=1",
            "train.seq_len=64",
        ]
    )


@pytest.mark.parametrize("model,devices", [("gpt2-tiny", 8), ("mixtral-tiny", 4)])
def test_search_enumerates_exactly_the_valid_layouts(model, devices):
    run = _tiny_run(model, devices)
    v = validate(run)
    base = spec_from_validated(v)
    space = SearchSpace(zero_stages=(0,), recompute=("none",))
    got = {(s.tp, s.pp, s.dp, s.ep, s.mbs, s.schedule, s.v, s.tp_sp) for s, _ in enumerate_specs(base, space)}
    expected = set()
    eps = (1, 2, 4) if v.facts.is_moe else (1,)
    for tp, pp, mbs, ep, sched, vv, tp_sp in itertools.product(
        (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8), eps, ("1f1b", "interleaved-1f1b"), (1, 2, 4, 8, 16), (False, True)
    ):
        if (
            devices % (tp * pp)
            or (pp == 1 and (sched != "1f1b" or vv != 1))
            or (sched == "1f1b" and vv != 1)
            or (sched != "1f1b" and vv == 1)
            or (tp_sp and tp == 1)
        ):
            continue
        dp = devices // (tp * pp)
        par = dataclasses.replace(
            run.parallel,
            tp=tp,
            pp=pp,
            dp=dp,
            ep=ep,
            pp_schedule=sched,
            pp_virtual_stages=vv,
            tp_sequence_parallel=tp_sp,
        )
        try:
            validate(dataclasses.replace(run, parallel=par, train=dataclasses.replace(run.train, micro_batch_size=mbs)))
        except ConfigError:
            continue
        expected.add((tp, pp, dp, ep, mbs, sched if pp > 1 else "1f1b", vv, tp_sp))
    assert got == expected


def test_search_candidates_validate_and_carry_overrides():
    v = validate(compose(["recipe=gpt-3d"]))
    found = search(v, top_k=5)
    assert len(found) == 5
    for c in found:
        run = compose(["recipe=gpt-3d", *c["overrides"]])
        again = validate(run)
        assert estimate(again)["step_time_s"] == pytest.approx(c["estimate"]["step_time_s"])
        assert set(c) >= {"rank", "layout", "overrides", "estimate", "why", "unsupported", "search"}


# ---- exact model states vs partrain's real shards --------------------------------------------------

SHARD_CASES = [
    ["recipe=llama-fsdp-tp"],
    ["recipe=llama-fsdp-tp", "parallel.zero_stage=2"],
    [
        "recipe=gpt-dp",
        "cluster.devices_per_node=8",
        "parallel.dp=-1",
        "parallel.tp=2",
        "parallel.zero_stage=3",
        "train.global_batch_size=32",
    ],
    [
        "model=mixtral-tiny",
        "cluster.devices_per_node=4",
        "parallel.tp=2",
        "parallel.zero_stage=3",
        "train.global_batch_size=8",
    ],
    [
        "model=qwen2-moe-tiny",
        "cluster.devices_per_node=8",
        "parallel.tp=2",
        "parallel.dp=4",
        "parallel.dp_shard=2",
        "parallel.zero_stage=3",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
    ],
    # Qwen3-MoE: q_norm / k_norm replicated over tp, experts split over ep
    [
        "model=qwen3-moe-tiny",
        "cluster.devices_per_node=4",
        "parallel.tp=2",
        "parallel.dp=2",
        "parallel.ep=2",
        "train.global_batch_size=8",
    ],
    # hidden 132 over 8 ranks: uneven FSDP shards (torch.chunk leaves the last rank short)
    [
        "model=gpt2-tiny",
        "cluster.devices_per_node=8",
        "parallel.dp=8",
        "parallel.zero_stage=3",
        "model.config.n_embd=132",
        "train.global_batch_size=8",
        "train.micro_batch_size=1",
    ],
]


def test_parameter_shards_match_tp_and_fsdp_on_the_fake_process_group():
    """Every rank of each layout, built by the real wrappers under the fake process group."""
    from partrain.simulate.fake_world import simulate

    for overrides in SHARD_CASES:
        v = validate(compose(overrides))
        sim = simulate(v, range(v.world_size))
        measured = [r.simulated["param_elements"] for r in sim.ranks]
        predicted = [r.analytic["param_elements"] for r in sim.ranks]
        assert predicted == measured, overrides


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_model_state_bytes_per_rank_fp32(zero):
    """fp32 Adam: 16 bytes per parameter at zero 0; zero 1 shards Adam's 8 bytes per group in equal
    slices; zero 2/3 shard everything (FSDP2 rows)."""
    v = validate(compose(["recipe=gpt-dp", f"parallel.zero_stage={zero}"]))
    n = param_count(v.facts)
    got = model_state_bytes_per_rank(v)
    assert len(got) == 2
    ideal = {0: 16 * n, 1: 8 * n + 8 * n / 2, 2: 16 * n / 2, 3: 16 * n / 2}[zero]
    assert all(g == pytest.approx(ideal, rel=0.01) for g in got)


# ---- activations vs saved-tensor hooks ---------------------------------------------------------------

ACTIVATION_CASES = [
    (m, p, r)
    for m in (
        "gpt2-tiny",
        "llama-tiny",
        "qwen2-tiny",
        "qwen3-tiny",
        "smollm3-tiny",
        "granite-tiny",
        "gemma3-tiny",
        "mixtral-tiny",
        "qwen2-moe-tiny",
        "qwen3-moe-tiny",
    )
    for p in ("fp32", "bf16")
    for r in ("none", "full")
]


@pytest.mark.parametrize("name,precision,recompute", ACTIVATION_CASES)
def test_activation_bytes_match_saved_tensor_hooks(name, precision, recompute):
    from partrain.simulate.measure import model_config, saved_activation_bytes

    cfg = model_config(name)
    run = compose(
        [
            f"model={name}",
            "cluster=local-cpu",
            "cluster.devices_per_node=1",
            "parallel.dp=1",
            "train.seq_len=64",
            "train.micro_batch_size=2",
            "train.global_batch_size=2",
            f"train.precision={precision}",
            f"parallel.recompute={recompute}",
        ]
    )
    v = validate(run)
    est = estimate(v, mixed="autocast")
    measured = saved_activation_bytes(cfg, 2, 64, precision, recompute)
    predicted = est["memory_bytes"]["activations"]
    tolerance = (
        0.01 if recompute == "none" else 0.10
    )  # full: rotary cos/sin live in the checkpoint's closure, unseen by hooks
    tolerance = max(tolerance, APPROXIMATE_ACTIVATIONS.get(name, 0.0))
    assert predicted == pytest.approx(measured, rel=tolerance)


APPROXIMATE_ACTIVATIONS = {"gemma3-tiny": 0.10}
"""Models whose counted activations are known to be short of what the hooks see, with the bound held.
Gemma 3 without recompute: 4.0% (fp32) and 5.6% (bf16) short after counting its four residual-stream
norms (the two norms Gemma 3 adds to a layer match the hooks to the byte); what the whole model saves
beyond that is not found yet (its local layers' window masks, its scaled embedding: candidates)."""


# ---- the JSON contract and purity -------------------------------------------------------------------


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")))
def test_estimate_json_contract(recipe):
    v = validate(compose([f"recipe={recipe}"]))
    est = estimate(v)
    json.dumps(est)
    assert isinstance(est["params_total"], int) and est["params_total"] == param_count(
        v.facts, spec_from_validated(v).extras
    )
    assert set(est["memory_bytes"]) >= {"params", "grads", "optimizer", "activations", "total"}
    assert all(isinstance(x, int) for x in est["memory_bytes"].values())
    m = est["memory_bytes"]
    assert m["total"] == pytest.approx(
        m["params"] + m["grads"] + m["optimizer"] + m["activations"] + m["transient"] + m["process"], abs=8
    )
    assert set(est["comm_bytes_per_step"]) == {"tp", "dp", "pp", "ep", "sp"}
    for key in ("flops_per_step", "pipeline_bubble_fraction", "step_time_s", "tokens_per_s", "mfu"):
        assert isinstance(est[key], float) and est[key] >= 0
    assert isinstance(est["fits"], bool)
    assert 0 <= est["pipeline_bubble_fraction"] < 1 and 0 < est["mfu"] < 1
    assert "GiB" in note_texts(est)[0] and "GiB" in est["assumptions"]["units"]
    assert [n["code"] for n in est["note_data"]][:1] == ["memory"]  # the planner's notes are data (report/notes.py)


def test_planner_does_not_import_torch():
    code = (
        "import sys, partrain.blueprint.planner as p; from partrain.blueprint.config.compose import compose; from "
        "partrain.blueprint.validate import validate; "
        "v = validate(compose(['recipe=gpt3-175b-h100'])); p.estimate(v); p.search(v, top_k=2); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_greedy_stage_split_equals_the_runtime_split():
    from partrain.blueprint.stage_split import split_layers

    rng = random.Random(0)
    for _ in range(400):
        layers = rng.randint(1, 40)
        chunks = rng.randint(1, layers)
        embed, head = (
            rng.choice([0.0, rng.random(), 3 * rng.random()]),
            rng.choice([0.0, rng.random(), 3 * rng.random()]),
        )
        assert greedy_counts(layers, chunks, embed, head) == [
            len(r) for r in split_layers(layers, chunks, embed_cost=embed, head_cost=head)
        ]
