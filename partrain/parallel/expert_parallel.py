"""Expert parallelism for Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE).

transformers 5 keeps a layer's routed experts fused in one module with 3-D parameters, expert
index first: `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (Mixtral, Qwen-MoE), or transposed
[E, H, 2I] and [E, I, H] with per-expert biases and interleaved gate/up columns (gpt-oss), called as
`experts(hidden, top_k_index, top_k_weights)` after the router. The module says which layout it holds
(`is_transposed`, `has_bias`; its class's `_apply_gate` combines gate and up), and its
`base_model_ep_plan` names `layers.*.mlp.experts` as the dispatch point (the adapter says the same for
families without a plan). `apply_ep` swaps each such module for `RoutedExperts`, which

- keeps experts [ep_rank*E/ep, (ep_rank+1)*E/ep) only: its parameters are DTensors Shard(0) over
  the ep mesh, under the same FQNs, so DCP saves full-model tensors and reshards across ep degrees;
- routes token copies to the owning ranks and back (moe_dispatch.py), dropless unless
  `parallel.moe_capacity_factor` is set (drops decided locally, so ep=1 drops the same tokens);
- adds the router load-balancing and z losses to the gradient (not to the reported LM loss), and
  counts tokens per expert for the metrics.

It runs for every MoE model, ep=1 included (plain parameters then, no exchange), so a layout and
its single-process reference compute the same losses. The router and the shared expert stay
dense: replicated over ep, tensor-parallel as before. Routed experts are replicated over tp.

Gradients (partrain.parallel.expert_gradients): dense parameters average over dp x sp as before;
expert parameters are summed over the expert-data-parallel group (edp, ranks holding the same
experts) and divided by the dp x sp size, because each expert's local gradient already sums the
contributions of its whole ep group.

Losses (per MoE layer l, over the layer's local tokens of one microbatch; then the mean over layers):

    aux_l = E * sum_e f_e * P_e    f_e: share of tokens routed to e (top-k, before drops),
                                   P_e: mean router probability of e (HF's load_balancing_loss_func)
    z_l   = mean_t logsumexp(router_logits_t)^2                                    (ST-MoE)
    loss  = lm_loss + aux_coef * mean_l aux_l + z_coef * mean_l z_l

The extra terms enter as gradients at each MoE block's output (a pass-through autograd Function,
as Megatron's aux-loss scaler does), so pipeline stages need no extra loss plumbing.

ZeRO-1 with expert parallelism (expert Adam state over edp): `partrain.parallel.expert_optimizer`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partrain.models.adapters import Adapter
from partrain.parallel import moe_dispatch
from partrain.parallel.compile import eager

# ---- settings and the per-run state shared by the MoE layers ----------------------------------


@dataclass
class MoESettings:
    num_experts: int
    top_k: int
    num_moe_layers: int
    """MoE layers in the whole model (the losses average over them, whatever a pipeline stage holds)."""
    capacity_factor: Optional[float] = None
    aux_coef: float = 0.0
    z_coef: float = 0.0
    bias_update_speed: float = 0.0
    """parallel.moe_bias_update_speed: how far each router's selection bias moves towards balance a step."""


ROUTER_BIAS = "e_score_correction_bias"
"""transformers' name for a router's per-expert selection bias (DeepSeek-V3 and the families built like it)."""


@dataclass
class MoERuntime:
    """What the engine, the trainer and the MoE layers share for one run (one per process)."""

    settings: MoESettings
    grad_scale: float = 1.0
    """Weight of the aux/z loss gradients in the next backward (the engine sets it like its LM loss'
    weight: 1/microbatches times the fp16 loss scale; pipelines divide by microbatches later)."""
    layers: List["RoutedExperts"] = field(default_factory=list)
    totals: Optional[torch.Tensor] = None
    """Per layer and expert, routed tokens summed over the steps so far (every rank's tokens)."""
    dropped_total: Optional[torch.Tensor] = None
    moe_layer_index: Dict[int, int] = field(default_factory=dict)
    """Decoder-layer index -> position among the model's MoE layers."""
    sp_group: Optional[object] = None
    """Context parallelism (sp > 1): the sp ProcessGroup, over which the router losses gather their
    per-expert statistics so they are those of the whole sequence, as with sp = 1."""
    sp_size: int = 1
    routers: Dict[int, nn.Module] = field(default_factory=dict)
    """This rank's routers by MoE-layer position (their selection bias is what moe_bias_update_speed moves)."""

    def local_expert_bytes(self) -> int:
        """Bytes of the expert parameters this rank holds (its local shards)."""
        total = 0
        for layer in self.layers:
            for p in layer.parameters():
                local = p.to_local() if hasattr(p, "to_local") else p
                total += local.numel() * local.element_size()
        return total

    def step_metrics(self, dp_sp_group, pp_group) -> Dict[str, object]:
        """Load statistics of the step just done, over every rank; collective on all ranks.

        One [L, 2E+3] table (routed, dropped per expert; aux, z sums; forwards), each stage filling
        its layers, summed over dp x sp (distinct tokens) and over pipeline stages (distinct layers).
        """
        s = self.settings
        E, L = s.num_experts, s.num_moe_layers
        table = torch.zeros(L, 2 * E + 3, dtype=torch.float64)
        for layer in self.layers:
            table[layer.moe_index] = layer.take_stats()
        for group in (dp_sp_group, pp_group):
            if group is not None and dist.get_world_size(group) > 1:
                table = _all_reduce_sum(table, group)
        routed, dropped = table[:, :E], table[:, E : 2 * E]
        if s.bias_update_speed:
            self._balance_biases(routed)
        forwards = table[:, -1].clamp(min=1)
        per_layer_mean = routed.mean(1).clamp(min=1e-12)
        self.totals = routed if self.totals is None else self.totals + routed
        self.dropped_total = dropped if self.dropped_total is None else self.dropped_total + dropped
        out: Dict[str, object] = {
            "moe_tokens_per_expert": [int(v) for v in routed.sum(0).tolist()],
            "moe_imbalance": float((routed.max(1).values / per_layer_mean).max()),
            "moe_aux_loss": float((table[:, -3] / forwards).mean()),
        }
        if s.z_coef:
            out["moe_z_loss"] = float((table[:, -2] / forwards).mean())
        if s.capacity_factor is not None:
            out["moe_dropped_share"] = float(dropped.sum() / routed.sum().clamp(min=1))
        return out

    @torch.no_grad()
    def _balance_biases(self, routed: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3): each router's selection bias moves by the speed
        towards balance, from the step's loads summed over every rank; every rank holding a router takes the
        same step, so the biases stay equal across tp, dp and ep."""
        speed = self.settings.bias_update_speed
        for index, router in self.routers.items():
            bias = getattr(router, ROUTER_BIAS)
            load = routed[index]
            bias.add_((speed * torch.sign(load.mean() - load)).to(bias.dtype).to(bias.device))

    def summary(self) -> Optional[dict]:
        """Expert load over the whole run, for summary.json and the CLI's table."""
        if self.totals is None:
            return None
        per_layer = self.totals
        mean = per_layer.mean(1).clamp(min=1e-12)
        out = {
            "num_experts": self.settings.num_experts,
            "top_k": self.settings.top_k,
            "tokens_per_expert": [[int(v) for v in row] for row in per_layer.tolist()],
            "imbalance_per_layer": [float(v) for v in (per_layer.max(1).values / mean).tolist()],
            "capacity_factor": self.settings.capacity_factor,
        }
        if self.settings.capacity_factor is not None and self.dropped_total is not None:
            out["dropped_share"] = float(self.dropped_total.sum() / per_layer.sum().clamp(min=1))
        return out


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    """Sum a CPU tensor over `group` (through the GPU when the group is NCCL's)."""
    if dist.get_backend(group) == "nccl":
        on_device = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(on_device, group=group)
        return on_device.cpu()
    dist.all_reduce(t, group=group)
    return t


def settings_for(model: nn.Module, adapter: Adapter, parallel) -> Optional[MoESettings]:
    """The MoE settings of a (meta) model and the run's parallel config; None for a dense model."""
    if not adapter.is_moe:
        return None
    config = model.config
    attr = experts_attr(adapter, config)
    found = [e for e in (_experts_of(layer, attr) for layer in _layers(model, adapter).values()) if e is not None]
    n_moe = len(found)
    if n_moe == 0:
        return None
    experts = found[0]
    aux = getattr(parallel, "moe_aux_loss_coef", None)
    if aux is None:
        aux = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    return MoESettings(
        num_experts=experts.gate_up_proj.shape[0],
        top_k=int(config.num_experts_per_tok),
        num_moe_layers=n_moe,
        capacity_factor=getattr(parallel, "moe_capacity_factor", None),
        aux_coef=float(aux),
        z_coef=float(getattr(parallel, "moe_z_loss_coef", 0.0) or 0.0),
        bias_update_speed=float(getattr(parallel, "moe_bias_update_speed", 0.0) or 0.0),
    )


FUSED_EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""The weights RoutedExperts computes with (each [E, ...]); with `has_bias`, also `<weight>_bias`."""
EXPERT_BIASES = tuple(f"{name}_bias" for name in FUSED_EXPERT_PARAMS)


def experts_attr(adapter: Adapter, config) -> str:
    """Where a layer's experts module is: transformers' `base_model_ep_plan` when the config class
    has one (its "ep_dispatch_experts" entry, with "grouped_gemm" weights), else the adapter."""
    plan = adapter.hf_plan(config, "ep") or {}
    prefix = adapter.layer_prefix + ".*."
    dispatch = [
        k[len(prefix) :] for k, style in plan.items() if style == "ep_dispatch_experts" and k.startswith(prefix)
    ]
    if not dispatch:
        return adapter.experts_attr
    attr = dispatch[0]
    weights = tuple(
        sorted(
            k[len(prefix) + len(attr) + 1 :]
            for k, style in plan.items()
            if style == "grouped_gemm" and k.startswith(prefix + attr + ".")
        )
    )
    if weights not in (tuple(sorted(FUSED_EXPERT_PARAMS)), tuple(sorted(FUSED_EXPERT_PARAMS + EXPERT_BIASES))):
        raise NotImplementedError(
            f"{config.model_type}: transformers' expert plan names weights {weights}; partrain's "
            f"routed experts compute with {FUSED_EXPERT_PARAMS}"
        )
    return attr


def _experts_of(layer: nn.Module, attr: str) -> Optional[nn.Module]:
    try:
        module = layer.get_submodule(attr)
    except AttributeError:  # a dense layer (Qwen2-MoE mlp_only_layers)
        return None
    return module if hasattr(module, FUSED_EXPERT_PARAMS[0]) else None


def _layers(model: nn.Module, adapter: Adapter) -> Dict[int, nn.Module]:
    """Decoder layers by their index in the full model (a pipeline stage keeps the original keys)."""
    container = adapter.layers(model)
    if isinstance(container, nn.ModuleDict):
        return {int(k): v for k, v in container.items()}
    return dict(enumerate(container))


# ---- the module ---------------------------------------------------------------------------------


class _AddLossGradient(torch.autograd.Function):
    """Identity on the MoE output; in backward also sends d(extra loss) = grad_scale into `extra`."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, extra: torch.Tensor, runtime: MoERuntime) -> torch.Tensor:
        ctx.runtime = runtime
        return output.clone()  # not a view: FSDP's pre-backward hook must stay on what leaves the module

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.runtime.grad_scale, dtype=torch.float32, device=grad.device), None


class _ScaleGradient(torch.autograd.Function):
    """Identity; multiplies the gradient by `factor` (exact for the powers of two used here)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def _in_recompute() -> bool:
    """True while autograd runs (activation recomputation re-enters forward then): count once."""
    return torch._C._current_graph_task_id() != -1


class RoutedExperts(nn.Module):
    """Drop-in for HF's fused experts module (same call, same parameter names), expert parallel."""

    def __init__(self, hf_experts: nn.Module, runtime: MoERuntime, moe_index: int, ep_mesh) -> None:
        super().__init__()
        check_expert_layout(hf_experts)
        self.gate_up_proj = hf_experts.gate_up_proj
        self.down_proj = hf_experts.down_proj
        self.has_bias = bool(getattr(hf_experts, "has_bias", False))
        if self.has_bias:
            self.gate_up_proj_bias = hf_experts.gate_up_proj_bias
            self.down_proj_bias = hf_experts.down_proj_bias
        self.is_transposed = bool(getattr(hf_experts, "is_transposed", False))
        """Weights stored [E, in, out] (x @ w), not [E, out, in] (F.linear)."""
        # What the HF class's gate reads besides the weights: its activation module and plain numbers
        # (gpt-oss: the swiglu alpha and clamp limit).
        self.act_fn = getattr(hf_experts, "act_fn", None)
        for name, value in vars(hf_experts).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not hasattr(self, name):
                setattr(self, name, value)
        self._gate_fn = type(hf_experts)._apply_gate if hasattr(type(hf_experts), "_apply_gate") else _apply_gate
        self.num_experts = self.gate_up_proj.shape[0]
        self.runtime = runtime
        self.moe_index = moe_index
        """Position among the model's MoE layers (rows of the metrics table)."""
        self.ep_mesh = ep_mesh
        self.ep = ep_mesh.size() if ep_mesh is not None else 1
        self.router_logits: Optional[torch.Tensor] = None
        """Set by a hook on the router just before this module runs."""
        self._stats = torch.zeros(2 * self.num_experts + 3, dtype=torch.float64)
        self.grad_factor = 1.0
        """Under FSDP: 1/ep, so FSDP's average over edp becomes the sum over edp / (dp x sp)."""

    def take_stats(self) -> torch.Tensor:
        stats, self._stats = self._stats, torch.zeros_like(self._stats)
        return stats

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, ep={self.ep}"

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        return p.to_local() if hasattr(p, "to_local") else p

    # Eager inside a compiled block (train.compile): routing has data-dependent shapes (rows per expert,
    # .tolist() splits) that would recompile every step, the all-to-alls are collectives, and the
    # statistics are Python state. The attention, norms and router around it stay compiled.
    @torch.compiler.disable(recursive=True)
    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        s = self.runtime.settings
        E, tokens = self.num_experts, hidden_states.shape[0]
        cap = moe_dispatch.capacity(s.capacity_factor, tokens, s.top_k, E)
        routing = moe_dispatch.route(top_k_index, E, cap)
        x = hidden_states[routing.token]
        if self.ep > 1:
            group = self.ep_mesh.get_group()
            x, recv_counts, splits = moe_dispatch.dispatch(x, routing.kept, group, self.ep)
            y = self._run_experts(x, recv_counts)
            y = moe_dispatch.combine(y, splits, group)
        else:
            y = self._run_experts(x, routing.kept.view(1, -1))
        weights = top_k_weights.reshape(-1)[routing.slot]
        y = y * weights.unsqueeze(-1)
        out = torch.zeros_like(hidden_states).index_add_(0, routing.token, y.to(hidden_states.dtype))
        logits, self.router_logits = self.router_logits, None
        counting = self.training and torch.is_grad_enabled() and not _in_recompute()
        extra = self._router_losses(logits, routing.counts, tokens, counting)
        if counting:
            st = self._stats
            st[:E] += routing.counts.double().cpu()
            st[E : 2 * E] += (routing.counts - routing.kept).double().cpu()
            st[-1] += 1
        if extra is not None and torch.is_grad_enabled():
            out = _AddLossGradient_eager(out, extra, self.runtime)
        return out

    def _run_experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: rows grouped by source then local expert; counts [sources, local experts]."""
        names = FUSED_EXPERT_PARAMS + (EXPERT_BIASES if self.has_bias else ())
        weights = [self._local(getattr(self, name)) for name in names]
        if self.grad_factor != 1.0:
            weights = [_ScaleGradient_eager(w, self.grad_factor) for w in weights]
        gate_up, down = weights[0], weights[1]
        gate_up_bias, down_bias = (weights[2], weights[3]) if self.has_bias else (None, None)
        perm = moe_dispatch.by_local_expert(counts)
        xs = x[perm]
        outs = []
        # Every local expert runs, even on no rows: each parameter then always gets a gradient
        # (zero for idle experts), so the gradient sync sees the same tensors on every rank.
        for e, chunk in enumerate(xs.split(counts.sum(0).tolist())):
            h = self._project(chunk, gate_up[e], gate_up_bias[e] if gate_up_bias is not None else None)
            h = self._gate_fn(self, h)
            outs.append(self._project(h, down[e], down_bias[e] if down_bias is not None else None))
        hidden = down.shape[-1] if self.is_transposed else down.shape[1]
        ys = torch.cat(outs) if outs else xs.new_zeros(0, hidden)
        return torch.empty_like(ys).index_copy_(0, perm, ys) if ys.numel() else ys

    def _project(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """One expert's projection in the HF module's own layout (and order of operations)."""
        if self.is_transposed:
            y = x @ weight
            return y + bias if bias is not None else y
        return F.linear(x, weight, bias)

    def _router_losses(
        self, logits: Optional[torch.Tensor], counts: torch.Tensor, tokens: int, counting: bool
    ) -> Optional[torch.Tensor]:
        s = self.runtime.settings
        if logits is None or tokens == 0:
            return None
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        logits = logits.float()
        probs = torch.softmax(logits, dim=-1)
        prob_sum = probs.sum(0)
        z_sum = torch.logsumexp(logits, dim=-1).pow(2).sum()
        counts, prob_all, z_all, total = self._whole_sequence(counts.to(probs.dtype), prob_sum, z_sum, tokens)
        # Differentiable through this rank's tokens only, times sp: averaged over the sp ranks (as
        # every gradient is), the gradient is that of the whole sequence's loss.
        size = self.runtime.sp_size
        aux = s.num_experts * torch.sum(counts / total * prob_sum / total) * size
        z = z_sum / total * size
        if counting:
            self._stats[-3] += float(s.num_experts * torch.sum(counts / total * prob_all / total))
            self._stats[-2] += float(z_all / total)
        if not (s.aux_coef or s.z_coef):
            return None
        return (s.aux_coef * aux + s.z_coef * z) / s.num_moe_layers

    def _whole_sequence(self, counts: torch.Tensor, prob_sum: torch.Tensor, z_sum: torch.Tensor, tokens: int):
        """(routed counts, router-probability sums, z sum, tokens) of the whole sequence: this rank's
        own with sp = 1, summed over the sp ranks' shards otherwise (statistics only, no gradient)."""
        if self.runtime.sp_group is None:
            return counts, prob_sum.detach(), z_sum.detach(), float(tokens)
        E = counts.shape[0]
        n = torch.tensor([float(tokens)], dtype=counts.dtype, device=counts.device)
        stats = torch.cat([counts, prob_sum.detach(), z_sum.detach().view(1), n])
        dist.all_reduce(stats, group=self.runtime.sp_group)
        return stats[:E], stats[E : 2 * E], stats[2 * E], stats[2 * E + 1]


def _apply_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' default gate: [gate | up] halves, act(gate) * up (for classes that define none)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def check_expert_layout(hf_experts: nn.Module) -> None:
    """Refuse an experts module whose computation RoutedExperts does not reproduce."""
    name = type(hf_experts).__name__
    if not getattr(hf_experts, "has_gate", True) or getattr(hf_experts, "has_post_expert_norm", False):
        raise NotImplementedError(f"{name}: partrain's routed experts compute gated experts without a post-norm")
    if getattr(hf_experts, "has_bias", False) and not all(hasattr(hf_experts, b) for b in EXPERT_BIASES):
        raise NotImplementedError(f"{name}: its biases are not named {EXPERT_BIASES}")


def _keep_router_logits(experts: RoutedExperts):
    def hook(_module, _inputs, output):
        experts.router_logits = output[0] if isinstance(output, tuple) else output

    return hook


# ---- applying it --------------------------------------------------------------------------------


def apply_ep(model: nn.Module, adapter: Adapter, ep_mesh, runtime: MoERuntime) -> List[RoutedExperts]:
    """Swap every experts module of `model` (a whole model or a pipeline stage, on meta) for a
    `RoutedExperts` holding this rank's experts. Before FSDP; after tensor parallelism."""
    from torch.distributed.tensor import DTensor, Shard

    moe_order = runtime.moe_layer_index
    swapped = []
    ep = ep_mesh.size() if ep_mesh is not None else 1
    attr_path = experts_attr(adapter, model.config)
    for index, layer in _layers(model, adapter).items():
        hf = _experts_of(layer, attr_path)
        if hf is None:
            continue
        if ep > 1:
            rank, local = ep_mesh.get_local_rank(), hf.gate_up_proj.shape[0] // ep
            for name in FUSED_EXPERT_PARAMS + (EXPERT_BIASES if getattr(hf, "has_bias", False) else ()):
                full = getattr(hf, name)
                piece = full.detach()[rank * local : (rank + 1) * local]
                setattr(hf, name, nn.Parameter(DTensor.from_local(piece, ep_mesh, [Shard(0)], run_check=False)))
        new = RoutedExperts(hf, runtime, moe_order[index], ep_mesh if ep > 1 else None)
        parent_path, _, attr = attr_path.rpartition(".")
        setattr(layer.get_submodule(parent_path) if parent_path else layer, attr, new)
        router = adapter.router(layer)
        router.register_forward_hook(_keep_router_logits(new))
        if hasattr(router, ROUTER_BIAS):
            runtime.routers[moe_order[index]] = router
        swapped.append(new)
    runtime.layers.extend(swapped)
    return swapped


def new_runtime(model: nn.Module, adapter: Adapter, parallel) -> Optional[MoERuntime]:
    """The run's MoE state from the full meta model (before any pipeline split); None if dense."""
    settings = settings_for(model, adapter, parallel)
    if settings is None:
        return None
    attr = experts_attr(adapter, model.config)
    moe_layers = [i for i, layer in sorted(_layers(model, adapter).items()) if _experts_of(layer, attr) is not None]
    return MoERuntime(settings, moe_layer_index={layer: k for k, layer in enumerate(moe_layers)})


# Run eagerly inside compiled blocks (partrain.parallel.compile.eager: collectives, Python state).
_AddLossGradient_eager = eager(_AddLossGradient.apply)
_ScaleGradient_eager = eager(_ScaleGradient.apply)
