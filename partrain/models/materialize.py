"""Give a meta-device model real weights, identical under every parallel layout.

`materialize` is called after the parallel wrappers have sharded the meta model (FSDP2, tensor
parallel DTensors, a pipeline stage holding only some layers), so each rank allocates only its own
shards. Every value is a function of (seed, tensor name, model config) alone, or of the pretrained
checkpoint: a run with dp=1 and one with tp=2 x pp=2 start from bit-identical weights, which is
what the parity tests compare.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from partrain.blueprint.config.schema import ModelConfig
from partrain.errors import ConfigError, Problem
from partrain.models.adapters import get_adapter
from partrain.models.build import build_meta_model
from partrain.models.lora_init import is_lora_weight, lora_initial_value
from partrain.models.pretrained import SafetensorsCheckpoint
from partrain.models.random_init import InitOracle
from partrain.models.shards import canonical_fqn, copy_local_shard


@torch.no_grad()
def materialize(model: nn.Module, model_cfg: ModelConfig, seed: int, device: Union[str, torch.device]) -> nn.Module:
    """Allocate `model`'s local shards on `device` and fill them; returns `model`.

    Parameters may be plain tensors or DTensors (FSDP2 / TP, any mesh). One tensor at a time, the
    full value is produced on CPU, from HF's init seeded by (seed, FQN) or from the safetensors of
    `model_cfg.pretrained`, then only this rank's part is kept (see shards.py); no collective runs,
    and a rank never holds more than one full tensor. Generating on CPU also makes the weights the
    same whatever `device` is. Buffers (rotary inv_freq) are recomputed, since meta buffers hold
    nothing. Tied weights stay tied: they are one Parameter, filled once in place.
    """
    shadow = build_meta_model(model_cfg)  # meta twin with plain (unsharded) tensors: the init oracle
    oracle = InitOracle(shadow, seed)
    # Allocates storage for local shards only; FSDP2 re-pads its shards in its _apply override.
    # to_empty gives each module its own new Parameter, which unties shared weights: re-tie them.
    shared = _shared_parameter_slots(model)
    model.to_empty(device=torch.device(device))
    _retie(shared)
    with ExitStack() as stack:
        checkpoint: Optional[SafetensorsCheckpoint] = None
        if model_cfg.pretrained:
            checkpoint = stack.enter_context(SafetensorsCheckpoint(model_cfg.pretrained, get_adapter(shadow)))
        for name, tensor, is_param in _named_tensors(model):
            fqn = canonical_fqn(name)
            if is_lora_weight(fqn):  # adapters are in neither the HF model nor its checkpoint
                copy_local_shard(tensor, lora_initial_value(fqn, tensor.shape, seed))
                continue
            full = checkpoint.value(fqn, tensor.shape) if checkpoint is not None else None
            if full is None:
                if checkpoint is not None and is_param:
                    raise ConfigError(
                        Problem(
                            "model.pretrained",
                            model_cfg.pretrained,
                            f"the checkpoint has no tensor for parameter {fqn}",
                            "use a checkpoint saved from this architecture and config",
                        )
                    )
                full = oracle.value(fqn)
            elif tuple(full.shape) != tuple(tensor.shape):
                raise ConfigError(
                    Problem(
                        "model.pretrained",
                        model_cfg.pretrained,
                        f"{fqn} has shape {tuple(full.shape)} there, the model expects {tuple(tensor.shape)}",
                        "do not override size keys in model.config when loading a pretrained folder",
                    )
                )
            copy_local_shard(tensor, full)  # copy_ casts (a bf16 checkpoint into fp32 master weights)
            del full  # drop it before the next one is made: one full tensor alive at a time
    return model


def _named_tensors(model: nn.Module) -> Iterator[Tuple[str, torch.Tensor, bool]]:
    """(name, tensor, is_parameter) for every distinct parameter, then every buffer."""
    for name, param in model.named_parameters():  # shared (tied) parameters appear once
        yield name, param, True
    for name, buffer in model.named_buffers():
        yield name, buffer, False


Slot = Tuple[nn.Module, str]


def _shared_parameter_slots(model: nn.Module) -> List[List[Slot]]:
    """(module, attribute) slots of every parameter registered in more than one place (tied weights)."""
    slots: Dict[int, List[Slot]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((module, attr))
    return [group for group in slots.values() if len(group) > 1]


def _retie(groups: List[List[Slot]]) -> None:
    """Point every slot of a group at the first slot's parameter.

    The first slot is the first in module order, as in named_parameters() and FSDP2's bookkeeping
    (whose reset after to_empty adopted that module's new parameter).
    """
    for (first_module, first_attr), *others in groups:
        param = first_module._parameters[first_attr]
        for module, attr in others:
            module._parameters[attr] = param
