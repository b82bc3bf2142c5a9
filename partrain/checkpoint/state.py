"""The FQN-keyed state of one rank, identical in meaning under every layout.

What DCP saves (and loads into) is one dict::

    {"model": {fqn: tensor},                       # get_model_state_dict of every model part
     "optim": {"state.<fqn>.exp_avg": tensor,      # get_optimizer_state_dict(..., flatten=True)
               "state.<fqn>.exp_avg_sq": tensor,
               "state.<fqn>.step": 0-d tensor,
               "param_groups.<fqn>.lr": 0.001, ...}}

FQNs are those of the plain Hugging Face model (`model.layers.3.mlp.up_proj.weight`) whatever wraps
it (DDP, FSDP2, TP DTensors, a pipeline stage module holding some layers). Tensors are DTensors
where the layout shards them; DCP writes each rank's piece and reassembles any other layout's
pieces on load. The flattened optimizer form (torchtitan's choice) keys hyperparameters per
parameter too, so parameter groups need not line up between layouts, and the state of several
model parts merges by plain dict union.

Three cases `torch.distributed.checkpoint.state_dict` does not cover are handled here:

- ZeRO-1 (`ShardedOptimizer`): see `zero1.py` (same keys, full per-parameter tensors).
- 16-bit parameters (`MasterWeightOptimizer`): its Adam state as ZeRO-1's, and the model section
  holds its fp32 master weights (not the 16-bit parameters), so a resume is exact under any layout.
- One optimizer over several pipeline stage modules: torch's functions want one module that owns
  all of the optimizer's parameters; `_optimizer_state_by_fqn` does the same id -> FQN mapping over
  all parts.
- GPT-2's fused QKV under tensor parallelism is a `_StridedShard` DTensor whose rank piece is
  three separate column blocks, which DCP cannot describe (it rejects the plan: "overlapping
  chunks"). Such tensors are saved as full tensors (gathered at save time) and loaded into a full
  buffer whose rank slice is then copied back (`Gathered`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from partrain.checkpoint import zero1_state as zero1
from partrain.models.shards import copy_local_shard, param_fqns
from partrain.parallel.expert_optimizer import ExpertSplitOptimizer
from partrain.parallel.master_weights import MasterWeightOptimizer
from partrain.parallel.zero1_optimizer import ShardedOptimizer

MODEL = "model"
OPTIM = "optim"
_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# ---- model -------------------------------------------------------------------------------------


def model_state(parts: Sequence[nn.Module]) -> Dict[str, Any]:
    """FQN -> tensor over all parts; a key held by two parts (a tied copy) is taken once."""
    merged: Dict[str, Any] = {}
    for part in parts:
        for key, value in get_model_state_dict(part).items():
            merged.setdefault(key, value)
    return merged


def set_model_state(parts: Sequence[nn.Module], state: Dict[str, Any]) -> None:
    for part in parts:
        mine = get_model_state_dict(part)
        set_model_state_dict(part, {k: state[k] for k in mine})


# ---- optimizer ---------------------------------------------------------------------------------


def _optimizers(parts: Sequence[nn.Module], optimizer: Any) -> List[Any]:
    if isinstance(optimizer, (list, tuple)):
        if len(optimizer) != len(parts):
            raise ValueError(
                f"{len(optimizer)} optimizers for {len(parts)} model parts: pass one optimizer, or one per part"
            )
        return list(optimizer)
    return [optimizer]


def optimizer_state(parts: Sequence[nn.Module], optimizer: Any, template: bool = False) -> Dict[str, Any]:
    """The flattened FQN-keyed optimizer state (format of get_optimizer_state_dict(flatten=True)).

    template=True: only something of the right keys and shapes to load into (ZeRO-1 then skips
    gathering its state).
    """
    if optimizer is None:
        return {}
    if isinstance(optimizer, ExpertSplitOptimizer):  # ZeRO-1 with expert parallelism: both halves
        return {
            **optimizer_state(parts, optimizer.dense, template),
            **optimizer.experts.full_state(param_fqns(parts), template),
        }
    optimizers = _optimizers(parts, optimizer)
    if isinstance(optimizers[0], (ShardedOptimizer, MasterWeightOptimizer)):
        if len(optimizers) != 1:
            raise ValueError("pass one ShardedOptimizer for all model parts")
        return zero1.empty_full_state(parts, optimizers[0]) if template else zero1.full_state(parts, optimizers[0])
    if len(optimizers) == len(parts):  # one optimizer per part (or one part): torch's own function
        merged: Dict[str, Any] = {}
        for part, opt in zip(parts, optimizers):
            _ensure_adam_state(opt)
            for key, value in get_optimizer_state_dict(part, opt, options=_FLAT).items():
                merged.setdefault(key, value)
        return merged
    return _optimizer_state_by_fqn(parts, optimizers[0])


def set_optimizer_state(parts: Sequence[nn.Module], optimizer: Any, state: Dict[str, Any]) -> None:
    if optimizer is None:
        return
    if isinstance(optimizer, ExpertSplitOptimizer):
        set_optimizer_state(parts, optimizer.dense, state)
        optimizer.experts.load_full_state(param_fqns(parts), state)
        return
    optimizers = _optimizers(parts, optimizer)
    if isinstance(optimizers[0], (ShardedOptimizer, MasterWeightOptimizer)):
        zero1.load_full_state(parts, optimizers[0], state)
    elif len(optimizers) == len(parts):
        for part, opt in zip(parts, optimizers):
            _ensure_adam_state(opt)
            set_optimizer_state_dict(part, opt, state, options=_FLAT)
    else:
        _load_optimizer_state_by_fqn(parts, optimizers[0], state)


def _groups_by_fqn(
    optimizer: torch.optim.Optimizer, names: Dict[int, str]
) -> List[Tuple[Dict[str, Any], List[Tuple[str, nn.Parameter]]]]:
    out = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that none of the model parts has")
            params.append((names[id(p)], p))
        out.append(({k: v for k, v in group.items() if k != "params"}, params))
    return out


@torch.no_grad()
def _ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state before its first step, exactly what the optimizer
    creates lazily, so the next real step computes the same update: AdamW's zero moments and step 0;
    SGD's zero momentum buffer (its first step then gives grad, as torch's clone of the gradient does,
    dampening being 0); nothing for SGD without momentum.

    torch's `_init_optim_state` instead runs a step with zero gradients and lr 0, which leaves
    step = 1 (changing Adam's bias correction) and does nothing while gradients exist: a
    checkpoint taken before the first real step (fp16 skips overflowing steps) would then lack
    the optimizer keys a resume asks for."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad or optimizer.state.get(p):
                continue
            zeros = lambda p=p: torch.zeros_like(p, memory_format=torch.preserve_format)
            if isinstance(optimizer, torch.optim.SGD):
                if group.get("momentum"):
                    optimizer.state[p] = {"momentum_buffer": zeros()}
                continue
            # fused AdamW keeps its step counter on the parameter's device.
            step_device = p.device if group.get("fused") or group.get("capturable") else "cpu"
            state = {"step": torch.tensor(0.0, device=step_device), "exp_avg": zeros(), "exp_avg_sq": zeros()}
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = zeros()
            optimizer.state[p] = state


def _optimizer_state_by_fqn(parts: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """One optimizer over several parts: what get_optimizer_state_dict(flatten=True) gives for one part."""
    _ensure_adam_state(optimizer)
    flat: Dict[str, Any] = {}
    for hyper, params in _groups_by_fqn(optimizer, param_fqns(parts)):
        for fqn, p in params:
            for name, value in optimizer.state.get(p, {}).items():
                flat.setdefault(f"state.{fqn}.{name}", value)
            for k, v in hyper.items():
                flat.setdefault(f"param_groups.{fqn}.{k}", v)
    return flat


def _load_optimizer_state_by_fqn(
    parts: Sequence[nn.Module], optimizer: torch.optim.Optimizer, flat: Dict[str, Any]
) -> None:
    _ensure_adam_state(optimizer)
    groups, state, index = [], {}, 0
    for hyper, params in _groups_by_fqn(optimizer, param_fqns(parts)):
        ids = []
        for fqn, p in params:
            names = list(optimizer.state.get(p, {}))
            if names:
                state[index] = {name: flat[f"state.{fqn}.{name}"] for name in names}
            ids.append(index)
            index += 1
        groups.append({**{k: flat.get(f"param_groups.{params[0][0]}.{k}", v) for k, v in hyper.items()}, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# ---- DTensors DCP cannot describe ----------------------------------------------------------------


def dcp_can_describe(t: DTensor) -> bool:
    """Whether each rank's piece of `t` is one box of the global tensor, as DCP needs.

    True for Shard/Replicate placements and for FSDP2's strided shard over a tensor-parallel shard
    of the same dim (a _StridedShard followed on a later mesh dim by a plain Shard of that dim).
    False for any other _StridedShard (GPT-2's fused QKV). Decided from placements only, so every
    rank decides the same.
    """
    placements = list(t.placements)
    for i, p in enumerate(placements):
        if not isinstance(p, _StridedShard):
            continue
        later = [(j, q) for j, q in enumerate(placements) if j > i and isinstance(q, Shard) and q.dim == p.dim]
        if not later or any(isinstance(q, _StridedShard) for _, q in later):
            return False
        later_size = 1
        for j, _ in later:
            later_size *= t.device_mesh.size(j)
        if p.split_factor != later_size:
            return False
    return True


@dataclass
class Gathered:
    """A DTensor stored as a full tensor: saved gathered, loaded into `full` then sliced back."""

    target: DTensor
    full: torch.Tensor


@dataclass
class RankState:
    """This rank's DCP state dict, plus the tensors to slice back into place after a load."""

    state: Dict[str, Dict[str, Any]]
    gathered: List[Gathered] = field(default_factory=list)

    def finish_load(self) -> None:
        for g in self.gathered:
            copy_local_shard(g.target, g.full)
            for section in self.state.values():  # hand the DTensor (now filled) to set_*_state
                for key, value in section.items():
                    if value is g.full:
                        section[key] = g.target


def for_dcp(sections: Dict[str, Dict[str, Any]], for_save: bool) -> RankState:
    """Replace DTensors DCP cannot describe by full tensors (gathered for a save, empty for a load)."""
    out = RankState({name: dict(section) for name, section in sections.items()})
    for section in out.state.values():
        for key, value in section.items():
            if isinstance(value, DTensor) and not dcp_can_describe(value):
                full = (
                    value.full_tensor()
                    if for_save
                    else torch.empty(value.shape, dtype=value.dtype, device=value.to_local().device)
                )
                out.gathered.append(Gathered(value, full))
                section[key] = full
    return out


def rank_state(parts: Sequence[nn.Module], optimizer: Any, for_save: bool) -> RankState:
    """{"model": ..., "optim": ...} for this rank, ready for dcp.save / dcp.load."""
    model = model_state(parts)
    if isinstance(optimizer, MasterWeightOptimizer):  # 16-bit parameters: save and load the fp32 masters
        model.update(optimizer.master_model_state(param_fqns(parts), template=not for_save))
    return for_dcp({MODEL: model, OPTIM: optimizer_state(parts, optimizer, template=not for_save)}, for_save)


def apply_loaded(parts: Sequence[nn.Module], optimizer: Any, loaded: RankState) -> None:
    """After dcp.load filled `loaded`: slice gathered tensors back and set model and optimizer state."""
    loaded.finish_load()
    set_model_state(parts, loaded.state[MODEL])
    if isinstance(optimizer, MasterWeightOptimizer):
        optimizer.load_master_model_state(param_fqns(parts), loaded.state[MODEL])
    set_optimizer_state(parts, optimizer, loaded.state[OPTIM])
