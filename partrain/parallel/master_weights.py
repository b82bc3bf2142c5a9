"""16-bit parameters with fp32 master weights (train.param_dtype=16bit, zero_stage 0 and 1), as
Megatron-LM's mixed precision and distributed optimizer hold them.

Per rank and parameter (P = parameters this rank holds after TP/PP, N = the ZeRO-1 shard group):

    16-bit parameters 2P  +  fp32 gradient buffer 4P  +  fp32 master weights and Adam m, v 12P/N

(N = 1 for zero_stage 0). The model computes with its own 16-bit parameters: no autocast, no
weight copies. Each parameter group (as `optimizer.param_groups` splits them) owns one flat fp32
gradient buffer (`flat`, padded to N equal slices like `ShardedOptimizer`) and rank r's master
slice `shard` = elements [r*per_rank, (r+1)*per_rank) of the group's concatenated fp32 weights.

One step:
- backward: every microbatch's 16-bit gradient is added to the fp32 buffer as soon as autograd has
  accumulated it (a post-accumulate-grad hook) and freed, so accumulation over microbatches is fp32
  (Megatron's main_grad). Pipeline stages have no hooks: torch's schedule accumulates and scales the
  16-bit gradients itself (and the tied embedding sync reads them), they are added once per step.
- `finish_gradients`: all-reduce the fp32 buffers over dp x sp (average), then expose them: each
  parameter temporarily holds an fp32 view of its gradient as data and gradient, so the trainer's
  loss-scale unscaling and global-norm clipping (DTensor, pipeline and tied-weight aware) run
  unchanged, in fp32.
- `step`: the inner AdamW updates the master slice from the buffer's slice; the parameters get
  their 16-bit values back: cast locally (zero 0) or all-gathered in 16 bits over the shard group
  (zero 1, half the traffic of fp32). `zero_grad` restores parameters of a skipped (fp16) step.

Tensor-parallel DTensor parameters are flattened as their local shards. Checkpoints hold the fp32
master weights as the model state and the Adam state keyed per parameter (checkpoint.state), so
they resume exactly under any layout and either param_dtype.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from partrain.parallel.local_tensors import like, local, set_data
from partrain.parallel.zero1_optimizer import tensor_state_bytes


class MasterWeightOptimizer:
    """Wraps an optimizer class: fp32 master slices and their state, over 16-bit model parameters."""

    def __init__(
        self,
        param_groups: List[Dict],
        optimizer_cls,
        dtype: torch.dtype,
        shard_group: Optional[dist.ProcessGroup] = None,
        grad_group: Optional[dist.ProcessGroup] = None,
        grad_size: int = 1,
        hooks: bool = True,
        **defaults,
    ) -> None:
        self.group = shard_group
        self.world = dist.get_world_size(shard_group) if shard_group is not None else 1
        self.rank = dist.get_rank(shard_group) if shard_group is not None else 0
        self.grad_group, self.grad_size, self.dtype = grad_group, grad_size, dtype
        self.groups: List[Dict] = []
        self._where: Dict[int, tuple] = {}  # id(param) -> (group, offset, local shape)
        self._saved: Dict[int, torch.Tensor] = {}  # 16-bit data of parameters exposing fp32 gradients
        inner_groups = []
        for spec in param_groups:
            params: List[nn.Parameter] = [p for p in spec["params"] if p.requires_grad]
            g = self._new_group(params)
            self.groups.append(g)
            inner_groups.append({**{k: v for k, v in spec.items() if k != "params"}, "params": [g["shard"]]})
        self.inner = optimizer_cls(inner_groups, **defaults)
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params()] if hooks else []
        self.hooks = hooks

    def _new_group(self, params: List[nn.Parameter]) -> Dict:
        shapes = [local(p).shape for p in params]
        numel = sum(s.numel() for s in shapes)
        per_rank = -(-numel // self.world)
        device = local(params[0]).device
        weights = torch.zeros(per_rank * self.world, dtype=torch.float32, device=device)
        g = {"params": params, "numel": numel, "per_rank": per_rank}
        offset = 0
        for p, shape in zip(params, shapes):
            weights[offset : offset + shape.numel()] = local(p.detach()).reshape(-1)
            self._where[id(p)] = (g, offset, shape)
            offset += shape.numel()
        lo = self.rank * per_rank
        g["shard"] = nn.Parameter(weights[lo : lo + per_rank].clone())
        del weights
        g["flat"] = torch.zeros(per_rank * self.world, dtype=torch.float32, device=device)
        for p in params:  # the model keeps only the 16-bit values from here on
            set_data(p, p.data.to(self.dtype))
        return g

    # ---- gradients ---------------------------------------------------------------------------------

    def params(self) -> List[nn.Parameter]:
        return [p for g in self.groups for p in g["params"]]

    def _main_grad(self, p: torch.Tensor) -> torch.Tensor:
        g, offset, shape = self._where[id(p)]
        return g["flat"][offset : offset + shape.numel()].view(shape)

    @torch.no_grad()
    def _accumulate(self, p: torch.Tensor) -> None:
        grad = p.grad
        if hasattr(grad, "placements") and grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        self._main_grad(p).add_(local(grad))
        p.grad = None

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """After the step's last backward: fp32 gradients averaged over dp x sp, exposed as p.grad."""
        if not self.hooks:
            for p in self.params():
                if p.grad is not None:
                    self._accumulate(p)
        if self.grad_size > 1:
            for g in self.groups:
                with torch.profiler.record_function("partrain/dp/all_reduce"):
                    dist.all_reduce(g["flat"], group=self.grad_group)
                g["flat"].div_(self.grad_size)
        for p in self.params():
            self._saved[id(p)] = p.data
            view = like(p, self._main_grad(p))
            set_data(p, view)  # a stand-in of the gradient's dtype: p.grad must match p's dtype
            p.grad = view

    def _restore(self) -> None:
        for p in self.params():
            if id(p) in self._saved:
                p.grad = None
                set_data(p, self._saved.pop(id(p)))

    # ---- the optimizer's interface -----------------------------------------------------------------

    @property
    def param_groups(self):
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._restore()
        for g in self.groups:
            g["flat"].zero_()
            for p in g["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self._restore()
        for g in self.groups:
            lo = self.rank * g["per_rank"]
            g["shard"].grad = g["flat"][lo : lo + g["per_rank"]]
        self.inner.step()
        for g in self.groups:
            g["shard"].grad = None
            self._write_back(g)

    def _write_back(self, g: Dict) -> None:
        """The model's 16-bit parameters from the (updated) master slices."""
        if self.world == 1:
            values = g["shard"].detach()
        else:
            values = torch.empty(g["per_rank"] * self.world, dtype=self.dtype, device=g["shard"].device)
            with torch.profiler.record_function("partrain/dp/all_gather"):
                dist.all_gather_into_tensor(values, g["shard"].detach().to(self.dtype), group=self.group)
        for p in g["params"]:
            _, offset, shape = self._where[id(p)]
            local(p).copy_(values[offset : offset + shape.numel()].view(shape))

    def state_bytes(self) -> int:
        """fp32 gradient buffers, master slices and Adam state this rank holds (for the memory report)."""
        total = 0
        for g in self.groups:
            total += g["flat"].numel() * 4 + g["shard"].numel() * 4
        return total + tensor_state_bytes(self.inner)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    # ---- checkpoints: the fp32 master weights as the model state --------------------------------------

    @torch.no_grad()
    def master_model_state(self, names: Dict[int, str], template: bool = False) -> Dict[str, torch.Tensor]:
        """{fqn: fp32 weight} shaped and placed like each parameter (collective over the shard group
        unless `template`: then zeros to load into)."""
        out: Dict[str, torch.Tensor] = {}
        for g in self.groups:
            full = torch.zeros(g["per_rank"] * self.world, dtype=torch.float32, device=g["shard"].device)
            if not template and self.world > 1:
                dist.all_gather_into_tensor(full, g["shard"].detach(), group=self.group)
            elif not template:
                full.copy_(g["shard"].detach())
            for p in g["params"]:
                _, offset, shape = self._where[id(p)]
                out.setdefault(names[id(p)], like(p, full[offset : offset + shape.numel()].view(shape).clone()))
        return out

    @torch.no_grad()
    def load_master_model_state(self, names: Dict[int, str], state: Dict[str, torch.Tensor]) -> None:
        """Master slices and 16-bit parameters from loaded fp32 (or any dtype) weights keyed by fqn."""
        for g in self.groups:
            lo, hi = self.rank * g["per_rank"], (self.rank + 1) * g["per_rank"]
            for p in g["params"]:
                _, offset, shape = self._where[id(p)]
                value = local(state[names[id(p)]]).reshape(-1)
                start, end = max(lo, offset), min(hi, offset + shape.numel())
                if start < end:
                    g["shard"][start - lo : end - lo] = value[start - offset : end - offset]
                local(p).copy_(value.view(shape))


# ---- building it for a layout ------------------------------------------------------------------------


def make_master_optimizer(groups: List[Dict], mesh, zero_stage: int, optim_cfg, precision: str, hooks: bool = True):
    """The run's optimizer (optim.name) over fp32 master slices: whole for zero 0, sharded over dp_shard
    for zero 1 (as `optimizer.make_optimizer` shards ZeRO-1); gradients averaged over dp x sp."""
    from partrain.parallel.optimizer import optimizer_class

    optimizer_cls, kwargs = optimizer_class(optim_cfg)

    shard = mesh["dp_shard"].get_group() if zero_stage == 1 and mesh.size("dp_shard") > 1 else None
    grad_size = mesh.size("dp_sp")
    return MasterWeightOptimizer(
        groups,
        optimizer_cls,
        torch.bfloat16 if precision == "bf16" else torch.float16,
        shard_group=shard,
        grad_group=mesh["dp_sp"].get_group() if grad_size > 1 else None,
        grad_size=grad_size,
        hooks=hooks,
        **kwargs,
    )


def cast_frozen(modules: List[nn.Module], precision: str) -> None:
    """Parameters that do not train (the base under peft=lora) become 16-bit too: the optimizer casts
    only those it updates, and a frozen weight needs no fp32 master (2 bytes per parameter in all)."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    for module in modules:
        for p in module.parameters():
            if not p.requires_grad and p.is_floating_point():
                set_data(p, p.data.to(dtype))


def wrap(model: nn.Module, mesh, zero_stage: int, optim_cfg, precision: str):
    """`data_parallel.wrap` for 16-bit parameters: no DDP (the fp32 buffers are reduced in one
    all-reduce per group after the backward, `finish_gradients`)."""
    import contextlib

    from partrain.parallel.data_parallel import DataParallelModel
    from partrain.parallel.optimizer import param_groups

    groups = param_groups(model, optim_cfg.weight_decay)
    cast_frozen([model], precision)
    optimizer = make_master_optimizer(groups, mesh, zero_stage, optim_cfg, precision)
    return DataParallelModel(
        model, model, optimizer, lambda last: contextlib.nullcontext(), finish_gradients=optimizer.finish_gradients
    )
