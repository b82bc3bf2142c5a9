"""One unattended device check: parity, throughput against a plain HF loop, and a profile, in one JSON.

    python benchmarks/device.py --out "$OUT"          # CUDA, N = torch.cuda.device_count() (1..8)
    python benchmarks/device.py --cpu --out /tmp/dev  # the same phases on CPU, tiny numbers (CI, seconds)

Before anything else it installs partrain (editable, --no-deps) and the wheels carried in
.device-wheels/ (hydra-core, omegaconf, typer, rich, ...; see benchmarks/README.md, "Device check"),
because a fresh device machine has torch and transformers only. Already-installed packages are kept.

Phases, each with its own time budget and try/except (a failure is written into the JSON and the
next phase still runs; a phase that would start after --deadline-s is skipped and recorded):
  parity      partrain's parity harness: every layout that fits N processes against one process
              (bf16 on CUDA, fp32 on CPU; tolerances in PARITY_RTOL)
  throughput  a ~1B Llama (gpu.BIG, from config) on one device: partrain eager / compiled /
              compiled + float8, plain HF loop eager / compiled; tokens/s, MFU, peak memory, and
              the planner's predicted step time, tokens/s and memory beside each partrain row
  profile     2 profiled steps (train.profile_steps) whose traces go into traces.tar.gz
Writes OUT/device.json and OUT/traces.tar.gz and prints a short table. Exit 0 when every phase passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / ".device-wheels"
sys.path.insert(0, str(ROOT))  # partrain from this checkout, even before the editable install
sys.path.insert(0, str(ROOT / "benchmarks"))  # gpu.py: the one-GPU benchmark this script reuses

PHASE_BUDGET_S = {"install": 60.0, "parity": 150.0, "throughput": 200.0, "profile": 60.0}
"""Each phase's own time limit (CUDA; never past the overall deadline); --cpu runs are far below them.
Together under the default deadline of 480 s, so the whole check ends within 8 minutes."""
PARITY_RTOL = {"cuda": 3e-2, "cpu": 1e-4}
"""Largest relative difference of any step's loss or gradient norm from the one-process run: bf16
reduces in a different order per layout (a few 1e-3 seen on small models), fp32 on gloo to ~1e-6."""

LAYOUTS = {
    # name: (processes, parallel overrides)
    "dp2-zero3": (2, ["parallel.dp=2", "parallel.zero_stage=3"]),
    "tp2": (2, ["parallel.tp=2", "parallel.tp_sequence_parallel=true"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2xtp2": (4, ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=3", "parallel.tp_sequence_parallel=true"]),
    "dp2xpp2xtp2": (8, ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2", "parallel.tp_sequence_parallel=true"]),
}
CPU_LAYOUTS = ["dp2-zero3"]  # one 2-process case keeps the CI run in seconds
THROUGHPUT = {
    # name: (kind, compiled, float8)
    "hf eager": ("hf", False, False),
    "hf compiled": ("hf", True, False),
    "partrain eager": ("partrain", False, False),
    "partrain compiled": ("partrain", True, False),
    "partrain compiled float8": ("partrain", True, True),
}


def install_wheels() -> dict:
    """The carried packages, then partrain editable without dependencies, from WHEELS only.

    Every file in WHEELS is named (wheels, and sdists such as antlr4-python3-runtime's, built with
    the setuptools / hatchling wheels carried beside them); pip leaves what is already installed."""
    if not WHEELS.is_dir():
        return {"skipped": f"{WHEELS} not found: using the installed packages"}
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(WHEELS)]
    carried = sorted(str(f) for f in WHEELS.iterdir() if f.name.endswith((".whl", ".tar.gz", ".zip")))
    out = {"carried": [Path(f).name for f in carried]}
    steps = [("wheels", [*pip, *carried])] if carried else []
    for name, cmd in [*steps, ("partrain", [*pip, "--no-deps", "-e", str(ROOT)])]:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        out[name] = {"rc": proc.returncode, "tail": (proc.stdout + proc.stderr)[-1500:]}
        if proc.returncode != 0:
            raise RuntimeError(f"pip install {name} failed: {out[name]['tail']}")
    return out


def environment(cpu: bool) -> dict:
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    env.update(cuda=torch.version.cuda, host=platform.node(), cpus=os.cpu_count())
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    env["commit"] = commit or None
    if not cpu:
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpus=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}")
        env["gpu_memory_gib"] = props.total_memory / 2**30
    return env


# --- parity ---------------------------------------------------------------------------------------


def _data_overrides(a) -> list:
    """A short corpus, tokenized once into a cache every run of this invocation reads."""
    return [f"data.max_bytes={100_000 if a.cpu else 2_000_000}", f"data.cache_dir={a.work / 'data-cache'}"]


def _base_overrides(a) -> list:
    """The parity runs' model and data: the tiny Llama recipe with a short corpus and sequence."""
    base = ["recipe=llama-fsdp-tp", "parallel.dp=1", "parallel.tp=1", "parallel.zero_stage=0"]
    base += ["parallel.tp_sequence_parallel=false", *_data_overrides(a), "train.seq_len=64"]
    if a.cpu:
        return base
    return [*base, "cluster.device=cuda", "cluster.backend=nccl", "train.precision=bf16"]


def parity_cases(a) -> dict:
    """Layout name -> overrides, for the layouts that fit the processes available."""
    names = CPU_LAYOUTS if a.cpu else [n for n, (procs, _) in LAYOUTS.items() if procs <= a.n]
    return {n: [*_base_overrides(a), *LAYOUTS[n][1], f"cluster.devices_per_node={LAYOUTS[n][0]}"] for n in names}


def phase_parity(a, work: Path) -> dict:
    from partrain.testing.parity import check_parity, parity_args, reference_overrides, run_training

    rtol = PARITY_RTOL["cpu" if a.cpu else "cuda"]
    layouts = parity_cases(a)
    reference = reference_overrides(_base_overrides(a))
    if a.cpu:  # one launch per process count through the fork server (seconds, not a torchrun each)
        from partrain.rehearse.runs import train_all

        cases = {"reference": parity_args(reference, a.parity_steps)}
        cases.update({n: parity_args(o, a.parity_steps) for n, o in layouts.items()})
        records = train_all(cases, work / "parity", timeout_s=a.budget_left())
    else:  # the real `partrain train` (torchrun, nccl) per run, each within what is left of the budget
        left = int(a.budget_left())
        records = {"reference": run_training(reference, work / "parity" / "reference", a.parity_steps, timeout_s=left)}
        for name, overrides in layouts.items():
            left = int(a.budget_left())
            if left < 15:
                records[name] = RuntimeError("skipped: the phase's time budget ran out")
                continue
            try:
                records[name] = run_training(overrides, work / "parity" / name, a.parity_steps, timeout_s=left)
            except Exception as e:  # one failed layout must not hide the others
                records[name] = e
    out = {"rtol": rtol, "steps": a.parity_steps, "layouts": {}}
    for name in layouts:
        rec = records[name]
        if isinstance(rec, Exception):
            out["layouts"][name] = {"ok": False, "error": str(rec)[-1500:]}
            continue
        try:
            out["layouts"][name] = {"ok": True, **check_parity(records["reference"], rec, rtol)}
        except AssertionError as e:
            out["layouts"][name] = {"ok": False, "error": str(e)[-1500:]}
    failed = [n for n, r in out["layouts"].items() if not r["ok"]]
    if failed:
        raise RuntimeError(f"parity failed for {failed}: {json.dumps(out)[-3000:]}")
    return out


# --- throughput -----------------------------------------------------------------------------------


def _gpu_args(a):
    import gpu

    argv = ["--device", "cpu" if a.cpu else "cuda", "--peak-tflops", str(a.peak_tflops)]
    # CPU: dynamo's "eager" backend traces and guards like inductor but generates no code (seconds saved).
    argv += ["--tiny", "--steps", "3", "--backend", "eager"] if a.cpu else ["--steps", str(a.steps)]
    return gpu._args(argv)


def planner_prediction(ga, compiled: bool, float8: bool) -> dict:
    """The planner's estimate for the same run config the partrain row trains."""
    import gpu

    from partrain.blueprint.planner.estimate import estimate
    from partrain.blueprint.validate import validate

    est = estimate(validate(gpu._run_config(ga, compiled, 0, "none", float8)))
    return {
        "step_time_s": est["step_time_s"],
        "tokens_per_s": est["tokens_per_s"],
        "mfu": est["mfu"],
        "memory_gib": est["memory_bytes"]["total"] / 2**30,
    }


def float8_unavailable(cpu: bool) -> str:
    """Why float8 cannot run here ('' when it can)."""
    import torch

    if cpu:  # float8 trains under bf16; the CPU rows run fp32 (gpu.py --tiny)
        return "float8 needs bf16 precision: CUDA only here"
    try:
        import torchao  # noqa: F401
    except ImportError:
        return "torchao is not installed"
    if torch.cuda.get_device_capability(0) < (8, 9):
        return f"float8 needs sm >= 89, this GPU is sm {torch.cuda.get_device_capability(0)}"
    return ""


def run_throughput_variant(a, name: str) -> dict:
    """One row in this process: measured figures, plus the planner's for partrain rows."""
    import gpu

    ga = _gpu_args(a)
    kind, compiled, float8 = THROUGHPUT[name]
    gpu._process_group(ga)
    row = gpu.run_hf(ga, compiled) if kind == "hf" else gpu.run_partrain(ga, compiled, 0, "none", float8)
    row.update(name=name, tokens_per_s=ga.seq * ga.micro * ga.accum / row["median_step_s"])
    row["mfu"] = row.pop("flops_per_step") / row["median_step_s"] / (ga.peak_tflops * 1e12)
    if kind == "partrain":
        row["planned"] = planner_prediction(ga, compiled, float8)
    return row


def phase_throughput(a) -> dict:
    import torch

    rows, note = [], {}
    why_not_float8 = float8_unavailable(a.cpu)
    ga = _gpu_args(a)
    for name in THROUGHPUT:
        if THROUGHPUT[name][2] and why_not_float8:
            note[name] = why_not_float8
            continue
        left = a.budget_left()
        if left < 10:
            rows.append({"name": name, "error": "skipped: the phase's time budget ran out"})
            continue
        try:
            if a.cpu:  # one process: seconds matter more than clean caches
                rows.append(run_throughput_variant(a, name))
                torch._dynamo.reset()
            else:  # a process per row: clean peak memory and compile caches
                rows.append(_in_subprocess(a, name, left))
        except Exception as e:
            rows.append({"name": name, "error": f"{type(e).__name__}: {e}"[-1500:]})
    model = dict(ga.model, seq=ga.seq, micro=ga.micro, accum=ga.accum, steps=ga.steps, peak_tflops=ga.peak_tflops)
    out = {"model": model, "rows": rows, "skipped": note}
    failed = [r["name"] for r in rows if "error" in r]
    if failed:
        raise RuntimeError(f"throughput rows failed: {failed}; {json.dumps(out)[-3000:]}")
    return out


def _in_subprocess(a, name: str, timeout_s: float) -> dict:
    cmd = [sys.executable, __file__, "--no-install", "--steps", str(a.steps), "--peak-tflops", str(a.peak_tflops)]
    proc = subprocess.run([*cmd, "--one", name], capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"name": name, "error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(lines[-1])


# --- profile --------------------------------------------------------------------------------------


def profile_overrides(a) -> list:
    """2 profiled steps (2 and 3) of partrain on one device: the big Llama on CUDA, the tiny on CPU."""
    import gpu

    over = ["recipe=llama-fsdp-tp", "parallel.tp=1", "parallel.tp_sequence_parallel=false"]
    over += ["cluster.devices_per_node=1", "parallel.dp=1", "parallel.zero_stage=0", "train.profile_steps=[2,3]"]
    if a.cpu:
        return [*over, *_data_overrides(a), "train.seq_len=64"]
    over += ["cluster.device=cuda", "cluster.backend=nccl", "train.precision=bf16", *_data_overrides(a)]
    over += ["train.seq_len=2048", "train.micro_batch_size=4", "train.global_batch_size=8"]
    return over + [f"model.config.{k}={str(v).lower()}" for k, v in gpu.BIG.items()]


def phase_profile(a, work: Path) -> dict:
    from partrain.testing.parity import parity_args, run_training

    run_dir = work / "profile" / "run"
    if a.cpu:
        from partrain.rehearse.runs import train_all

        train_all({"profile": parity_args(profile_overrides(a), 3)}, work, a.budget_left())
    else:
        run_training(profile_overrides(a), run_dir, 3, timeout_s=int(a.budget_left()))
    traces = sorted((run_dir / "profile").glob("*.json*"))
    if not traces:
        raise RuntimeError(f"no trace files under {run_dir / 'profile'}")
    with tarfile.open(a.out / "traces.tar.gz", "w:gz") as tar:
        for trace in traces:
            tar.add(trace, arcname=f"profile/{trace.name}")
    return {"traces": [t.name for t in traces], "bytes": sum(t.stat().st_size for t in traces)}


# --- driver ---------------------------------------------------------------------------------------


def run_phase(a, report: dict, name: str, fn) -> None:
    """Runs one phase into report['phases'][name]: its result, or its error, or why it was skipped."""
    if time.monotonic() - a.start > a.deadline_s:
        report["phases"][name] = {"ok": False, "skipped": f"the overall deadline ({a.deadline_s:.0f} s) had passed"}
        return
    a.phase_start = time.monotonic()
    budget_s = min(PHASE_BUDGET_S[name], a.deadline_s - (a.phase_start - a.start))
    a.budget_left = lambda: max(1.0, budget_s - (time.monotonic() - a.phase_start))
    try:
        result = {"ok": True, **fn()}
    except Exception as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"[-4000:], "traceback": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.monotonic() - a.phase_start, 1)
    report["phases"][name] = result
    print(f"[device] {name}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']} s", flush=True)


def table(report: dict) -> str:
    lines = [f"{'phase':12} {'ok':>3} {'s':>6}"]
    for name, p in report["phases"].items():
        lines.append(f"{name:12} {'yes' if p.get('ok') else 'NO':>3} {p.get('seconds', 0):>6}")
    rows = report["phases"].get("throughput", {}).get("rows", [])
    if rows:
        head = f"{'variant':26} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'plan tok/s':>10} {'plan GiB':>9}"
        lines += ["", head, "-" * len(head)]
        for r in rows:
            if "error" in r:
                lines.append(f"{r['name']:26} failed")
                continue
            plan = r.get("planned", {})
            mem = f"{r['peak_alloc_gib']:.2f}" if "peak_alloc_gib" in r else "-"
            plan_tps = f"{plan['tokens_per_s']:,.0f}" if plan else "-"
            plan_mem = f"{plan['memory_gib']:.2f}" if plan else "-"
            lines.append(
                f"{r['name']:26} {r['tokens_per_s']:>10,.0f} {r['mfu']:>6.1%} {mem:>9} {plan_tps:>10} {plan_mem:>9}"
            )
    return "\n".join(lines)


def _args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="CPU, tiny models, gloo, 1-2 processes: seconds")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "device-out")), help="default $OUT")
    p.add_argument("--deadline-s", type=float, default=480.0, help="no phase starts after this many seconds")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per throughput row (CUDA)")
    p.add_argument("--parity-steps", type=int, default=0, help="steps per parity run (default 4 / 2 on CPU)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the device's dense bf16 peak (H200: 989)")
    p.add_argument("--keep", action="store_true", help="keep the run folders (work_dir in the JSON)")
    p.add_argument("--no-install", action="store_true", help="skip the pip install from .device-wheels")
    p.add_argument("--one", default="", help=argparse.SUPPRESS)  # one throughput row, printed as JSON
    a = p.parse_args(argv)
    a.parity_steps = a.parity_steps or (2 if a.cpu else 4)
    return a


def main(argv=None) -> int:
    a = _args(argv)
    a.start = time.monotonic()
    if a.one:
        print(json.dumps(run_throughput_variant(a, a.one)))
        return 0
    report = {"phases": {}, "deadline_s": a.deadline_s, "cpu": a.cpu}
    if not a.cpu and not a.no_install:
        run_phase(a, report, "install", install_wheels)  # before anything imports hydra or partrain
    import torch

    a.n = 2 if a.cpu else torch.cuda.device_count()
    if not a.cpu and a.n == 0:
        print("no CUDA device: use --cpu", file=sys.stderr)
        return 2
    a.out.mkdir(parents=True, exist_ok=True)
    report["environment"] = environment(a.cpu)
    work = a.work = Path(tempfile.mkdtemp(prefix="partrain-device-"))
    report["work_dir"] = str(work)
    run_phase(a, report, "parity", lambda: phase_parity(a, work))
    run_phase(a, report, "throughput", lambda: phase_throughput(a))
    run_phase(a, report, "profile", lambda: phase_profile(a, work))
    report["seconds"] = round(time.monotonic() - a.start, 1)
    if not a.keep:  # everything worth keeping is in OUT; run folders of the 1B model are large
        shutil.rmtree(work, ignore_errors=True)
    (a.out / "device.json").write_text(json.dumps(report, indent=1, default=str))
    print(table(report))
    print(
        f"wrote {a.out / 'device.json'}"
        + (f" and {a.out / 'traces.tar.gz'}" if report["phases"]["profile"]["ok"] else "")
    )
    return 0 if all(p.get("ok") for p in report["phases"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
