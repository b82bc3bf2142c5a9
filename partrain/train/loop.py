"""The training loop: one optimizer step = microbatches of forward/backward, clip, update, log.

Reads top to bottom like nanoGPT's loop; everything layout-specific is behind `DataParallelModel`
(and, later, the pipeline schedule). Losses are means over equal-sized microbatches, so the
reported loss of any layout equals the single-process loss of the same global batch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch
import torch.distributed as dist
from torch.profiler import record_function

from partrain.blueprint.validate import ValidatedRun
from partrain.data import EvalBatches, TokenBatches
from partrain.parallel.compile import compile_enabled, compile_errors
from partrain.runtime.mesh import ParallelMesh
from partrain.runtime.resident import peak_rss_bytes
from partrain.train.engine import Engine
from partrain.train.gpu_memory import step_memory_fields
from partrain.train.loss_scale import DynamicLossScale, unscale_gradients
from partrain.train.lr_schedule import LRSchedule, set_lr
from partrain.train.metrics import Events, MetricsWriter, log
from partrain.train.profiling import RunProfiling


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    loss_scale: Optional[float] = None
    """fp16: the loss scale this step ran with."""
    skipped: bool = False
    """fp16: the gradients overflowed, the optimizer did not step."""


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps done."""
    history: List[StepResult] = field(default_factory=list)
    eval_loss: Optional[float] = None
    model_state_bytes: int = 0
    stopped: int = 0
    """The signal that stopped the run before train.steps (every rank agreed on it); 0 = not stopped."""

    def problem(self) -> Optional[str]:
        """Why a run that went to the end did not train (every step skipped, loss not finite), or None."""
        if not self.history:
            return None
        if all(r.skipped for r in self.history):
            return (
                f"all {len(self.history)} optimizer steps were skipped: the fp16 gradients overflowed at every "
                f"loss scale tried (down to {self.history[-1].loss_scale:g}); lower train.loss_scale_init or use "
                "train.precision=bf16"
            )
        final = self.history[-1].loss
        if not math.isfinite(final):
            return f"the final loss is {final}, not finite: lower optim.lr (train.stop_on_nan=true stops at the first)"
        return None


def _mean_over(value: float, group, size: int) -> float:
    return _start_mean_over(value, group, size)()


def _start_mean_over(value: float, group, size: int) -> Callable[[], float]:
    """Start averaging `value` over the group; the returned function waits for the result.
    Started before the gradient clipping and optimizer step, the all-reduce's latency (a
    millisecond or more on gloo) hides behind them."""
    # gloo has no AVG reduction: sum, then divide.
    t = torch.tensor([value], dtype=torch.float64)
    work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group, async_op=True) if size > 1 else None

    def result() -> float:
        if work is not None:
            work.wait()
        return float(t.item()) / size

    return result


def model_state_bytes(parts, optimizer) -> int:
    """Parameters + gradients + optimizer state this rank holds (local shards only)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    params = {id(p): p for part in parts for p in part.parameters()}.values()
    for p in params:
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
    def __init__(
        self,
        validated: ValidatedRun,
        mesh: ParallelMesh,
        engine: Engine,
        batches: TokenBatches,
        eval_batches: Optional[EvalBatches],
        metrics: MetricsWriter,
        is_main: bool,
        on_step_end: Callable[[int], None] = lambda step: None,
        loss_scale: Optional[DynamicLossScale] = None,
        stop=None,
        events: Optional[Events] = None,
        restart: int = 0,
        schedule: Optional[LRSchedule] = None,
        profiling: Optional[RunProfiling] = None,
    ) -> None:
        self.profiling = profiling or RunProfiling()
        """Profiler window and memory history around the steps (train.profile_steps, train.memory_history)."""
        self.schedule = schedule or LRSchedule(validated.run.optim, validated.run.train.steps)
        """The learning rate of each step; the worker shares it with the checkpoints (saved, resumed)."""
        self.on_step_end = on_step_end
        self.events = events or Events()
        """Rank 0's progress events (launcher JSON lines or plain lines); the base class drops them."""
        self.restart = restart
        """torchrun's restart count: said in the start event, so the log shows the restart."""
        self.stop = stop
        """A StopWatch (partrain.runtime.signals): its `signum` is polled between steps; None = never stop."""
        # A gloo group of its own for the stop flag (also under NCCL: a CPU int, no device sync).
        self.stop_group = dist.new_group(backend="gloo") if stop is not None and dist.get_world_size() > 1 else None
        self.loss_scale = loss_scale
        self.v = validated
        self.cfg = validated.run
        self.mesh = mesh
        self.engine = engine
        self.batches = batches
        self.eval_batches = eval_batches
        self.metrics = metrics
        self.is_main = is_main
        self.state = TrainState()
        self.dp_rank = mesh.local("dp")
        self.dp_size = mesh.layout.dp
        # Sequence-parallel ranks hold parts of each loss (context_parallel.SequenceShard.loss): average over dp x sp.
        self.loss_group = mesh["dp_sp"].get_group()
        self.loss_size = mesh.size("dp_sp")
        self.device = getattr(engine, "device", torch.device("cpu"))

    # -- one step ------------------------------------------------------------------------------
    def train_step(self) -> StepResult:
        t0 = time.perf_counter()
        step, optimizer = self.state.step, self.engine.optimizer
        lr = self.schedule.lr()
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        # Packed fine-tuning windows also carry position ids (restarting per example: document masks).
        inputs, labels, *positions = self.batches.rank_batch(step, self.dp_rank, self.dp_size)
        scale = self.loss_scale.scale if self.loss_scale else 1.0
        # Fine-tuning batches mask labels: the loss is then over the global batch's labelled tokens.
        label_share = getattr(self.batches, "label_share", None)
        share = label_share(step) if label_share is not None else None
        preference = getattr(self.engine, "preference", None)
        if preference is not None and preference.table is not None:  # full-FT dpo: the rows' reference log-probs
            preference.use_rows(self.batches.rank_examples(step, self.dp_rank, self.dp_size))
        with self._compile_errors():
            local_loss = self.engine.forward_backward(inputs, labels, scale, share, *positions)
        loss_mean = _start_mean_over(self.engine.share_loss(local_loss), self.loss_group, self.loss_size)
        if self.loss_scale:
            unscale_gradients(self.engine.model_parts, scale)
        with record_function("partrain/clip_grad_norm"):
            grad_norm = self.engine.clip(self.cfg.optim.grad_clip)
        # The norm is global (every shard, stage and replica): all ranks take the same decision.
        stepped = self.loss_scale.update(math.isfinite(grad_norm)) if self.loss_scale else True
        if stepped:
            with record_function("partrain/optimizer"):
                optimizer.step()
        else:  # 16-bit parameters exposing fp32 gradients get their values back (master_weights)
            optimizer.zero_grad(set_to_none=True)
        self.schedule.step()  # also after a skipped fp16 step: the schedule follows the step count
        loss_value = loss_mean()
        if not self.state.model_state_bytes and stepped:
            # Optimizer state exists only after the first step: measure with it.
            self.state.model_state_bytes = model_state_bytes(self.engine.model_parts, optimizer)
        if self.cfg.train.stop_on_nan and not math.isfinite(loss_value):
            raise FloatingPointError(f"loss became {loss_value} at step {step + 1} (train.stop_on_nan=true)")
        dt = time.perf_counter() - t0
        self.state.step += 1
        return StepResult(
            step=self.state.step,
            loss=loss_value,
            lr=lr,
            grad_norm=grad_norm,
            step_time_s=dt,
            tokens_per_s=self.v.tokens_per_step / dt,
            loss_scale=scale if self.loss_scale else None,
            skipped=not stepped,
        )

    def _compile_errors(self):
        t = self.cfg.train
        return compile_errors(compile_enabled(self.cfg), t.compile_backend)

    def _group(self, name: str):
        return self.mesh[name].get_group() if self.mesh.size(name) > 1 else None

    def evaluate(self) -> Optional[float]:
        if self.eval_batches is None:
            return None
        values = []
        for i in range(self.cfg.train.eval_batches):
            inputs, labels, *positions = self.eval_batches.eval_batch(i, self.dp_rank, self.dp_size)
            label_share = getattr(self.eval_batches, "label_share", None)  # masked labels, as in train_step
            share = label_share(i) if label_share is not None else None
            preference = getattr(self.engine, "preference", None)
            if preference is not None and preference.table is not None:
                preference.use_rows(self.eval_batches.eval_examples(i, self.dp_rank, self.dp_size))
            with self._compile_errors():
                values.append(self.engine.share_loss(self.engine.eval_loss(inputs, labels, share, *positions)))
        return _mean_over(sum(values) / len(values), self.loss_group, self.loss_size)

    # -- the run -------------------------------------------------------------------------------
    def run(self) -> TrainState:
        train = self.cfg.train
        started, first_step = time.perf_counter(), self.state.step
        if self.is_main:
            self.events(
                "start",
                steps=train.steps,
                first_step=first_step,
                world_size=self.v.world_size,
                tokens_per_step=self.v.tokens_per_step,
                restart=self.restart,
            )
        while self.state.step < train.steps:
            if self._stop_agreed():
                return self.state
            with self.profiling.step(self.state.step + 1):
                result = self.train_step()
            self.state.history.append(result)
            elapsed = time.perf_counter() - started
            eta = elapsed / (result.step - first_step) * (train.steps - result.step)
            record = {
                "step": result.step,
                "loss": result.loss,
                "lr": result.lr,
                "grad_norm": result.grad_norm,
                "tokens_per_s": result.tokens_per_s,
                "step_time_s": result.step_time_s,
            }
            if result.loss_scale is not None:
                record.update(loss_scale=result.loss_scale, skipped=result.skipped)
            record.update(step_memory_fields(self.device))  # CUDA: per-rank peak allocated / reserved
            if self.engine.moe is not None:
                record.update(self.engine.moe.step_metrics(self._group("dp_sp"), self._group("pp")))
            preference = getattr(self.engine, "preference", None)
            if preference is not None:  # dpo / simpo: rewards, accuracy, margin and log-probs of the step's pairs
                record.update(preference.step_metrics(self._group("dp_sp"), self._group("pp")))
            if self.is_main:  # rank 0's peak memory: metrics.jsonl, the trackers (memory/peak_bytes), the log line
                record["memory_bytes"] = memory_bytes(getattr(self.engine, "device", torch.device("cpu")))
            self.metrics.write(record)
            if self.is_main and (result.step % train.log_every == 0 or result.step == train.steps):
                self.events("step", eta_s=eta, total_steps=train.steps, **record)
            self.on_step_end(result.step)
            at_eval = train.eval_every and result.step % train.eval_every == 0 and result.step < train.steps
            if at_eval:
                self._eval_and_log(result.step)
        self._eval_and_log(self.state.step)
        return self.state

    def _stop_agreed(self) -> bool:
        """Whether any rank was asked to stop: every rank takes the same decision at the same step
        (one all-reduce of a single int per step; see docs/reliability.md#stopping-a-run for its cost)."""
        if self.stop is None:
            return False
        flag = torch.tensor([self.stop.signum], dtype=torch.int64)
        if self.stop_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.stop_group)
        self.state.stopped = int(flag.item())
        return self.state.stopped != 0

    def _eval_and_log(self, step: int) -> None:
        value = self.evaluate()
        preference = getattr(self.engine, "preference", None)
        if preference is not None:
            preference.reset()  # the evaluation's pairs are not the next step's
        if value is None:
            return
        self.state.eval_loss = value
        self.metrics.write({"step": step, "eval_loss": value})
        if self.is_main:
            self.events("eval", step=step, eval_loss=value)
        log.info("step %d eval loss %.4f", step, value)


def memory_bytes(device: torch.device) -> int:
    """This rank's peak memory so far: allocated device memory on GPUs, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss_bytes()
