"""The checking and reporting side of `partrain bench compute` (no torch at import: the CLI refuses
bad input before the heavy import; the measurement is `partrain.bench.compute`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Optional, Sequence, Tuple

from partrain.blueprint.config.local_gpus import NO_GPUS, LocalGpus
from partrain.blueprint.planner.spec import PlanSpec, spec_from_validated
from partrain.errors import ConfigError, Problem


def bench_spec(
    overrides: Sequence[str], recipe_dirs: Sequence[str], iters: int, gpus: LocalGpus = NO_GPUS
) -> Tuple[object, PlanSpec]:
    """(the composed run on a machine with `gpus`, its PlanSpec) after the checks plan and train make;
    ConfigError otherwise.
    cluster.compute_profile is ignored: it names the kind of file this command writes."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate

    if iters < 1:
        raise ConfigError(Problem("--iters", iters, "must be at least 1", "pass --iters 5 (the default)"))
    run = compose(list(overrides), recipe_dirs, gpus)
    run = dataclasses.replace(run, cluster=dataclasses.replace(run.cluster, compute_profile=""))
    spec = spec_from_validated(validate(run))
    if run.cluster.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                Problem(
                    "cluster.device",
                    "cuda",
                    "no CUDA device on this machine (the bench measures the machine it runs on)",
                    "run it on a GPU machine, or measure this CPU with cluster.device=cpu cluster.backend=gloo",
                )
            )
    return run, spec


def default_out(cluster_name: str) -> Path:
    """runs/bench-compute/<cluster>-<timestamp>.json under the working folder (a new name each run)."""
    base = Path("runs") / "bench-compute" / f"{cluster_name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base.with_suffix(".json"), 1
    while path.exists():
        path, n = base.with_name(f"{base.name}-{n}.json"), n + 1
    return path


def render_profile(profile: dict, path: Optional[Path], console) -> None:
    """The matmul table, the layer row, the bandwidth, and how to plan with the profile."""
    from rich.table import Table

    dev = profile["device"]
    table = Table(title=f"{profile['dtype']} matmuls on {dev['name']} ({dev['type']})", title_justify="left")
    for col in ("m", "k", "n", "time (us)", "TFLOP/s"):
        table.add_column(col, justify="right")
    for r in profile["gemm"]:
        table.add_row(str(r["m"]), str(r["k"]), str(r["n"]), f"{r['seconds'] * 1e6:,.1f}", f"{r['tflops']:.3g}")
    console.print(table)
    for r in profile["layers"]:
        console.print(
            f"one {r['arch']} decoder layer (hidden {r['hidden']}, micro {r['micro']} x seq {r['seq']}): forward + "
            f"backward {r['layer_fwd_bwd_s'] * 1e3:.3f} ms, {r['layer_saved_bytes']:,} bytes saved for backward",
            highlight=False,
        )
    console.print(f"elementwise bandwidth {profile['hbm_bytes_per_s'] / 1e9:.3g} GB/s (fp32 copy)", highlight=False)
    if path is not None:
        console.print(
            f"profile written to [cyan]{path}[/cyan]; plan with it: partrain plan ... cluster.compute_profile={path}",
            highlight=False,
        )
