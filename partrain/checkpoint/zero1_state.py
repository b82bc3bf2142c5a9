"""ZeRO-1 optimizer state <-> the FQN-keyed form every other layout saves.

`partrain.parallel.zero1_optimizer.ShardedOptimizer` keeps, per parameter group, one flat buffer cut into
equal slices; rank r's inner AdamW holds state (exp_avg, exp_avg_sq, step) for slice r only. Its
state is not keyed by parameter, so `get_optimizer_state_dict` cannot describe it. Here:

- `full_state` all-gathers each state buffer over the shard group and cuts it into per-parameter
  tensors of the parameters' shapes, keyed exactly as `get_optimizer_state_dict(...,
  flatten_optimizer_state_dict=True)` keys a plain AdamW (`state.<fqn>.exp_avg`, ...,
  `param_groups.<fqn>.lr`, ...). Every rank of the shard group then holds the same full tensors
  (plain tensors, so DCP writes them once). This costs the full optimizer state in memory for the
  duration of a save.
- `empty_full_state` is the template a load fills: full-shape tensors per parameter.
- `load_full_state` keeps this rank's slice of the loaded full tensors and hands it to the inner
  optimizer (`load_state_dict`), so any layout's checkpoint resumes under ZeRO-1 and back.

Tensor-parallel parameters (DTensors) are flattened as their local shards; their state tensors are
DTensors shaped and placed like the parameter, so DCP reassembles them for any other layout.
Only public attributes of ShardedOptimizer are used (groups, inner, rank, world, group), which
`partrain.parallel.master_weights.MasterWeightOptimizer` has too (its "flat" is the fp32 gradient buffer).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from partrain.models.shards import param_fqns
from partrain.parallel.local_tensors import like, local

STATE_NAMES = ("exp_avg", "exp_avg_sq")
"""Per-element state of the inner optimizer (AdamW); `step` is one scalar per group."""


def _layout(
    parts: Sequence[nn.Module], optimizer
) -> Iterator[Tuple[int, Dict[str, Any], List[Tuple[str, torch.Tensor, int]]]]:
    """(group index, group, [(fqn, param, offset in the flat buffer)]) for every parameter group."""
    names = param_fqns(parts)
    for gi, g in enumerate(optimizer.groups):
        entries, offset = [], 0
        for p in g["params"]:
            if id(p) not in names:
                raise ValueError("the ZeRO-1 optimizer holds a parameter that none of the model parts has")
            entries.append((names[id(p)], p, offset))
            offset += local(p).numel()
        yield gi, g, entries


def _hyper(optimizer, gi: int) -> Dict[str, Any]:
    return {k: v for k, v in optimizer.inner.param_groups[gi].items() if k != "params"}


def _group_state(optimizer, g: Dict[str, Any]) -> Dict[str, torch.Tensor]:
    return optimizer.inner.state.get(g["shard"], {})


@torch.no_grad()
def full_state(parts: Sequence[nn.Module], optimizer) -> Dict[str, Any]:
    """Full per-parameter optimizer state (collective over the optimizer's shard group)."""
    flat: Dict[str, Any] = {}
    for gi, g, entries in _layout(parts, optimizer):
        state = _group_state(optimizer, g)
        gathered = {}
        for name in STATE_NAMES:
            shard = state.get(name)
            if shard is None:  # no step taken yet: zeros, as a fresh AdamW after its first (zero) step
                shard = torch.zeros_like(g["shard"])
            out = torch.empty(g["per_rank"] * optimizer.world, dtype=shard.dtype, device=shard.device)
            if optimizer.world > 1:
                dist.all_gather_into_tensor(out, shard.detach().contiguous(), group=optimizer.group)
            else:
                out.copy_(shard)
            gathered[name] = out
        step = state.get("step", torch.zeros((), dtype=torch.float32))
        for fqn, p, offset in entries:
            for name in STATE_NAMES:
                piece = local(p)
                value = gathered[name][offset : offset + piece.numel()].view_as(piece).clone()
                flat[f"state.{fqn}.{name}"] = like(p, value)
            flat[f"state.{fqn}.step"] = step.detach().clone()
        for fqn, _, _ in entries:
            for k, v in _hyper(optimizer, gi).items():
                flat[f"param_groups.{fqn}.{k}"] = v
    return flat


def empty_full_state(parts: Sequence[nn.Module], optimizer) -> Dict[str, Any]:
    """The template a DCP load fills: zeros of every parameter's full shape, and the hyperparameters."""
    flat: Dict[str, Any] = {}
    for gi, g, entries in _layout(parts, optimizer):
        for fqn, p, _ in entries:
            for name in STATE_NAMES:
                zeros = torch.zeros(local(p).shape, dtype=g["flat"].dtype, device=g["flat"].device)
                flat[f"state.{fqn}.{name}"] = like(p, zeros)
            flat[f"state.{fqn}.step"] = torch.zeros((), dtype=torch.float32)
            for k, v in _hyper(optimizer, gi).items():
                flat[f"param_groups.{fqn}.{k}"] = v
    return flat


@torch.no_grad()
def load_full_state(parts: Sequence[nn.Module], optimizer, flat: Dict[str, Any]) -> None:
    """Keep this rank's slice of full per-parameter state; hyperparameters come from `flat` if present."""
    inner_state: Dict[int, Dict[str, torch.Tensor]] = {}
    groups = []
    for gi, g, entries in _layout(parts, optimizer):
        lo, hi = optimizer.rank * g["per_rank"], (optimizer.rank + 1) * g["per_rank"]
        slices = {
            name: torch.zeros(g["per_rank"], dtype=g["flat"].dtype, device=g["flat"].device) for name in STATE_NAMES
        }
        steps = set()
        for fqn, p, offset in entries:
            start, end = max(lo, offset), min(hi, offset + local(p).numel())
            steps.add(float(flat[f"state.{fqn}.step"]))
            if start >= end:
                continue
            for name in STATE_NAMES:
                full = flat[f"state.{fqn}.{name}"]
                if tuple(full.shape) != tuple(p.shape):
                    raise ValueError(
                        f"optimizer state {fqn}.{name} has shape {tuple(full.shape)}, the parameter {tuple(p.shape)}"
                    )
                slices[name][start - lo : end - lo] = local(full).reshape(-1)[start - offset : end - offset]
        if len(steps) > 1:
            raise ValueError(f"parameters of one ZeRO-1 group were saved at different optimizer steps {sorted(steps)}")
        step = steps.pop() if steps else 0.0
        inner_state[gi] = {"step": torch.tensor(step, dtype=torch.float32), **slices}
        hyper = _hyper(optimizer, gi)
        first = entries[0][0] if entries else None
        groups.append({**{k: flat.get(f"param_groups.{first}.{k}", v) for k, v in hyper.items()}, "params": [gi]})
    optimizer.inner.load_state_dict({"state": inner_state, "param_groups": groups})
