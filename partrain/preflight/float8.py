"""Before the launch, for `train.float8`: torchao is installed (an extra), and on CUDA the visible
GPUs have float8 tensor cores (compute capability 8.9: Ada, Hopper and later). Both are facts of
the machine, not of the config, so they are checked here (which may import torch) rather than in
partrain.blueprint."""

from __future__ import annotations

import importlib.util
from typing import Callable, List, Optional, Tuple

from partrain.blueprint.config.schema import RunConfig
from partrain.errors import Problem

FLOAT8_MIN_CAPABILITY = (8, 9)
"""torch._scaled_mm's float8 kernels need sm89 or newer."""


def _visible_capability() -> Optional[Tuple[int, int]]:
    """The lowest compute capability of this machine's visible GPUs; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return min(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))


def float8_problems(
    run: RunConfig,
    installed: Optional[bool] = None,
    capability: Callable[[], Optional[Tuple[int, int]]] = _visible_capability,
) -> List[Problem]:
    """train.float8's machine requirements (installed / capability: overridable for tests)."""
    if not run.train.float8:
        return []
    problems: List[Problem] = []
    if installed is None:
        installed = importlib.util.find_spec("torchao") is not None
    if not installed:
        fix = "pip install 'partrain[float8]' (or torchao), or train.float8=false"
        problems.append(Problem("train.float8", True, "needs torchao, which is not installed", fix))
    cap = capability() if run.cluster.device == "cuda" else None
    if cap is not None and cap < FLOAT8_MIN_CAPABILITY:
        problems.append(
            Problem(
                "train.float8",
                True,
                f"needs float8 tensor cores (sm89+: L4/L40, H100, H200, B200); this GPU is sm{cap[0]}{cap[1]}",
                "train.float8=false (bf16), or run on an sm89+ GPU",
            )
        )
    return problems
