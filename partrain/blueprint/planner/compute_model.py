"""Compute time of a microbatch from a measured compute profile (`cluster.compute_profile`).

Without a profile the planner times compute as FLOPs / (peak x efficiency) (step_inputs.py). With
one, each decoder layer's forward and backward are timed from what the layer runs:

- matmuls: every projection at its (m, k, n) on the rank (m = the microbatch's tokens, k/n the
  widths sliced by TP), forward plus its two backward matmuls (input gradient m x n @ n x k, weight
  gradient k x m @ m x n), each at the time `GemmRates` interpolates from the profile's gemm rows;
- the attention core (SDPA): causal, so half the counted 4 s h FLOPs per token forward, 2.5 x that
  backward (flash attention recomputes the scores), at a fraction of the matmul peak fitted to the
  profile's layer rows (no row measures SDPA alone);
- elementwise and memory-bound work (norms, activations, rotary, residual adds, dropout, autocast's
  casts of inputs and weights, the weight-gradient casts and accumulation): counted bytes
  (`layer_work`) over the profile's bandwidth times an effective fraction fitted to the layer rows;
  backward moves twice the forward's elementwise bytes;
- host time: Python and kernel launches, a fitted cost per counted op (forward and backward apart).
  On CUDA the host runs ahead of the device, so a pass takes max(host, device); on a CPU the same
  cores do both, so host + device.

Full recompute adds a forward per layer, selective the attention core's forward. The last pipeline
rank adds the head's matmuls and the fp32 loss's bytes, the first the embedding's gradient, and every
step the optimizer's update over the rank's parameters (bytes at the fitted bandwidth).

The four constants (attention fraction, bandwidth fraction, host cost per op forward / backward) are
fitted per profile by minimising the worst relative error over its layer rows (`fit_constants`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from partrain.blueprint.compute_profile import GemmRates, gemm_rates, load_profile, profile_key
from partrain.blueprint.families import family


@dataclass(frozen=True)
class LayerShape:
    """One decoder layer as the compute model sees it (per rank, one microbatch)."""

    arch: str
    hidden: int
    q: int
    """Query width (heads x head_dim)."""
    kv: int
    """Key/value width (kv_heads x head_dim)."""
    ffn: int
    seq: int
    tokens: float
    """Tokens of the microbatch on this rank (after context parallel)."""
    tp: int = 1
    gated: bool = True
    activation: str = "silu"
    dropout: bool = False
    autocast: bool = True
    """fp32 weights under torch.autocast (partrain's 16-bit runtime for ZeRO 0/1)."""
    compute_bytes: int = 2
    experts: Tuple[int, int, int, int] = (0, 0, 0, 1)
    """(experts, top-k, shared expert width, ep) for a MoE layer; (0, 0, 0, 1) for a dense one."""
    fsdp: int = 0
    """ZeRO stage 2 or 3 (FSDP2: 16-bit parameters gathered per use), else 0."""


@dataclass(frozen=True)
class LayerWork:
    """What one layer's forward runs: matmul shapes, attention FLOPs, bytes and op counts."""

    gemms: Tuple[Tuple[float, float, float], ...]
    attn_flops: float
    """Forward FLOPs the causal attention kernel executes."""
    bytes_fwd: float
    bytes_bwd: float
    ops_fwd: float
    ops_bwd: float


def layer_gemms(s: LayerShape) -> List[Tuple[float, float, float]]:
    """(m, k, n) of each forward matmul of the layer on the rank."""
    T, h, t, f = s.tokens, s.hidden, s.tp, s.ffn
    if family(s.arch).block == "gpt2":
        return [(T, h, 3 * h / t), (T, h / t, h), (T, h, f / t), (T, f / t, h)]
    out = [(T, h, s.q / t), (T, h, s.kv / t), (T, h, s.kv / t), (T, s.q / t, h)]
    n_exp, top_k, shared, ep = s.experts
    if not n_exp:
        return out + [(T, h, f / t)] * (2 if s.gated else 1) + [(T, f / t, h)]
    local = max(1, n_exp // ep)
    m_e = T * top_k * ep / n_exp  # tokens each local expert receives on average
    out += [(T, h, n_exp)] + [(m_e, h, f), (m_e, h, f), (m_e, f, h)] * local
    if shared:
        out += [(T, h, shared), (T, h, shared), (T, shared, h)]
    return out


def layer_work(s: LayerShape) -> LayerWork:
    """Counted forward work of one layer (see the module docstring; bytes per op are HF's eager
    kernels: an op reading x and writing y moves |x| + |y|)."""
    T, h, t, c = s.tokens, s.hidden, s.tp, s.compute_bytes
    r = 4 if s.autocast or c == 4 else c  # residual stream dtype
    gemms = layer_gemms(s)
    weights = sum(k * n for m, k, n in gemms if m == T)  # dense weight elements (experts below)
    n_exp, top_k, shared, ep = s.experts
    if n_exp:
        weights += 3 * h * s.ffn * max(1, n_exp // ep)
    f = (s.ffn / t) if not n_exp else s.ffn * top_k + shared
    act_ops = 8 if s.activation == "gelu_new" else (2 if s.gated else 1)
    act_bytes = 18 * c * T * f if s.activation == "gelu_new" else 5 * c * T * f
    if family(s.arch).block == "gpt2":
        elem = 2 * 8 * T * h + 2 * (2 * r + c) * T * h + 8 * c * T * h / t  # layernorms, residuals, head split/merge
        ops = 2 + 2 + 4 + 2 + act_ops
        casts = 2
        if s.dropout:
            elem, ops = elem + 2 * (2 * c + 1) * T * h, ops + 4
    else:
        rotary = 9 * c * T * (s.q + s.kv) / t
        elem = 2 * 7 * 4 * T * h + 2 * (2 * r + c) * T * h + rotary + 2 * c * T * s.q / t  # RMSNorms in fp32
        ops = 12 + 2 + 10 + 1 + 1 + act_ops
        casts = 5
        if n_exp:  # router softmax / top-k, gathering and scattering each token's k copies
            elem += 4 * c * T * h * top_k
            ops += 6 + 6 * max(1, n_exp // ep)
    elem += act_bytes
    w_fwd = w_bwd = 0.0
    if s.autocast:
        elem += casts * (r + c) * T * h  # each projection casts its fp32 input
        ops += casts
        w_fwd, w_bwd = 6.0 * weights, 20.0 * weights  # fp32 -> 16-bit per forward; grad cast + accumulate
    elif s.fsdp:
        # FSDP2 mixed precision: copy-in cast and all-gather copy per gather (ZeRO 3 gathers again for
        # backward); gradients cast to fp32, reduce-scattered and accumulated into the shard
        w_fwd, w_bwd = 10.0 * weights, (10.0 if s.fsdp == 3 else 0.0) * weights + 28.0 * weights
    else:
        w_bwd = 3.0 * c * weights  # gradient accumulation
    ops += len(gemms) + 1 + (len(gemms) if s.autocast else 0)
    attn = 0.5 * 4.0 * T * s.seq * s.q / t
    return LayerWork(tuple(gemms), attn, elem + w_fwd, 2 * elem + w_bwd, ops, 2 * ops)


@dataclass(frozen=True)
class Constants:
    """The compute model's fitted constants (module docstring)."""

    attn_fraction: float = 0.5
    """SDPA's rate as a fraction of the fitted matmul peak."""
    bw_fraction: float = 0.7
    """Effective share of the profile's bandwidth that elementwise kernels reach."""
    host_fwd_s: float = 0.0
    """Host time per counted forward op."""
    host_bwd_s: float = 0.0
    """Host time per counted backward op."""


@dataclass(frozen=True)
class Parts:
    """Device and host seconds of one layer's forward and backward, before the constants' rates."""

    gemm_f: float
    gemm_b: float
    attn_flops: float
    bytes_f: float
    bytes_b: float
    ops_f: float
    ops_b: float


@dataclass(frozen=True)
class ComputeModel:
    """A profile's matmul rates, bandwidth and fitted constants."""

    rates: GemmRates
    hbm: float
    device: str
    constants: Constants
    source: str
    dtype: str = "bf16"
    threads: int = 0
    """CPU profiles: the threads the measuring process used (0: unknown, or a GPU)."""
    cores: int = 0
    """CPU profiles: the cores the measuring machine let the process use (0: unknown, or a GPU)."""

    def cpu_sharing(self, processes_per_node: int) -> float:
        """How much slower a CPU rank computes than the profile measured alone: the profile ran with
        `threads` threads on cores of its own, a rank gets `core_share` cores' worth. 1.0 on GPUs."""
        if self.device != "cpu" or not self.threads or not self.cores:
            return 1.0
        return self.threads / self.core_share(processes_per_node)

    def core_share(self, processes_per_node: int) -> float:
        """Cores' worth of CPU a CPU rank gets while it computes: partrain gives each of P processes
        max(1, cores // P) threads, and when P x threads exceed the cores they share them (also what a
        rank's computing costs the node's cores: cpu_host.py). 1.0 on GPUs."""
        if self.device != "cpu" or not self.cores:
            return 1.0
        p = max(1, processes_per_node)
        return min(max(1, self.cores // p), self.cores / p)

    def parts(self, w: LayerWork) -> Parts:
        t = self.rates.time
        gemm_f = sum(t(m, k, n) for m, k, n in w.gemms)
        gemm_b = sum(t(m, n, k) + t(k, m, n) for m, k, n in w.gemms)
        return Parts(gemm_f, gemm_b, w.attn_flops, w.bytes_fwd, w.bytes_bwd, w.ops_fwd, w.ops_bwd)

    def passes(self, p: Parts, c: Constants | None = None) -> Tuple[float, float]:
        """(forward, backward) seconds of a layer with these parts."""
        c = c or self.constants
        attn_rate = c.attn_fraction * self.rates.peak
        bw = c.bw_fraction * self.hbm
        dev_f = p.gemm_f + p.attn_flops / attn_rate + p.bytes_f / bw
        dev_b = p.gemm_b + 2.5 * p.attn_flops / attn_rate + p.bytes_b / bw
        host_f, host_b = p.ops_f * c.host_fwd_s, p.ops_b * c.host_bwd_s
        if self.device == "cuda":
            return max(dev_f, host_f), max(dev_b, host_b)
        return dev_f + host_f, dev_b + host_b

    def layer_time(self, shape: LayerShape, recompute: str = "none", share: float = 1.0) -> float:
        """Forward + backward seconds of one layer (+ the recomputed share of its forward)."""
        p = self.parts(layer_work(shape))
        fwd, bwd = self.passes(p)
        if recompute == "full":
            return fwd * (1 + share) + bwd
        if recompute == "selective":
            return fwd + bwd + share * p.attn_flops / (self.constants.attn_fraction * self.rates.peak)
        return fwd + bwd

    def bytes_time(self, nbytes: float) -> float:
        return nbytes / (self.constants.bw_fraction * self.hbm)


def shape_of_row(row: dict, compute_bytes: int = 2) -> LayerShape:
    """The LayerShape of a profile's layer row (HF default head_dim = hidden / heads)."""
    hd = row.get("head_dim") or row["hidden"] // row["heads"]
    gpt2 = family(row["arch"]).block == "gpt2"
    return LayerShape(
        arch=row["arch"],
        hidden=row["hidden"],
        q=row["heads"] * hd,
        kv=row["kv_heads"] * hd,
        ffn=row["ffn"],
        seq=row["seq"],
        tokens=row["seq"] * row["micro"],
        tp=row.get("tp", 1),
        gated=not gpt2,
        activation=row.get("activation", "gelu_new" if gpt2 else "silu"),
        dropout=bool(row.get("dropout", False)),
        autocast=bool(row.get("autocast", compute_bytes == 2)),
        compute_bytes=compute_bytes,
        experts=tuple(row.get("experts") or (0, 0, 0, 1)),
    )


def _score(model: ComputeModel, rows: Sequence[Tuple[Parts, str, float]], c: Constants) -> float:
    """Worst |log(predicted / measured)| plus a tenth of the mean, plus a pull towards the defaults
    that decides only when few rows leave the constants free."""
    errs = []
    for p, recompute, measured in rows:
        fwd, bwd = model.passes(p, c)
        pred = fwd * (2 if recompute == "full" else 1) + bwd
        errs.append(abs(math.log(pred / measured)))
    d = Constants()
    pull = abs(math.log(c.attn_fraction / d.attn_fraction)) + abs(math.log(c.bw_fraction / d.bw_fraction))
    return max(errs) + 0.1 * sum(errs) / len(errs) + 1e-3 * pull


_GRID = {
    "attn_fraction": [0.1, 0.2, 0.3, 0.45, 0.6, 0.75],
    "bw_fraction": [0.2, 0.35, 0.5, 0.7, 0.85, 1.0],
    "host_fwd_s": [0.0, 2e-6, 5e-6, 1e-5, 2e-5, 4e-5, 8e-5, 2e-4, 6e-4],
    "host_bwd_s": [0.0, 2e-6, 5e-6, 1e-5, 2e-5, 4e-5, 8e-5, 2e-4, 6e-4],
}
_LIMITS = {
    "attn_fraction": (0.02, 0.75),  # SDPA below the matmul peak: the rows hardly separate it from bytes
    "bw_fraction": (0.05, 1.0),
    "host_fwd_s": (0.0, 1e-2),
    "host_bwd_s": (0.0, 1e-2),
}


def fit_constants(model: ComputeModel, layer_rows: Sequence[dict]) -> Tuple[Constants, float]:
    """Constants minimising `_score` over the rows (a coarse grid, then coordinate steps that
    shrink; with fewer than four rows only the host cost, `_fit_host_only`); returns them and the
    worst relative error |predicted / measured - 1|."""
    cb = 4 if model.dtype == "fp32" else 2
    rows = [(model.parts(layer_work(shape_of_row(r, cb))), r["recompute"], r["layer_fwd_bwd_s"]) for r in layer_rows]
    best = _fit_host_only(model, rows) if len(rows) < 4 else None
    if best is None:
        best = _fit_all(model, rows)
    worst = 0.0
    for p, recompute, measured in rows:
        fwd, bwd = model.passes(p, best)
        worst = max(worst, abs((fwd * (2 if recompute == "full" else 1) + bwd) / measured - 1))
    return best, worst


def _predicted(model: ComputeModel, rows, c: Constants) -> List[float]:
    out = []
    for p, recompute, _ in rows:
        fwd, bwd = model.passes(p, c)
        out.append(fwd * (2 if recompute == "full" else 1) + bwd)
    return out


def _fit_host_only(model: ComputeModel, rows) -> Constants | None:
    """With one to three layer rows the four constants are not determined: keep the default
    attention and bandwidth fractions and fit one host cost per op (forward = backward) so the
    rows' mean log error is zero; None when the device time alone already exceeds the rows."""
    measured = [m for _, _, m in rows]

    def excess(h: float) -> float:
        pred = _predicted(model, rows, Constants(host_fwd_s=h, host_bwd_s=h))
        return sum(math.log(p / m) for p, m in zip(pred, measured))

    lo, hi = 0.0, _LIMITS["host_fwd_s"][1]
    if excess(lo) > 0 or excess(hi) < 0:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if excess(mid) < 0 else (lo, mid)
    return Constants(host_fwd_s=(lo + hi) / 2, host_bwd_s=(lo + hi) / 2)


def _fit_all(model: ComputeModel, rows) -> Constants:
    best, best_s = Constants(), math.inf
    g = _GRID
    for a in g["attn_fraction"]:
        for b in g["bw_fraction"]:
            for hf in g["host_fwd_s"]:
                for hb in g["host_bwd_s"]:
                    c = Constants(a, b, hf, hb)
                    s = _score(model, rows, c)
                    if s < best_s:
                        best, best_s = c, s
    step = 0.5
    for _ in range(40):
        improved = False
        for name in _GRID:
            for sign in (1, -1):
                value = getattr(best, name)
                new = value * (1 + sign * step) if value else (1e-6 if sign > 0 else 0.0)
                lo, hi = _LIMITS[name]
                c = Constants(**{**best.__dict__, name: min(hi, max(lo, new))})
                s = _score(model, rows, c)
                if s < best_s - 1e-12:
                    best, best_s, improved = c, s, True
        if not improved:
            step /= 2
            if step < 0.01:
                break
    return best


@functools.lru_cache(maxsize=16)
def _model(key: Tuple[str, int, int]) -> Tuple[ComputeModel, float]:
    return model_of_profile(load_profile(key[0]), key[0])


def model_of_profile(prof: dict, source: str) -> Tuple[ComputeModel, float]:
    """The fitted compute model of a (checked) profile dict and its worst layer-row error; `partrain
    bench compute` also uses it on the rows it has just measured (bench/cpu/host_costs.py)."""
    base = ComputeModel(
        rates=gemm_rates(prof["gemm"]),
        hbm=float(prof["hbm_bytes_per_s"]),
        device=prof["device"]["type"],
        constants=Constants(),
        source=source,
        dtype=prof["dtype"],
    )
    constants, worst = fit_constants(base, prof["layers"])
    cpu = (int(prof.get("threads") or 0), int(prof.get("cpu_cores") or 0)) if base.device == "cpu" else (0, 0)
    return ComputeModel(base.rates, base.hbm, base.device, constants, source, base.dtype, *cpu), worst


def compute_model(path: str) -> ComputeModel:
    """The fitted compute model of a profile file (cached while the file is unchanged)."""
    return _model(profile_key(path))[0]


def fit_report(path: str) -> Dict[str, float]:
    """The fitted constants and the worst layer-row error of a profile (for reports and tests)."""
    model, worst = _model(profile_key(path))
    rates = {"gemm_peak_flops": model.rates.peak, "gemm_t0_s": model.rates.t0}
    return {**model.constants.__dict__, **rates, "worst": worst}


def compute_assumptions(model: ComputeModel) -> Dict[str, object]:
    """The report's assumptions.compute_model: source, matmul fit, fitted constants, bandwidth."""
    return {
        "source": model.source,
        "dtype": model.dtype,
        "device": model.device,
        "gemm_peak_tflops": model.rates.peak / 1e12,
        "gemm_fixed_cost_s": model.rates.t0,
        "attention_fraction_of_gemm_peak": model.constants.attn_fraction,
        "bandwidth_bytes_per_s": model.hbm,
        "bandwidth_fraction": model.constants.bw_fraction,
        "host_s_per_op": {"forward": model.constants.host_fwd_s, "backward": model.constants.host_bwd_s},
        "layer_fit_worst_error": _model(profile_key(model.source))[1],
    }


def compute_figures(path: str) -> Dict[str, object]:
    """Where compute time comes from, as figures for the estimate's "compute_profile" note
    (`report.notes` words it): the profile, its matmul peak, fitted constants and worst layer-row error."""
    m, worst = _model(profile_key(path))
    c = m.constants
    return {
        "profile": path,
        "device": m.device,
        "dtype": m.dtype,
        "gemm_peak_flops": m.rates.peak,
        "attn_fraction": c.attn_fraction,
        "bw_fraction": c.bw_fraction,
        "bandwidth_bytes_per_s": m.hbm,
        "host_s_per_op": [c.host_fwd_s, c.host_bwd_s],
        "layer_fit_worst_error": worst,
    }
