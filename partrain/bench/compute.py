"""`partrain bench compute`: measure this machine's compute for the planner, in one process.

What it times, for the run's model at the run's precision (`train.precision`) on the cluster's
device type (CPU, or the first CUDA device):

- matmuls: every (m, k, n) the planner will ask for (`compute_model.layer_gemms` of one decoder layer at
  micro batch x seq / sp tokens with the widths sliced by tp, their two backward transposes, and
  the head), in the compute dtype, median of `iters` calls after warmup;
- one decoder layer of the real HF model (fp32 weights; under torch.autocast for 16-bit, as
  partrain's ZeRO 0/1 runtime trains), forward + backward at micro batch x seq tokens, unsliced (tp
  1: a layer alone needs no process group), with its saved-tensor bytes (runtime/activations.py);
- an elementwise bandwidth: a large fp32 copy (bytes read + written per second);
- on CPU, the per-call work the cores do besides kernels (cpu/host_costs.py): the optimizer and the
  gradient clip per parameter tensor (plain and DTensor), and what tensor parallelism's wrappers add
  to a layer;
- on CPU, the real steps of the first node's ranks, all at once on the fake process group (cpu/rank_steps.py):
  what the pieces above miss on a node whose ranks share its cores;
- on CPU, what a training process holds beyond its tensors (planner/cpu_host.py): this process's
  resident memory once the runtime and the model's module are imported, before anything is measured,
  and the file-backed resident memory (library code) the measurements then page in.

It writes a profile (format in `partrain/blueprint/compute_profile.py`) that
`cluster.compute_profile` points the planner at.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Callable, List, Tuple

import torch

from partrain.bench.cpu.host_costs import measure_host
from partrain.bench.cpu.rank_steps import rank_steps_block
from partrain.bench.one_layer import DTYPES, layer_step, one_layer
from partrain.blueprint.compute_profile import FORMAT, VERSION, check_profile
from partrain.blueprint.planner.compute_model import layer_gemms
from partrain.blueprint.planner.compute_time import shape_of_spec
from partrain.blueprint.planner.spec import PlanSpec
from partrain.models.build import import_model_module
from partrain.runtime.activations import SavedActivations
from partrain.runtime.resident import resident_bytes

LAYER_ITERS = 15
"""Fewest timed calls of the decoder layer (whatever --iters says)."""
COPY_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}
"""Bytes of the fp32 tensor the bandwidth copy reads (and writes): well past the caches."""


def _timer(device: torch.device) -> Callable[[Callable[[], object], int, int], float]:
    """Median seconds of fn() over `iters` calls after `warmup` (CUDA events on a GPU): the median,
    not the fastest call, so that a CPU shared with other work is measured as training will find it."""

    def timed(fn: Callable[[], object], iters: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                torch.cuda.synchronize(device)
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    return timed


def gemm_shapes(spec: PlanSpec) -> List[Tuple[int, int, int]]:
    """The distinct (m, k, n) the planner times for this spec: each layer matmul forward (dense, and
    for MoE the router and expert ones), its input-gradient and weight-gradient transposes, and the
    head's three."""
    tokens = spec.mbs * spec.seq / spec.sp
    fwd = list(layer_gemms(shape_of_spec(spec, False, tokens)))
    if spec.facts.is_moe:  # router and experts (at the tokens each expert gets on average)
        fwd += [g for g in layer_gemms(shape_of_spec(spec, True, tokens)) if g not in fwd]
    fwd.append((tokens, spec.facts.hidden, spec.facts.vocab / spec.tp))
    out = []
    for m, k, n in fwd:
        for shape in ((m, k, n), (m, n, k), (k, m, n)):
            s = tuple(max(1, int(round(d))) for d in shape)
            if s not in out:
                out.append(s)
    return out


def measure_gemms(shapes, dtype, device, timed, iters: int) -> List[dict]:
    rows = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = timed(lambda a=a, b=b: a @ b, iters, 2)
        rows.append({"m": m, "k": k, "n": n, "seconds": t, "tflops": 2 * m * k * n / t / 1e12})
    return rows


def measure_bandwidth(device, timed, iters: int) -> float:
    x = torch.ones(COPY_BYTES[device.type] // 4, device=device)
    y = torch.empty_like(x)
    t = timed(lambda: y.copy_(x), iters, 2)
    return 2 * x.numel() * 4 / t


def measure_layer(run, spec: PlanSpec, device, timed, iters: int) -> dict:
    """One decoder layer's forward + backward seconds and saved bytes at micro batch x seq tokens."""
    model, layer, rotary = one_layer(run, device)
    b, s, h = spec.mbs, spec.seq, spec.facts.hidden
    cast = spec.precision != "fp32"
    forward, step = layer_step(layer, rotary, spec, device)
    with SavedActivations(layer.parameters()) as saved:
        out = forward()
    del out
    # The layer row sets the fitted host and bandwidth constants: a median of at least LAYER_ITERS calls,
    # as a handful of calls on a shared CPU moved it by a third from one run to the next.
    seconds = timed(step, max(iters, LAYER_ITERS), 3)
    f, x = spec.facts, spec.extras
    return {
        "arch": f.arch,
        "hidden": h,
        "heads": f.heads,
        "kv_heads": f.kv_heads,
        "head_dim": f.head_dim,
        "ffn": x.dense_ffn or f.ffn,
        "seq": s,
        "micro": b,
        "tp": 1,
        "recompute": "none",
        "activation": x.activation,
        "dropout": x.resid_dropout,
        "autocast": cast,
        "experts": [f.n_experts, f.experts_per_token, f.shared_expert_ffn, 1] if f.is_moe else [0, 0, 0, 1],
        "layer_fwd_bwd_s": seconds,
        "layer_saved_bytes": saved.total,
        "layer_params": sum(p.numel() for p in layer.parameters()),
    }


def measure(run, spec: PlanSpec, iters: int = 5, progress: Callable[[str], None] = lambda _: None) -> dict:
    """The compute profile of this machine for this run (see module docstring)."""
    device = torch.device("cuda", 0) if run.cluster.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":  # the threads one training process gets (as `partrain train` sets them)
        from partrain.runtime.context import cpu_count

        torch.set_num_threads(run.train.threads_per_process or max(1, cpu_count() // run.cluster.devices_per_node))
    timed = _timer(device)
    dtype = DTYPES[spec.precision]
    runtime_anon = runtime_file = 0
    if device.type == "cpu":  # before anything this bench runs: the runtime a worker holds before its model
        try:
            import_model_module(run.model)
        except (KeyError, ValueError):  # a custom architecture: its module comes with the model
            pass
        runtime_anon, runtime_file = resident_bytes()
    shapes = gemm_shapes(spec)
    progress(f"{len(shapes)} matmul shapes")
    gemm = measure_gemms(shapes, dtype, device, timed, iters)
    progress("elementwise bandwidth")
    bw = measure_bandwidth(device, timed, iters)
    progress("one decoder layer, forward + backward")
    layer = measure_layer(run, spec, device, timed, iters)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    profile = {
        "format": FORMAT,
        "version": VERSION,
        "device": {"type": device.type, "name": name},
        "torch": torch.__version__,
        "hostname": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": spec.precision,
        "hbm_bytes_per_s": bw,
        "hbm_source": "measured",
        "threads": torch.get_num_threads(),
        "cpu_cores": cpu_cores() if device.type == "cpu" else 0,
        "iters": iters,
        "gemm": gemm,
        "layers": [layer],
        "units": "seconds; bytes; tflops = 10**12 FLOP/s; hbm_bytes_per_s = bytes read + written per second",
        "source": f"partrain bench compute ({run.model.arch}, micro {spec.mbs} x seq {spec.seq}, tp {spec.tp})",
    }
    if device.type == "cpu":
        progress("per-tensor optimizer and clip, and the tensor-parallel wrappers")
        profile.update(measure_host(run, spec, device, iters, check_profile(dict(profile))))
    if runtime_anon:
        code = max(1, resident_bytes()[1] - runtime_file)  # the kernels the measurements paged in
        profile["process"] = {"runtime_rss_bytes": runtime_anon + runtime_file, "code_rss_bytes": code}
    if "host" in profile:
        from partrain.blueprint.validate import validate

        progress("the node's real rank steps, all at once (fake process group)")
        block = rank_steps_block(validate(run), spec, torch.get_num_threads(), progress)
        if block is not None:
            profile["host"]["rank_steps"] = block
    return check_profile(profile)


def cpu_cores() -> int:
    """Cores this process may run on (the planner scales a CPU profile by how ranks share them)."""
    from partrain.runtime.context import cpu_count

    return cpu_count()


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
