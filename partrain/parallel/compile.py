"""Compile each decoder block with torch.compile (`train.compile`, issue 16 part 1).

Per block, as torchtitan does: every block has the same code, so dynamo compiles one graph and
reuses it for every layer (torch inlines nn.Module calls and treats parameters as graph inputs),
and a compile failure or graph break stays inside one block. Applied after TP/SP, context parallel,
expert parallel and recompute wrapping (their hooks are traced with the block) and before FSDP2's
`fully_shard` (dynamo skips FSDP's hooks, so they run eagerly around the compiled block).

Under full recompute the module inside the checkpoint wrapper is compiled, not the wrapper: traced
as a whole, a checkpoint region holding eager collectives (every TP block) made dynamo give up on
the block and run it eagerly without a word (0 graphs, measured on torch 2.13); compiled inside,
the checkpoint replays the compiled forward. `nn.Module.compile` compiles in place, so parameter
names (checkpoints, HF export) do not change. Compilation happens at the first forward, on the
real device.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from partrain.blueprint.validate_runtime import compile_resolved
from partrain.models.adapters import Adapter


def compile_enabled(run) -> bool:
    """Whether this run compiles its decoder blocks (`validate_runtime.compile_resolved`)."""
    return compile_resolved(run)


def apply_compile(model: nn.Module, adapter: Adapter, backend: str = "inductor") -> int:
    """Compile every decoder block of `model` in place; returns how many were compiled."""
    layers = adapter.layers(model)
    blocks = list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    for block in blocks:
        inner = getattr(block, "_checkpoint_wrapped_module", block)
        inner.compile(backend=backend, fullgraph=False)
    return len(blocks)


def eager(fn):
    """`fn` (a custom autograd Function's `apply` that runs collectives, or keeps Python state) run
    eagerly inside a compiled block: dynamo breaks the graph around it instead of tracing it.
    Traced, c10d calls in place and async work handles in hand-written backward passes gave wrong
    gradients (TP x Megatron-SP, 1e-4 off after one step); eager, they are exact."""
    import torch

    return torch.compiler.disable(fn, recursive=True)


class CompileError(RuntimeError):
    """Compiling the decoder blocks failed; the message names `train.compile` and what to try."""


@contextlib.contextmanager
def compile_errors(enabled: bool, backend: str) -> Iterator[None]:
    """Turn torch.compile's own errors (raised lazily at the first forward/backward) into one
    message that names the config key; other errors pass through untouched."""
    if not enabled:
        yield
        return
    from torch._dynamo.exc import TorchDynamoException

    try:
        yield
    except TorchDynamoException as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CompileError(
            f"train.compile=true: torch.compile of the decoder blocks failed (backend {backend!r}): "
            f"{type(exc).__name__}: {first}. Fix: train.compile=false (eager), or "
            f"train.compile_backend=aot_eager to tell an inductor failure from a tracing one."
        ) from exc
