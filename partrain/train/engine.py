"""How one optimizer step's forward and backward run: directly (microbatch loop) or through a
pipeline schedule. The trainer talks to either through the same small interface.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, List, Optional, Protocol

import torch
from torch import nn
from torch.profiler import record_function

from partrain.models.loss import forward_loss, label_weight
from partrain.parallel.data_parallel import DataParallelModel
from partrain.parallel.grad_norm import clip_gradients
from partrain.runtime.cuda_defaults import to_device
from partrain.train.preference import sequence_logps


def autocast_context(precision: str, device_type: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device_type, dtype=dtype)


def local_scalar(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (loss parallel) as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Engine(Protocol):
    """What the trainer needs from one optimizer step's forward and backward, however it runs."""

    optimizer: torch.optim.Optimizer
    moe: Optional[Any]
    """MoE models: the routed-experts runtime (`expert_parallel.MoERuntime`: router losses, load
    metrics); None otherwise."""

    @property
    def model_parts(self) -> List[nn.Module]:
        """The modules this rank trains (one model, or its pipeline stages), for checkpoints and metrics."""
        ...

    def forward_backward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        loss_scale: float = 1.0,
        label_share: Optional[float] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> Optional[float]:
        """Gradients of the step's mean loss times `loss_scale`; the unscaled mean loss where this
        rank sees it (None on pipeline ranks without the last stage). `label_share`: labelled tokens
        per row over the global batch when labels are masked (fine-tuning examples): the mean is then
        over the global batch's labelled tokens, not a mean of microbatch means (`label_weight`).
        `position_ids` [B, S]: packed examples' positions (restarting per example, which also keeps
        attention inside each example); None = 0..S-1."""
        ...

    def clip(self, max_norm: float) -> float:
        """The global gradient norm (over every shard, stage and replica), clipped to max_norm if > 0."""
        ...

    def share_loss(self, value: Optional[float]) -> float:
        """The step's loss on every rank of this replica."""
        ...

    def eval_loss(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        label_share: Optional[float] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> Optional[float]:
        """Mean loss of a forward-only pass over the batch (over its labelled tokens: `label_share`)."""
        ...


def _split(t: Optional[torch.Tensor], size: int, count: int) -> list:
    """`t` split into microbatches of `size` rows, or `count` Nones."""
    return list(t.split(size)) if t is not None else [None] * count


def _position_kwargs(position_ids: Optional[torch.Tensor], device: torch.device) -> dict:
    return {} if position_ids is None else {"position_ids": to_device(position_ids, device)}


class DirectEngine:
    """No pipeline: this rank runs the whole (TP/FSDP/DDP-wrapped) model over its microbatches."""

    moe = None
    """MoE models: expert_parallel.MoERuntime (router-loss gradient weight, expert-load metrics)."""
    preference = None
    """train.objective=dpo or simpo: the PreferenceObjective computing the loss (its per-step metrics)."""
    label_group = None
    """Sequence parallelism: the sp group, over which a microbatch's labelled tokens are counted
    (each sp rank holds a slice of the labels; `label_weight`)."""

    def __init__(
        self,
        dp: DataParallelModel,
        micro_batch_size: int,
        precision: str,
        device: torch.device,
        loss_context: Callable[[], ContextManager],
        forward_loss: Callable = forward_loss,
    ) -> None:
        self.dp = dp
        self.forward_loss = forward_loss
        """forward_loss(model, inputs, labels) -> loss (context parallelism passes its own)."""
        self.optimizer = dp.optimizer
        self.micro_batch_size = micro_batch_size
        self.precision = precision
        self.device = device
        self.loss_context = loss_context

    @property
    def model_parts(self) -> List[nn.Module]:
        return [self.dp.inner]

    def forward_backward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        loss_scale: float = 1.0,
        label_share: Optional[float] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> Optional[float]:
        """Gradients of the step's mean loss times `loss_scale` (fp16); returns the unscaled mean loss."""
        micro = list(zip(inputs.split(self.micro_batch_size), labels.split(self.micro_batch_size)))
        positions = _split(position_ids, self.micro_batch_size, len(micro))
        total = torch.zeros((), dtype=torch.float32, device=self.device)  # read once: one device sync a step
        if self.moe is not None:
            self.moe.grad_scale = loss_scale / len(micro)  # the router losses weigh like the LM loss
        # Counted on the host (no device sync), over the sp group when labels are sequence-sharded.
        weights = [label_weight(y, label_share, self.label_group) for _, y in micro]
        for i, (x, y) in enumerate(micro):
            x, y = to_device(x, self.device), to_device(y, self.device)
            extra = _position_kwargs(positions[i], self.device)
            with self.dp.microbatch(i == len(micro) - 1), self.loss_context():
                with autocast_context(self.precision, self.device.type), record_function("partrain/forward"):
                    loss = self.forward_loss(self.dp.module, x, y, **extra)
                if weights[i] != 1.0:
                    loss = loss * weights[i]
                with record_function("partrain/backward"):
                    (loss * (loss_scale / len(micro))).backward()
            total += local_scalar(loss.detach()).float()
        with record_function("partrain/dp/finish_gradients"):
            self.dp.finish_gradients()
        return float(total) / len(micro)

    def clip(self, max_norm: float) -> float:
        if self.dp.clip is not None:  # the gradients live on the parameter servers
            return self.dp.clip(max_norm)
        return clip_gradients(self.dp.inner.parameters(), max_norm)

    def share_loss(self, value: Optional[float]) -> float:
        return float(value)

    @torch.no_grad()
    def eval_loss(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        label_share: Optional[float] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> Optional[float]:
        module = self.dp.module
        module.eval()
        total, count = torch.zeros((), dtype=torch.float32), 0
        xs, ys = inputs.split(self.micro_batch_size), labels.split(self.micro_batch_size)
        for x, y, p in zip(xs, ys, _split(position_ids, self.micro_batch_size, len(xs))):
            weight = label_weight(y, label_share, self.label_group)
            extra = _position_kwargs(p, self.device)
            with autocast_context(self.precision, self.device.type), self.loss_context():
                loss = self.forward_loss(module, to_device(x, self.device), to_device(y, self.device), **extra)
                loss = local_scalar(loss)
                total += (loss.float() if weight == 1.0 else loss.float() * weight).cpu()
            count += 1
        module.train()
        return float(total) / count

    @torch.no_grad()
    def score_rows(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each row's sum of labelled log-probabilities [B] (float64, on the host), in eval mode and without
        gradients: full fine-tuning dpo's reference table (partrain.train.reference_logps). Under sequence
        parallelism this rank scores its slice of every row and the slices' sums meet over the sp group."""
        shard = self.preference.sequence if self.preference is not None else None
        positions = torch.arange(inputs.shape[1]).unsqueeze(0)
        if shard is not None:
            inputs, labels, positions = shard.take(inputs), shard.take(labels), shard.take(positions)
        module = self.dp.module
        module.eval()
        x, y, p = (to_device(t, self.device) for t in (inputs, labels, positions))
        with autocast_context(self.precision, self.device.type), self.loss_context():
            logps, _ = sequence_logps(module(input_ids=x, position_ids=p).logits, y, self.label_group)
        module.train()
        return logps.double().cpu()


class PipelineEngine:
    """This rank's pipeline chunks, driven by a torch.distributed.pipelining schedule."""

    moe = None
    """As DirectEngine.moe."""
    preference = None
    """As DirectEngine.preference: its pipeline_loss is the last stage's loss_fn."""

    def __init__(
        self,
        runner,
        optimizer,
        stage_modules: List[nn.Module],
        pp_group,
        precision: str,
        device: torch.device,
        loss_context: Callable[[], ContextManager],
        sync_gradients: Callable[[], None],
    ) -> None:
        self.runner = runner
        self.sync_gradients = sync_gradients
        """Data-parallel gradient averaging for unwrapped stages (FSDP stages reduce by themselves)."""
        self.optimizer = optimizer
        self.stage_modules = stage_modules
        self.pp_group = pp_group
        self.precision = precision
        self.device = device
        self.loss_context = loss_context

    @property
    def model_parts(self) -> List[nn.Module]:
        return list(self.stage_modules)

    def forward_backward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        loss_scale: float = 1.0,
        label_share: Optional[float] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> Optional[float]:
        first, last = self.runner.has_first, self.runner.has_last
        self.runner.loss_scale = loss_scale
        self.runner.label_share = label_share
        if self.moe is not None:
            self.moe.grad_scale = loss_scale  # torch divides every gradient by the microbatches afterwards
        with self.loss_context(), autocast_context(self.precision, self.device.type):
            labels = self._dpo_target(inputs, labels, position_ids)
            # Position ids go to every stage: each runs attention, so each needs the document bounds.
            loss = self.runner.step(inputs if first else None, labels if last else None, position_ids)
        with record_function("partrain/dp/sync_gradients"):
            self.sync_gradients()
        return loss

    def clip(self, max_norm: float) -> float:
        from partrain.parallel.pipeline import clip_grad_norm_

        return clip_grad_norm_(self.stage_modules, max_norm, self.pp_group)

    def share_loss(self, value: Optional[float]) -> float:
        return self.runner.broadcast_loss(value)

    def eval_loss(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        label_share: Optional[float] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> Optional[float]:
        first, last = self.runner.has_first, self.runner.has_last
        self.runner.label_share = label_share
        for m in self.stage_modules:
            m.eval()
        with self.loss_context(), autocast_context(self.precision, self.device.type):
            labels = self._dpo_target(inputs, labels, position_ids)
            value = self.runner.eval_step(inputs if first else None, labels if last else None, position_ids)
        for m in self.stage_modules:
            m.train()
        return value

    def _dpo_target(self, inputs: torch.Tensor, labels: torch.Tensor, position_ids) -> torch.Tensor:
        """dpo's target for the last stage: the labels and each row's reference log-probability
        (PreferenceObjective.with_reference), from the full fine-tuning table or, under LoRA, from a forward
        of the stages with their adapters switched off (without gradients, every microbatch, before the
        schedule's). The labels for any other objective."""
        p = self.preference
        if p is None or p.kind != "dpo":
            return labels
        if p.reference is None:
            ref = p.next_reference(labels.shape[0])
        else:
            with contextlib.ExitStack() as off:
                for module in self.stage_modules:
                    off.enter_context(p.reference(module))
                ref = self._row_logps(inputs, labels, position_ids)
        return p.with_reference(labels, ref) if self.runner.has_last else labels

    @torch.no_grad()
    def _row_logps(self, inputs: torch.Tensor, labels: torch.Tensor, position_ids=None) -> Optional[torch.Tensor]:
        """Each row's sum of labelled log-probabilities [B] on the last stage's rank (None elsewhere); B a
        multiple of the microbatch size (one microbatch of the schedule's shape at a time)."""
        first, last = self.runner.has_first, self.runner.has_last
        n = inputs.shape[0] // self.runner.microbatch_size
        values = self.runner.forward_only(
            inputs if first else None,
            labels if last else None,
            position_ids,
            lambda h, y: sequence_logps(h, y)[0],
            n_microbatches=n,
        )
        return torch.cat(values) if values else None

    def score_rows(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """As DirectEngine.score_rows: the last stage scores the rows, every pp rank gets the values."""
        for m in self.stage_modules:
            m.eval()
        with self.loss_context(), autocast_context(self.precision, self.device.type):
            values = self._row_logps(inputs, labels)
        for m in self.stage_modules:
            m.train()
        return self.runner.broadcast_rows(values, inputs.shape[0])

    def timing(self) -> List[dict]:
        return self.runner.gather_timing()
