"""The training loop: one optimizer step = microbatches of forward/backward, clip, update, log.

Reads top to bottom like nanoGPT's loop; everything layout-specific is behind `DataParallelModel`
(and, later, the pipeline schedule). Losses are means over equal-sized microbatches, so the
reported loss of any layout equals the single-process loss of the same global batch.
"""

from __future__ import annotations

import contextlib
import math
import resource
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist

from ..config.validate import ValidatedRun
from ..data import EvalBatches, TokenBatches
from ..models.loss import forward_loss
from ..parallel.data_parallel import DataParallelModel
from ..parallel.tensor_parallel import loss_context
from ..runtime.mesh import ParallelMesh
from .metrics import MetricsWriter, emit, log
from .optim import lr_at, set_lr


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps done."""
    history: List[StepResult] = field(default_factory=list)
    eval_loss: Optional[float] = None
    model_state_bytes: int = 0


def _local(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (loss parallel) as a plain tensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def autocast_context(precision: str, device_type: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device_type, dtype=dtype)


def _mean_over(value: torch.Tensor, group, size: int) -> float:
    # gloo has no AVG reduction: sum, then divide.
    if size > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return float(value) / size


def clip_gradients(parameters, max_norm: float) -> float:
    """Global gradient norm over every rank's shards; clip to max_norm when > 0.

    Gradients are grouped by kind: plain tensors (replicated, counted once) and DTensors per mesh
    and placement set (their norms are Partial over shard dims: full_tensor() sums the squares).
    """
    groups = {}
    for p in parameters:
        if p.grad is not None:
            key = (p.grad.device_mesh, tuple(p.grad.placements)) if hasattr(p.grad, "device_mesh") else None
            groups.setdefault(key, []).append(p.grad)
    squares = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        squares += norm.double().cpu() ** 2
    total = squares.sqrt().float()
    if max_norm > 0:
        for grads in groups.values():
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total.to(grads[0].device))
    return float(total)


def model_state_bytes(model: torch.nn.Module, optimizer) -> int:
    """Parameters + gradients + optimizer state this rank holds (local shards only)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    if hasattr(optimizer, "state_bytes"):
        return total + optimizer.state_bytes()
    for state in optimizer.state.values():
        for t in state.values():
            if torch.is_tensor(t) and t.dim() > 0:
                total += local(t).numel() * t.element_size()
    return total


class Trainer:
    def __init__(self, validated: ValidatedRun, mesh: ParallelMesh, dp: DataParallelModel, batches: TokenBatches,
                 eval_batches: Optional[EvalBatches], metrics: MetricsWriter, device: torch.device, is_main: bool) -> None:
        self.v = validated
        self.cfg = validated.run
        self.mesh = mesh
        self.dp = dp
        self.batches = batches
        self.eval_batches = eval_batches
        self.metrics = metrics
        self.device = device
        self.is_main = is_main
        self.state = TrainState()
        self.dp_rank = mesh.local("dp")
        self.dp_size = mesh.layout.dp
        self.loss_group = mesh["dp"].get_group()
        self.loss_context = loss_context(mesh.size("tp"), use_loss_parallel=True)

    # -- one step ------------------------------------------------------------------------------
    def _microbatches(self, step: int):
        inputs, labels = self.batches.rank_batch(step, self.dp_rank, self.dp_size)
        b = self.cfg.train.micro_batch_size
        return list(zip(inputs.split(b), labels.split(b)))

    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        step, train, optimizer = self.state.step, self.cfg.train, self.dp.optimizer
        lr = lr_at(step, self.cfg.optim, train.steps)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        micro = self._microbatches(step)
        loss_sum = torch.zeros((), dtype=torch.float32)
        for i, (x, y) in enumerate(micro):
            x, y = x.to(self.device), y.to(self.device)
            with self.dp.microbatch(i == len(micro) - 1), self.loss_context():
                with autocast_context(train.precision, self.device.type):
                    loss = forward_loss(self.dp.module, x, y)
                (loss / len(micro)).backward()
            loss_sum += _local(loss.detach()).float().cpu()
        self.dp.finish_gradients()
        grad_norm = clip_gradients(self.dp.inner.parameters(), self.cfg.optim.grad_clip)
        optimizer.step()
        if step == 0:
            # Optimizer state exists only after the first step: measure with it.
            self.state.model_state_bytes = model_state_bytes(self.dp.inner, optimizer)
        loss_value = _mean_over(loss_sum / len(micro), self.loss_group, self.dp_size)
        if self.cfg.train.stop_on_nan and not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step + 1} (train.stop_on_nan=true)")
        dt = time.perf_counter() - t0
        self.state.step += 1
        return StepResult(step=self.state.step, loss=loss_value, lr=lr, grad_norm=grad_norm, step_time_s=dt,
                          tokens_per_s=self.v.tokens_per_step / dt)

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        if self.eval_batches is None:
            return None
        module = self.dp.module
        was_training = module.training
        module.eval()
        total = torch.zeros((), dtype=torch.float32)
        count = 0
        b = self.cfg.train.micro_batch_size
        for i in range(self.cfg.train.eval_batches):
            inputs, labels = self.eval_batches.eval_batch(i, self.dp_rank, self.dp_size)
            for x, y in zip(inputs.split(b), labels.split(b)):
                with autocast_context(self.cfg.train.precision, self.device.type), self.loss_context():
                    total += _local(forward_loss(module, x.to(self.device), y.to(self.device))).float().cpu()
                count += 1
        module.train(was_training)
        return _mean_over(total / count, self.loss_group, self.dp_size)

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> TrainState:
        train = self.cfg.train
        started = time.perf_counter()
        if self.is_main:
            emit("start", steps=train.steps, world_size=self.v.world_size, tokens_per_step=self.v.tokens_per_step)
        while self.state.step < train.steps:
            result = self.train_step()
            self.state.history.append(result)
            elapsed = time.perf_counter() - started
            eta = elapsed / result.step * (train.steps - result.step)
            record = {"step": result.step, "loss": result.loss, "lr": result.lr, "grad_norm": result.grad_norm,
                      "tokens_per_s": result.tokens_per_s, "step_time_s": result.step_time_s}
            self.metrics.write(record)
            if self.is_main and (result.step % train.log_every == 0 or result.step == train.steps):
                emit("step", eta_s=eta, total_steps=train.steps, **record)
            at_eval = train.eval_every and result.step % train.eval_every == 0 and result.step < train.steps
            if at_eval:
                self._eval_and_log(result.step)
        self._eval_and_log(self.state.step)
        return self.state

    def _eval_and_log(self, step: int) -> None:
        value = self.evaluate()
        if value is None:
            return
        self.state.eval_loss = value
        self.metrics.write({"step": step, "eval_loss": value})
        if self.is_main:
            emit("eval", step=step, eval_loss=value)
        log.info("step %d eval loss %.4f", step, value)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
