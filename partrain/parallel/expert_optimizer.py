"""ZeRO-1 with expert parallelism: dense Adam state sharded over dp_shard as usual (`ShardedOptimizer`),
the expert shards' Adam state sharded over their expert-data-parallel group (edp), under one
optimizer interface the trainer and checkpoints use."""

from __future__ import annotations

from typing import Dict

import torch
import torch.distributed as dist
from torch import nn

from partrain.parallel.zero1_optimizer import tensor_state_bytes


class ExpertShardOptimizer:
    """ZeRO-1 for the expert shards over edp (the ranks holding the same experts).

    Like `ShardedOptimizer`, per parameter group the local expert tensors are seen as one flat
    vector cut into equal slices; this rank's inner AdamW holds state for its slice only (a copy
    of the slice is its parameter), and after the step the slices are all-gathered over edp and
    written back into the local tensors. Checkpoints see per-parameter DTensors (Shard(0) over ep)
    under the usual keys, so they reshard like any other layout's expert state.
    """

    def __init__(self, param_groups, group, make_inner) -> None:
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.groups, inner_groups = [], []
        for spec in param_groups:
            params = [p for p in spec["params"] if p.requires_grad]
            numel = sum(_local_of(p).numel() for p in params)
            per_rank = -(-numel // self.world)
            shard = nn.Parameter(
                self._flat(params, use_grad=False)[self.rank * per_rank : (self.rank + 1) * per_rank].clone()
            )
            self.groups.append({"params": params, "numel": numel, "per_rank": per_rank, "shard": shard})
            inner_groups.append({**{k: v for k, v in spec.items() if k != "params"}, "params": [shard]})
        self.inner = make_inner(inner_groups)

    def _flat(self, params, use_grad: bool) -> torch.Tensor:
        """The group's local tensors (or gradients) as one vector, zero-padded to world slices."""
        parts = []
        for p in params:
            t = p.grad if use_grad else p
            parts.append(_local_of(p).new_zeros(_local_of(p).numel()) if t is None else _local_of(t).reshape(-1))
        flat = torch.cat(parts) if parts else torch.zeros(0)
        pad = -(-flat.numel() // self.world) * self.world - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat

    @property
    def param_groups(self):
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for g in self.groups:
            for p in g["params"]:
                p.grad = None
            g["shard"].grad = None

    @torch.no_grad()
    def step(self) -> None:
        for g in self.groups:
            lo, hi = self.rank * g["per_rank"], (self.rank + 1) * g["per_rank"]
            # The slice is a copy: refresh it from the parameters (a checkpoint load writes those).
            g["shard"].copy_(self._flat(g["params"], use_grad=False)[lo:hi])
            g["shard"].grad = self._flat(g["params"], use_grad=True)[lo:hi].clone()
        self.inner.step()
        for g in self.groups:
            g["shard"].grad = None
            self._scatter_back(g["params"], self._gather(g["shard"].detach()))

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return shard.clone()
        out = shard.new_empty(shard.numel() * self.world)
        dist.all_gather_into_tensor(out, shard.contiguous().clone(), group=self.group)
        return out

    @staticmethod
    def _scatter_back(params, flat: torch.Tensor, into=None) -> None:
        offset = 0
        for i, p in enumerate(params):
            local = _local_of(p) if into is None else into[i]
            local.copy_(flat[offset : offset + local.numel()].view_as(local))
            offset += local.numel()

    def state_bytes(self) -> int:
        return tensor_state_bytes(self.inner)

    # -- checkpoints: the same keys as a plain AdamW over the expert DTensors ---------------------
    @torch.no_grad()
    def full_state(self, names: Dict[int, str], template: bool = False) -> Dict[str, object]:
        """{state.<fqn>.exp_avg / exp_avg_sq / step, param_groups.<fqn>.<hyper>}; collective over edp."""
        from torch.distributed.tensor import DTensor

        flat: Dict[str, object] = {}
        for gi, g in enumerate(self.groups):
            state = self.inner.state.get(g["shard"], {})
            hyper = {k: v for k, v in self.inner.param_groups[gi].items() if k != "params"}
            for name in ("exp_avg", "exp_avg_sq"):
                shard = state.get(name)
                full = self._gather(torch.zeros_like(g["shard"]) if shard is None or template else shard)
                locals_ = [torch.empty_like(_local_of(p)) for p in g["params"]]
                self._scatter_back(g["params"], full, into=locals_)
                for p, local in zip(g["params"], locals_):
                    flat[f"state.{names[id(p)]}.{name}"] = DTensor.from_local(
                        local, p.device_mesh, p.placements, run_check=False
                    )
            step = state.get("step", torch.zeros((), dtype=torch.float32))
            for p in g["params"]:
                flat[f"state.{names[id(p)]}.step"] = step.detach().clone()
                for k, v in hyper.items():
                    flat[f"param_groups.{names[id(p)]}.{k}"] = v
        return flat

    @torch.no_grad()
    def load_full_state(self, names: Dict[int, str], flat: Dict[str, object]) -> None:
        state, groups = {}, []
        for gi, g in enumerate(self.groups):
            lo, hi = self.rank * g["per_rank"], (self.rank + 1) * g["per_rank"]
            entry = {}
            for name in ("exp_avg", "exp_avg_sq"):
                values = [flat[f"state.{names[id(p)]}.{name}"] for p in g["params"]]
                vec = self._flat_values(values)
                entry[name] = vec[lo:hi].clone()
            entry["step"] = torch.as_tensor(
                flat[f"state.{names[id(g['params'][0])]}.step"], dtype=torch.float32
            ).clone()
            state[gi] = entry
            hyper = {
                k: flat.get(f"param_groups.{names[id(g['params'][0])]}.{k}", v)
                for k, v in self.inner.param_groups[gi].items()
                if k != "params"
            }
            groups.append({**hyper, "params": [gi]})
        self.inner.load_state_dict({"state": state, "param_groups": groups})

    def _flat_values(self, values) -> torch.Tensor:
        flat = torch.cat([_local_of(v).reshape(-1) for v in values])
        pad = -(-flat.numel() // self.world) * self.world - flat.numel()
        return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def _local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ExpertSplitOptimizer:
    """ZeRO-1 under expert parallelism: the dense parameters' state sharded over dp_shard by a
    `ShardedOptimizer` (they are the same on every dp x sp rank), the expert shards (different on
    each ep rank, already 1/ep of the experts) by an `ExpertShardOptimizer` over edp.

    The trainer sees one optimizer (param_groups, zero_grad, step, state_bytes); checkpoints save
    both halves under the same per-parameter FQN keys as any other layout (checkpoint/state.py).
    """

    def __init__(self, dense, experts: torch.optim.Optimizer) -> None:
        self.dense = dense
        self.experts = experts

    @property
    def param_groups(self):
        return [*self.dense.param_groups, *self.experts.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dense.zero_grad(set_to_none)
        self.experts.zero_grad(set_to_none)

    def step(self) -> None:
        self.dense.step()
        self.experts.step()

    def state_bytes(self) -> int:
        return self.dense.state_bytes() + self.experts.state_bytes()


def is_expert_shard(p: torch.Tensor) -> bool:
    """An expert parameter sharded over the ep mesh (ZeRO-1 refuses tensor parallelism, so under
    ZeRO-1 these are the only DTensor parameters)."""
    mesh = getattr(p, "device_mesh", None)
    return mesh is not None and mesh.mesh_dim_names == ("ep",)


def zero1_optimizer(groups, make_sharded, make_experts) -> ExpertSplitOptimizer:
    """Split parameter groups into dense (-> make_sharded) and expert shards (-> make_experts)."""
    dense, experts = [], []
    for g in groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        d = [p for p in g["params"] if not is_expert_shard(p)]
        e = [p for p in g["params"] if is_expert_shard(p)]
        if d:
            dense.append({**hyper, "params": d})
        if e:
            experts.append({**hyper, "params": e})
    return ExpertSplitOptimizer(make_sharded(dense), make_experts(experts))
