"""Validation of the runtime switches of `train` (compile, chunked loss): choices and ranges,
checked with the rest before any process starts."""

from __future__ import annotations

from partrain.blueprint.config.schema import RunConfig
from partrain.blueprint.problems import ProblemCollector
from partrain.blueprint.validate_profiling import profiling_problems

COMPILE_VALUES = ("auto", "true", "false")
"""train.compile: auto = compile on CUDA, eager on CPU (inductor builds C++ there: slow to start)."""
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""torch.compile backends partrain accepts: inductor (fast kernels); aot_eager / eager trace the
same graphs without generating code (quick, for tests and for telling tracing from codegen failures)."""


def compile_value(setting) -> str:
    """train.compile normalised: YAML booleans and any case of auto/true/false."""
    return str(setting).strip().lower()


def compile_resolved(run: RunConfig) -> bool:
    """Whether this run compiles its blocks: true, or auto on CUDA (every layout compiles)."""
    value = compile_value(run.train.compile)
    if value == "auto":
        return run.cluster.device == "cuda"
    return value == "true"


def runtime_problems(c: ProblemCollector, run: RunConfig) -> None:
    t = run.train
    c.check(
        compile_value(t.compile) in COMPILE_VALUES,
        "train.compile",
        t.compile,
        f"must be one of {', '.join(COMPILE_VALUES)}",
        "train.compile=auto (compiled on CUDA, eager on CPU)",
    )
    c.check(
        t.compile_backend in COMPILE_BACKENDS,
        "train.compile_backend",
        t.compile_backend,
        f"must be one of {', '.join(COMPILE_BACKENDS)}",
        "train.compile_backend=inductor",
    )
    c.check(
        t.loss_chunk_tokens >= 0,
        "train.loss_chunk_tokens",
        t.loss_chunk_tokens,
        "must be >= 0 (0 = one head call over the whole microbatch)",
        "e.g. train.loss_chunk_tokens=4096",
    )
    profiling_problems(c, run)
