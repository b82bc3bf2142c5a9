"""Activation recompute (`parallel.recompute`), applied after tensor parallelism and before FSDP.

- full: each decoder block keeps only its input; everything inside is recomputed in backward.
- selective: Korthikanti et al. 2022's selective recompute: only the attention core (QK^T, softmax,
  dropout, attention over V) is recomputed. The core keeps just its inputs q, k, v (and a mask
  tensor, when the model builds one); its own saves (scores and probabilities under eager
  attention, dropout masks, SDPA's output and log-sum-exp) are dropped and rebuilt in backward.
  The projections, norms and MLP keep their activations. Every family: the core is the function
  HF calls through `config._attn_implementation` (SDPA, eager, partrain's sp attention), wrapped
  per attention module (`_RecomputeCore`, which replays the RNG state, so dropout masks match).
- `recompute_every=k`: only blocks 0, k, 2k, ... are wrapped (under both policies).

Full recompute uses non-reentrant checkpointing (`use_reentrant=False`): the reentrant variant
breaks with HF's caches and with FSDP2. Parameter names stay those of the HF model (state-dict
helpers and materialize strip the wrapper's `_checkpoint_wrapped_module.` part); selective
recompute adds no wrapper module at all.
"""

from __future__ import annotations

import copy
import sys
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from partrain.models.adapters import Adapter
from partrain.parallel.compile import eager

SELECTIVE_ATTENTION = "partrain_selective"
"""`config._attn_implementation` of attention modules whose core is recomputed (transformers' registry)."""
CORE_ATTR = "partrain_core_impl"
"""Attribute of such a module: the attention implementation its core runs (sdpa, eager, ...)."""


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class _RecomputeCore(torch.autograd.Function):
    """out = core(q, k, v, mask) without saving the core's internals: forward under no_grad keeps
    q, k, v (and the mask); backward reruns the core with the same RNG and autocast state."""

    @staticmethod
    def forward(ctx, core, q, k, v, mask):
        ctx.core = core
        ctx.rng = _rng_state(q.device)
        ctx.cast = (q.device.type, torch.is_autocast_enabled(q.device.type), torch.get_autocast_dtype(q.device.type))
        with torch.no_grad():
            out = core(q, k, v, mask)
        ctx.save_for_backward(q, k, v, mask)
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, mask = ctx.saved_tensors
        device_type, cast, dtype = ctx.cast
        cpu_state, cuda_state = ctx.rng
        devices = [q.device] if cuda_state is not None else []
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, q.device)
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v)]
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=cast):
                out = ctx.core(*inputs, mask)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad)) if wanted else iter(())
        return (None, *[next(grads) if t.requires_grad else None for t in inputs], None)


def _original_core(module: nn.Module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    return ALL_ATTENTION_FUNCTIONS.get_interface(getattr(module, CORE_ATTR), eager)


def _selective_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    **kwargs: Any,
):
    """The attention function HF calls for modules under selective recompute; returns (output, None)."""
    fn = _original_core(module)

    def core(q, k, v, mask):
        return fn(module, q, k, v, mask, **kwargs)[0]

    return _RecomputeCore_eager(core, query, key, value, attention_mask), None


def register_selective_attention() -> None:
    """Add the selective-recompute name to transformers' attention registry (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(SELECTIVE_ATTENTION, _selective_attention)


def recompute_attention_core(attention: nn.Module) -> None:
    """Route one attention module's core through `_RecomputeCore` (its own copy of the config,
    so `recompute_every` can leave other layers alone and the model's mask building is unchanged)."""
    register_selective_attention()
    config = copy.copy(attention.config)
    setattr(attention, CORE_ATTR, config._attn_implementation)
    config._attn_implementation_internal = SELECTIVE_ATTENTION
    attention.config = config


def apply_recompute(model: nn.Module, adapter: Adapter, policy: str, every: int = 1) -> int:
    """Wrap blocks for recompute in place; returns how many units were wrapped."""
    if policy == "none":
        return 0
    layers = adapter.layers(model)
    items = list(layers.items()) if isinstance(layers, nn.ModuleDict) else [(str(i), l) for i, l in enumerate(layers)]
    wrapped = 0
    for key, layer in items:
        if int(key) % every:
            continue
        if policy == "full":
            layers[key if isinstance(layers, nn.ModuleDict) else int(key)] = checkpoint_wrapper(
                layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT
            )
        elif policy == "selective":
            recompute_attention_core(adapter.attention(layer))
        else:
            raise ValueError(f"unknown recompute policy {policy!r}")
        wrapped += 1
    return wrapped


# Run eagerly inside compiled blocks (partrain.parallel.compile.eager: collectives, Python state).
_RecomputeCore_eager = eager(_RecomputeCore.apply)
