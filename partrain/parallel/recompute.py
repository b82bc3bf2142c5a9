"""Activation recompute (`parallel.recompute`), applied after tensor parallelism and before FSDP.

- full: each decoder block keeps only its input; everything inside is recomputed in backward.
- selective: only the attention block is recomputed (Korthikanti et al. 2022 recompute the
  attention core, whose softmax/score activations grow with s^2 and are cheap to redo; with SDPA
  the core already saves little, so the whole attention block is the unit here, projections
  included); the MLP keeps its activations.
- `recompute_every=k`: only blocks 0, k, 2k, ... are wrapped.

Non-reentrant checkpointing (`use_reentrant=False`): the reentrant variant breaks with HF's
caches and with FSDP2. Parameter names stay those of the HF model (state-dict helpers and
materialize strip the wrapper's `_checkpoint_wrapped_module.` part).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)

from partrain.models.adapters import Adapter


def _wrap(parent: nn.Module, attr: str) -> None:
    owner_path, _, name = attr.rpartition(".")
    owner = parent.get_submodule(owner_path) if owner_path else parent
    setattr(owner, name, checkpoint_wrapper(getattr(owner, name), checkpoint_impl=CheckpointImpl.NO_REENTRANT))


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
            _wrap(layer, adapter.attention_attr)
        else:
            raise ValueError(f"unknown recompute policy {policy!r}")
        wrapped += 1
    return wrapped
