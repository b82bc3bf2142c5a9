"""The compute profile: a JSON file `partrain bench compute` writes and the planner reads.

Pure Python (no torch): the planner and the config validator load profiles, and `partrain plan`
must stay fast and torch-free. The planner's use of it (the layer time model fitted to the layer
rows) is `partrain.blueprint.planner.compute_model`; this module reads, checks and converts files and
turns the matmul rows into a rate by shape (`GemmRates`).

Format (version 1; seconds, bytes, FLOP/s)::

    {
      "format": "partrain-compute-profile", "version": 1,
      "device": {"type": "cuda", "name": "NVIDIA H200"},
      "torch": "2.11.0+cu130", "hostname": "...", "date": "2026-11-30T12:00:00+00:00",
      "dtype": "bf16",                     # the matmul / autocast dtype measured (train.precision)
      "hbm_bytes_per_s": 4.8e12,           # elementwise bandwidth of one device
      "hbm_source": "measured",            # or "nominal" (a datasheet figure)
      "gemm": [{"m", "k", "n", "seconds", "tflops"}, ...],       # m x k @ k x n, median seconds
      "layers": [{"arch", "hidden", "heads", "kv_heads", "ffn", "seq", "micro", "tp", "recompute",
                  "activation", "dropout", "autocast", "layer_fwd_bwd_s", "layer_saved_bytes"}, ...],
      "source": "what produced it (bench compute, or the calibration file converted)",
      "process": {"runtime_rss_bytes", "code_rss_bytes"},  # CPU only, optional (below)
      "host": {"optimizer_s_per_tensor": {"plain", "dtensor"},  # CPU only, optional (below)
               "clip_s_per_tensor": {"plain", "dtensor"}, "tp_layer_s", "tp_ends_s",
               "rank_steps": {"layout", "spec", "ranks", "pp_ranks", "measured_cpu_s"}}  # optional
    }

`gemm` rows are what the planner interpolates matmul rates from; `layers` rows (one decoder layer's
forward + backward time, with its shape) are what it fits the rest of its compute model to (attention
kernel rate, effective bandwidth, per-op host overhead). `process` (CPU profiles) is what a training
process holds beyond its tensors: the resident memory of the runtime once imported (interpreter, torch,
transformers with the model's module, partrain) and the library code its first steps page in
(planner/cpu_host.py); a profile without it gets the planner's nominal figures. `host` (CPU
profiles) is per-call CPU work besides kernels: seconds per parameter tensor of the optimizer's step
and of the gradient clip, for plain tensors and DTensors, and the seconds partrain's tensor-parallel
wrappers add to one layer's forward + backward (`tp_layer_s`) and to the rest of a microbatch, embedding,
head and loss (`tp_ends_s`; both absent when not measured); the planner
charges it to ranks that share cores (planner/cpu_host.py), and counts none without it. `host.rank_steps`
is the profiled layout's real rank steps, all of a node's ranks at once on the fake process group
(bench/cpu/rank_steps.py): the layout ("spec": its RANK_STEPS_LAYOUT_KEYS), and per rank its pipeline
rank and the CPU seconds a step took. Measurements only: the planner compares them with what it counts
for that layout at plan time (a block from before "spec" existed is ignored).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional, Sequence, Tuple

from partrain.blueprint.families import family
from partrain.blueprint.json_file import load_checked_json

FORMAT = "partrain-compute-profile"
VERSION = 1
DTYPES = ("fp32", "bf16", "fp16")
H200_HBM_BYTES_PER_S = 4.8e12
"""NVIDIA H200's datasheet HBM3e bandwidth (4.8 TB/s), for converting calibration data that has no
bandwidth measurement (`profile_from_calib`)."""
RANK_STEPS_LAYOUT_KEYS = (
    *("tp", "pp", "dp", "sp", "ep", "zero_stage", "recompute", "schedule", "v", "tp_sp", "mbs", "global_batch"),
    "devices_per_node",
)
"""The fields of "host.rank_steps.spec": the profiled layout as the planner's PlanSpec (and ClusterSpec) names them."""
LAYER_KEYS = ("arch", "hidden", "heads", "kv_heads", "ffn", "seq", "micro", "recompute", "layer_fwd_bwd_s")
GEMM_KEYS = ("m", "k", "n", "seconds")


class ComputeProfileError(ValueError):
    """A compute profile that cannot be used; the message is the rule it breaks, in plain words."""


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def check_profile(data) -> dict:
    """The profile if this partrain can use it; ComputeProfileError (the broken rule) otherwise."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ComputeProfileError(f'is not a partrain compute profile (no "format": "{FORMAT}")')
    if data.get("version") != VERSION:
        raise ComputeProfileError(f"has format version {data.get('version')!r}; this partrain reads version {VERSION}")
    device = data.get("device")
    if not isinstance(device, dict) or device.get("type") not in ("cpu", "cuda"):
        raise ComputeProfileError('lacks the device it was measured on ("device": {"type": "cpu" or "cuda", "name"})')
    if data.get("dtype") not in DTYPES:
        raise ComputeProfileError(f"has dtype {data.get('dtype')!r}, not one of {', '.join(DTYPES)}")
    if not _positive(data.get("hbm_bytes_per_s")):
        raise ComputeProfileError("lacks a positive hbm_bytes_per_s (elementwise bandwidth)")
    for name, keys in (("gemm", GEMM_KEYS), ("layers", LAYER_KEYS)):
        rows = data.get(name)
        if not isinstance(rows, list) or not rows:
            raise ComputeProfileError(f'has no "{name}" measurements')
        for i, row in enumerate(rows):
            missing = [k for k in keys if not isinstance(row, dict) or k not in row]
            if missing:
                raise ComputeProfileError(f"{name}[{i}] lacks {', '.join(missing)}")
            bad = [k for k in keys if k not in ("arch", "recompute") and not _positive(row[k])]
            if bad:
                raise ComputeProfileError(f"{name}[{i}].{bad[0]} = {row[bad[0]]!r} is not a positive finite number")
    process = data.get("process")
    if process is not None:
        keys = ("runtime_rss_bytes", "code_rss_bytes")
        if not isinstance(process, dict) or not all(_positive(process.get(k)) for k in keys):
            raise ComputeProfileError(f'has a "process" block without positive {" and ".join(keys)}')
    _check_host(data.get("host"))
    return data


def _check_host(host) -> None:
    if host is None:
        return
    ok = isinstance(host, dict)
    for key in ("optimizer_s_per_tensor", "clip_s_per_tensor"):
        table = host.get(key) if ok else None
        ok = ok and isinstance(table, dict) and all(_positive(table.get(k)) for k in ("plain", "dtensor"))
    for key in ("tp_layer_s", "tp_ends_s"):
        value = host.get(key, 0.0) if ok else None
        ok = ok and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and value >= 0
    if not ok:
        raise ComputeProfileError(
            'has a "host" block without positive optimizer_s_per_tensor and clip_s_per_tensor (plain and dtensor) '
            "or with a tp_layer_s or tp_ends_s that is not a finite number >= 0"
        )
    steps = host.get("rank_steps")
    if steps is not None and not _rank_steps_ok(steps):
        raise ComputeProfileError(
            'has a "host.rank_steps" block without positive finite "measured_cpu_s" (one per rank in "pp_ranks")'
        )


def _rank_steps_ok(steps) -> bool:
    if not isinstance(steps, dict) or not isinstance(steps.get("measured_cpu_s"), list):
        return False
    measured = steps["measured_cpu_s"]
    if not measured or not all(_positive(x) for x in measured):
        return False
    # A block from before the layout's fields were recorded has no pp_ranks: the planner ignores it.
    pp_ranks = steps.get("pp_ranks", [0] * len(measured))
    return isinstance(pp_ranks, list) and len(pp_ranks) == len(measured)


def load_profile(path: Path | str) -> dict:
    """Read and check a profile; ComputeProfileError says what is wrong (missing, unreadable, not a profile)."""
    return load_checked_json(path, ComputeProfileError, check_profile)


def profile_key(path: Path | str) -> Tuple[str, int, int]:
    """(resolved path, mtime, size): a hashable key that changes when the file does."""
    p = Path(path).expanduser().resolve()
    st = p.stat()
    return str(p), st.st_mtime_ns, st.st_size


def mismatch(profile: dict, device: str, precision: str) -> Optional[str]:
    """Why a profile does not describe a run on this device type at this precision (None if it does)."""
    measured = profile["device"]["type"]
    if measured != device:
        name = profile["device"].get("name", "?")
        return f"was measured on {measured} ({name}), but the cluster's devices are {device}"
    if profile["dtype"] != precision:
        return f"measured {profile['dtype']} matmuls, but train.precision is {precision}"
    return None


def write_profile(path: Path | str, profile: dict) -> Path:
    """Write atomically (temporary file, then rename), so a reader never sees half a profile."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(check_profile(profile), indent=1) + "\n")
    os.replace(tmp, path)
    return path


def profile_from_calib(
    lines: Iterable[str], device_name: str = "NVIDIA H200", torch_version: str = "2.11.0+cu130", source: str = ""
) -> dict:
    """A profile from the JSON lines of `shared/reference/gpu-h200/calib.py` (kind=gemm and
    kind=layer rows; bf16 on CUDA, fp32 weights under autocast, HF default dropout for GPT-2). That
    file measured no bandwidth: the H200 datasheet figure stands in (hbm_source "nominal")."""
    rows = [json.loads(line) for line in lines if line.strip()]
    gemm = [{k: r[k] for k in ("m", "k", "n", "seconds", "tflops")} for r in rows if r.get("kind") == "gemm"]
    layers = []
    for r in rows:
        if r.get("kind") != "layer":
            continue
        gpt2 = family(r["arch"]).block == "gpt2"
        keep = ("arch", "hidden", "heads", "kv_heads", "ffn", "seq", "micro", "recompute", "layer_fwd_bwd_s")
        layers.append(
            {
                **{k: r[k] for k in keep},
                "tp": 1,
                "activation": "gelu_new" if gpt2 else "silu",
                "dropout": gpt2,  # GPT2Config's default resid/attn/embd dropout 0.1
                "autocast": True,
                "layer_saved_bytes": r.get("layer_saved_bytes", 0),
            }
        )
    return check_profile(
        {
            "format": FORMAT,
            "version": VERSION,
            "device": {"type": "cuda", "name": device_name},
            "torch": torch_version,
            "hostname": "",
            "date": "",
            "dtype": "bf16",
            "hbm_bytes_per_s": H200_HBM_BYTES_PER_S,
            "hbm_source": "nominal",
            "gemm": gemm,
            "layers": layers,
            "source": source or "calib.py (kind=gemm, kind=layer rows)",
        }
    )


# ---- matmul rate by shape -------------------------------------------------------------------------------


def _log_dims(m: float, k: float, n: float) -> Tuple[float, float, float]:
    a, b, c = sorted(math.log(max(1.0, float(d))) for d in (m, k, n))
    return a, b, c


def _flops(m: float, k: float, n: float) -> float:
    return 2.0 * m * k * n


@dataclass(frozen=True)
class GemmRates:
    """Time of an m x k @ k x n matmul from the measured rows.

    Model: time = flops / peak + t0 (a fixed cost per call), i.e. a rate that saturates with the
    size, rate = peak * f / (f + f0) with f0 = peak * t0, fitted to the rows by least squares on
    relative error. On the H200 rows this holds to a few percent (t0 ~ 18 us: launch and tile
    quantisation; peak ~ 780 TFLOP/s). Each row's residual (measured / fitted time) then corrects
    shapes near it: weighted by closeness in log-space of the sorted dimensions (a matmul and its
    backward transposes share a correction), so a shape measured exactly gets its measured time.
    """

    peak: float
    """Fitted saturation rate, FLOP/s."""
    t0: float
    """Fitted fixed cost per matmul, seconds."""
    rows: Tuple[Tuple[Tuple[float, float, float], float], ...]
    """((sorted log dims), measured / fitted time) per row."""

    WIDTH = math.log(2.0)
    """Log-distance at which a row's correction weighs exp(-1) (a factor 2 in one dimension)."""

    def fitted(self, m: float, k: float, n: float) -> float:
        return _flops(m, k, n) / self.peak + self.t0

    def time(self, m: float, k: float, n: float) -> float:
        """Seconds of one m x k @ k x n matmul."""
        if min(m, k, n) <= 0:
            return 0.0
        key = _log_dims(m, k, n)
        wsum, csum = 0.05, 0.05  # prior weight on "no correction" far from every row
        for dims, corr in self.rows:
            d2 = sum((a - b) ** 2 for a, b in zip(key, dims)) / self.WIDTH**2
            w = math.exp(-d2)
            wsum, csum = wsum + w, csum + w * corr
        return self.fitted(m, k, n) * csum / wsum


def gemm_rates(rows: Sequence[dict]) -> GemmRates:
    """Fit `GemmRates` to rows {"m", "k", "n", "seconds"} (weighted least squares of
    t = f / peak + t0 with weights 1/t^2, i.e. on relative error; t0 clipped at 0)."""
    pts = [(_flops(r["m"], r["k"], r["n"]), float(r["seconds"])) for r in rows]
    # minimise sum ((a f + b - t) / t)^2 over a = 1/peak, b = t0: 2x2 normal equations
    sff = sum(f * f / t**2 for f, t in pts)
    sf1 = sum(f / t**2 for f, t in pts)
    s11 = sum(1 / t**2 for f, t in pts)
    sft = sum(f / t for f, t in pts)
    s1t = sum(1 / t for f, t in pts)
    det = sff * s11 - sf1 * sf1
    a, b = (sft * s11 - sf1 * s1t) / det if det else 0.0, (sff * s1t - sf1 * sft) / det if det else 0.0
    if a <= 0 or b < 0 or not det:  # one row, or a fit that says "bigger is slower": no fixed cost
        a, b = sum(t for f, t in pts) / sum(f for f, t in pts), 0.0
    base = GemmRates(peak=1.0 / a, t0=b, rows=())
    corr = tuple(
        (_log_dims(r["m"], r["k"], r["n"]), t / base.fitted(r["m"], r["k"], r["n"])) for r, (_, t) in zip(rows, pts)
    )
    return GemmRates(peak=base.peak, t0=base.t0, rows=corr)


def rows_of(profile: dict, name: str) -> List[dict]:
    return [dict(r) for r in profile.get(name, [])]


FIX = (
    "run `partrain bench compute` with this model and cluster on the device to write one (then "
    "cluster.compute_profile=FILE), or unset cluster.compute_profile"
)
"""The fix a validation problem with cluster.compute_profile suggests."""


def problem(path: str, device: str, precision: str) -> Optional[str]:
    """Why the profile at `path` cannot time a run on `device` at `precision` (None if it can): a
    missing or malformed file, or one measured on another device type or dtype (a CPU profile would
    make a GPU plan wrong by orders of magnitude)."""
    try:
        return mismatch(load_profile(path), device, precision)
    except ComputeProfileError as exc:
        return str(exc)
