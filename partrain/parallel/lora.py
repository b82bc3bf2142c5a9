"""LoRA adapters (`peft=lora`): rank-r A and B next to each target projection, the base frozen.

Applied to the meta model after tensor, context and expert parallelism and before recompute,
compile and FSDP (parallelize's order), so the adapters are built against the post-TP projections,
every expert parameter EP re-made is frozen, and every later wrapper treats the adapters as ordinary
(small) parameters. Each target projection (nn.Linear, HF's Conv1D of GPT-2 with W stored [in, out],
or tp_layers' column- and row-parallel versions of either) is replaced by a `LoraProjection` that
keeps the base's `weight` / `bias` under their own names (FQNs, checkpoints and HF export unchanged)
and adds PEFT's `lora_A` / `lora_B` children, so `<path>.lora_A.weight` is PEFT's adapter key minus
its `base_model.model.` prefix. Megatron-SP's column projections are adapted in place instead
(`partrain.parallel.lora_sp`: their block computes them).

Why not peft's LoraLayer: it wraps `nn.Linear` / transformers' TP styles and moves the base weight
to `<path>.base_layer.weight`, while partrain's TP projections are its own local-tensor modules and
every part of partrain (materialize, DCP checkpoints, HF export) keys tensors by the HF model's FQNs.
peft is used where it composes: the on-disk format (`checkpoint export --peft`) that
`peft.PeftModel.from_pretrained` loads.

Tensor parallelism (Megatron's rule, as peft's TP support): a column-parallel base has A replicated
and B column-sharded like the base; a row-parallel base has A row-sharded (its input is sharded) and
B replicated. The base shard and the adapter's shard are summed locally, then the one collective of
the projection runs on the sum, so the reduction order is the base's own. The adapter's replicated
weight sees only this rank's part of the gradient (A behind a column split, B behind a row split):
its gradient is summed over TP in backward (`copy_to_tp` on the weight), a tiny r x d all-reduce.
B's split is read from the base weight's placement, so GPT-2's fused c_attn (`_StridedShard`: each
rank holds its heads of q, k and v) splits B's rows the same way. Under Megatron-SP a row projection
reduce-scatters base + adapter partial sums to sequence shards, as the base alone would.

float8 (`train.float8`): the base was converted to torchao's Float8Linear (or a TP projection that
took its float8 config over) before LoRA, and replacing it would drop that. The projection keeps the
base's float8 matmuls (`float8_tp.Float8TP`: the TP one, with its amax all-reduces, or an unsharded
one) and runs the frozen base through them; the adapters' rank-r matmuls stay in high precision
(they are small, and they are what trains).
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from partrain.blueprint.config.schema import PeftConfig
from partrain.blueprint.validate_peft import lora_targets
from partrain.models.adapters import Adapter
from partrain.models.lora_init import LORA_A, LORA_B, is_lora_weight
from partrain.parallel import float8_tp
from partrain.parallel.local_tensors import local
from partrain.parallel.lora_sp import adapt_sequence_column
from partrain.parallel.megatron_sp import SequenceColumn
from partrain.parallel.tp_layers import _row_output, gather_from_tp, shard_param, split_to_tp
from partrain.parallel.tp_ops import copy_to_tp, local_fused_bias

PLAIN, COLUMN, ROW = "plain", "column", "row"


def _is_conv1d(base: nn.Module) -> bool:
    """HF's Conv1D (GPT-2) and partrain's TP versions of it: y = x @ W + b with W stored [in, out]."""
    return hasattr(base, "nf") and not isinstance(base, nn.Linear)


def _tp_kind(weight: torch.Tensor, out_dim: int) -> Tuple[str, Optional[Placement]]:
    """(COLUMN or ROW, the placement that splits B's rows like the base's output features): read from
    the base weight's own placement, so GPT-2's strided c_attn split (q, k, v heads) carries over to B."""
    place = weight.placements[0]
    if getattr(place, "dim", None) == out_dim:  # Shard or _StridedShard (not a Shard subclass)
        # B is [out, r]: the output features are its rows.
        strided = isinstance(place, _StridedShard)
        return COLUMN, _StridedShard(0, split_factor=place.split_factor) if strided else Shard(0)
    return ROW, None


class LoraProjection(nn.Module):
    """base(x) + (alpha / r) * B A dropout(x), with the base frozen and A, B trainable."""

    def __init__(self, base: nn.Module, r: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.conv = _is_conv1d(base)
        out_dim = 1 if self.conv else 0  # Conv1D W [in, out], Linear W [out, in]
        shape = base.weight.shape
        self.in_features, self.out_features = shape[1 - out_dim], shape[out_dim]
        self.weight = base.weight
        self.register_parameter("bias", base.bias)
        self.kind, b_place = PLAIN, None
        if isinstance(base.weight, DTensor) and not base.weight.placements[0].is_replicate():
            self.kind, b_place = _tp_kind(base.weight, out_dim)
            self.group, self.mesh = base.group, base.weight.device_mesh
            self.to_sequence = getattr(base, "to_sequence", False)  # Megatron-SP: reduce-scatter the sum
            # Column projections read x whole on every rank: f (copy_to_tp) enters the block once, in
            # the projection itself (GPT-2, copies_input) or before it (copy_block_input).
            self.copies_input = getattr(base, "copies_input", True)
            # transformers' colwise_gather_output / rowwise_split_input: the sum is gathered, the
            # whole input sliced, as the base alone does.
            self.gather_output = getattr(base, "gather_output", False)
            self.split_input = getattr(base, "split_input", False)
            self.fused_parts = getattr(base, "fused_parts", 1)  # GPT-2's c_attn: its bias stays whole
        elif not isinstance(base, nn.Linear) and not self.conv:
            raise NotImplementedError(f"LoRA on {type(base).__name__}")
        # float8: the base's own float8 matmuls (its TP module's, or made here for a plain Float8Linear).
        self.float8 = getattr(base, "float8", None) or float8_tp.for_projection(base, None, float8_tp.WHOLE)
        device = base.weight.device
        setattr(self, LORA_A, nn.Linear(self.in_features, r, bias=False, device=device))
        setattr(self, LORA_B, nn.Linear(r, self.out_features, bias=False, device=device))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / r
        self.lora_enabled = True
        """False inside `adapters_disabled`: the projection is its frozen base alone."""
        if self.kind != PLAIN:
            mesh = base.weight.device_mesh
            a_place, b_place = (Replicate(), b_place) if self.kind == COLUMN else (Shard(1), Replicate())
            shard_param(self.lora_A, "weight", mesh, a_place)
            shard_param(self.lora_B, "weight", mesh, b_place)

    def _local_bias(self) -> Optional[torch.Tensor]:
        if self.bias is None:
            return None
        if self.kind == COLUMN and self.fused_parts > 1:
            return local_fused_bias(self.bias, self.group, self.fused_parts)
        return local(self.bias)

    def _base(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        w = local(self.weight)
        if self.float8 is not None:
            return self.float8.linear(x, w, bias)
        if not self.conv:
            return F.linear(x, w, bias)
        out = x @ w
        return out if bias is None else out + bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == COLUMN and self.copies_input:
            x = copy_to_tp(x, self.group)
        if self.kind == ROW and self.split_input:
            x = split_to_tp(x, self.group)
        delta = self._delta(x) if self.lora_enabled else 0.0
        if self.kind != ROW:
            out = self._base(x, self._local_bias()) + delta
            return gather_from_tp(out, self.group) if self.kind == COLUMN and self.gather_output else out
        return _row_output(self._base(x, None) + delta, self.bias, self.mesh, self.group, self.to_sequence)

    def _delta(self, x: torch.Tensor) -> torch.Tensor:
        a, b = local(self.lora_A.weight), local(self.lora_B.weight)
        if self.kind == COLUMN:
            a = copy_to_tp(a, self.group)  # replicated A: each rank's gradient covers its B columns only
        elif self.kind == ROW:
            b = copy_to_tp(b, self.group)  # replicated B: each rank's gradient covers its partial sum only
        return F.linear(F.linear(self.lora_dropout(x), a), b) * self.scaling


@contextlib.contextmanager
def adapters_disabled(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Every LoRA projection of `modules` computes its frozen base alone inside this block: the base model,
    which DPO under LoRA takes as its reference (no second copy of the weights)."""
    # LoraProjections, and Megatron-SP's column projections adapted in place (partrain.parallel.lora_sp).
    projections = [m for module in modules for m in module.modules() if hasattr(m, LORA_A)]
    for projection in projections:
        projection.lora_enabled = False
    try:
        yield
    finally:
        for projection in projections:
            projection.lora_enabled = True


def _layers(module: nn.Module, adapter: Adapter) -> Iterable[nn.Module]:
    layers = adapter.layers(module)
    return layers.values() if isinstance(layers, nn.ModuleDict) else layers


def apply_lora(module: nn.Module, adapter: Adapter, peft: PeftConfig, arch: str) -> int:
    """Adapt the target projections of `module`'s decoder layers and freeze everything else (embeddings,
    norms, head included); returns the number of adapted projections (0 with peft.method=none)."""
    if peft.method != "lora":
        return 0
    targets = set(lora_targets(arch, peft.target_modules))
    adapted = 0
    for layer in _layers(module, adapter):
        for path, child in list(layer.named_modules()):
            owner_path, _, leaf = path.rpartition(".")
            if leaf not in targets:
                continue
            owner = layer.get_submodule(owner_path) if owner_path else layer
            if isinstance(child, SequenceColumn):  # its block's Megatron-SP hook computes it: adapt in place
                b_place = _tp_kind(child.weight, 1 if child.conv else 0)[1]
                adapt_sequence_column(child, owner, peft.r, peft.alpha, peft.dropout, b_place)
            else:
                setattr(owner, leaf, LoraProjection(child, peft.r, peft.alpha, peft.dropout))
            adapted += 1
    freeze_base(module)
    return adapted


def freeze_base(module: nn.Module) -> None:
    """Only adapter weights train: the base's parameters get no gradient and no optimizer state."""
    for name, param in module.named_parameters():
        param.requires_grad_(is_lora_weight(name))


def trainable_count(module: nn.Module, only: Optional[bool] = True) -> int:
    """Elements of `module`'s parameters that train (only=True), are frozen (False) or all (None)."""
    return sum(p.numel() for p in module.parameters() if only is None or p.requires_grad == only)
