"""`PipelineRunner`: one pipeline step (forward, backward, dp sync, tied-weight sync) of this
rank's stages with torch.distributed.pipelining's schedules."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from partrain.blueprint.stage_split import (
    SCHEDULE_CLASS,
    ZERO_BUBBLE_SCHEDULES,
    chunk_placement,
    owner_of_chunk,
    schedule_problems,
    schedule_style,
)
from partrain.models.loss import label_weight
from partrain.parallel.pipeline.stage import unwrap_ddp
from partrain.parallel.pipeline.tied_weights import all_reduce_grads, tied_weight_sync
from partrain.parallel.pipeline.timing import StepTiming
from partrain.runtime.cuda_defaults import to_device


def _group_of(pp: Any) -> Optional[dist.ProcessGroup]:
    return pp.get_group() if hasattr(pp, "get_group") else pp


def _check_data_parallel(stage_modules: Sequence[nn.Module], schedule: str, dp_group: Any) -> None:
    ddp = [isinstance(m, nn.parallel.DistributedDataParallel) for m in stage_modules]
    if any(ddp) and schedule in ZERO_BUBBLE_SCHEDULES:
        raise ValueError(
            f"{schedule} splits backward into input and weight passes, which torch 2.13 does not "
            "synchronise under DistributedDataParallel: pass the unwrapped stage modules and "
            "dp_group=<data-parallel group> (or shard them with FSDP)"
        )
    if dp_group is not None and any(ddp):
        raise ValueError("stage modules are DDP-wrapped and dp_group is set: gradients would be averaged twice")


class PipelineRunner:
    """Runs this rank's chunks with a torch.distributed.pipelining schedule.

    Args:
        stage_modules: this rank's chunk modules (possibly FSDP- or DDP-wrapped), in chunk order.
        chunk_indices: their chunk indices (from `chunk_placement`).
        n_chunks: pp * v.
        pp: the pipeline DeviceMesh (`mesh["pp"]`) or its ProcessGroup.
        schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, interleaved-zero-bubble, zbv, dualpipev.
        n_microbatches: microbatches per optimizer step.
        loss_fn: loss_fn(logits, labels) -> mean loss of one microbatch (`token_loss`).
        device: the device the stages run on.
        microbatch_size, seq_len: fixed microbatch shape; with static_shapes=True (default) the stages
            get explicit input/output shapes and skip torch's shape inference. Set static_shapes=False
            when activations are DTensors (sequence parallel) or change dtype (autocast).
        sync_tied: run `tied_weight_sync` at the end of every step (default True).
        measure: time the stages' forward/backward calls (`last_timing`).
        activation_seq_len: tokens per sequence of the activations passed between stages when they
            differ from seq_len (seq_len / tp under Megatron-SP): eval_step receives that shape.
        dp_group: data-parallel group for plain (unwrapped) stage modules: after the schedule the
            runner all-reduces and averages every gradient over it (`all_reduce_grads`). Use this
            instead of DDP for zero-bubble schedules (see below); leave None with FSDP or DDP.

    Data parallelism around stages: FSDP2 (`fully_shard` each layer, then the stage module) works
    with every schedule; torch's stages drive its reduce-scatter after the last microbatch. DDP
    around each stage module works with gpipe, 1f1b, interleaved-1f1b and looped-bfs, but with
    the zero-bubble schedules (split input/weight backward) torch 2.13 leaves DDP's gradients
    wrong (measured at pp=2 x dp=2 on gloo: gradient norm off by 15-35%, loss by ~1e-3 from the
    second step), so the runner refuses DDP there: pass unwrapped modules and dp_group instead.
    With tensor parallelism, sequence-parallel (DTensor) activations or vocab-parallel logits
    need static_shapes=False, the stages' `seq_len` set to the full length (positions), and the
    step run inside `loss_parallel()` when the loss takes sharded logits.

    Gradients: torch divides the accumulated gradients by n_microbatches after the last backward
    (scale_grads=True) and loss_fn returns a microbatch mean, so the stage gradients equal those of
    the mean microbatch loss: the single-process `(loss / m).backward()` accumulation.
    """

    def __init__(
        self,
        stage_modules: Sequence[nn.Module],
        chunk_indices: Sequence[int],
        n_chunks: int,
        pp: Any,
        schedule: str,
        n_microbatches: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: Union[str, torch.device],
        microbatch_size: Optional[int] = None,
        seq_len: Optional[int] = None,
        static_shapes: bool = True,
        sync_tied: bool = True,
        measure: bool = True,
        activation_dtype: torch.dtype = torch.float32,
        dp_group: Any = None,
        activation_seq_len: Optional[int] = None,
    ):
        import torch.distributed.pipelining as pipelining

        if len(stage_modules) != len(chunk_indices):
            raise ValueError("one chunk index per stage module")
        self.group = _group_of(pp)
        self.pp_size = dist.get_world_size(self.group)
        self.pp_rank = dist.get_rank(self.group)
        self.style = schedule_style(schedule)
        placement = self._check_placement(schedule, n_chunks, n_microbatches, chunk_indices)
        self.dp_group = _group_of(dp_group) if dp_group is not None else None
        _check_data_parallel(stage_modules, schedule, self.dp_group)
        self.first_owner = next(r for r, cs in enumerate(placement) if 0 in cs)
        self.last_owner = next(r for r, cs in enumerate(placement) if n_chunks - 1 in cs)
        order = sorted(range(len(chunk_indices)), key=lambda i: chunk_indices[i])
        self.modules = [stage_modules[i] for i in order]
        self.chunk_indices = [chunk_indices[i] for i in order]
        self.schedule_name, self.n_microbatches, self.n_chunks = schedule, n_microbatches, n_chunks
        self.has_first, self.has_last = 0 in self.chunk_indices, n_chunks - 1 in self.chunk_indices
        self.sync_tied = sync_tied
        self.device = torch.device(device)
        self.timing = StepTiming()
        self.last_timing: Optional[StepTiming] = None
        self._measure = measure
        self._user_loss_fn = loss_fn
        self.loss_scale = 1.0
        self.label_share: Optional[float] = None
        """Labelled tokens per row over the global batch when labels are masked (set per step by the engine)."""
        """Multiplier of the loss before backward (fp16 dynamic loss scaling); step() returns the unscaled loss."""
        self.label_group = None
        """Sequence parallelism: the sp group the labelled tokens are counted over (`label_weight`)."""
        self._positions: Optional[Tuple[torch.Tensor, ...]] = None
        """This step's microbatch position ids (packed examples), given to each stage before its forward."""
        self._activation_dtype = activation_dtype
        hidden = unwrap_ddp(stage_modules[0]).config.hidden_size
        between = activation_seq_len or seq_len  # a sequence shard between stages under Megatron-SP
        self._io_shape = (microbatch_size, between, hidden) if microbatch_size and between else None
        self.microbatch_size = microbatch_size

        shapes = (microbatch_size, seq_len, activation_dtype) if static_shapes else None
        self.stages = [self._stage(module, chunk, shapes) for module, chunk in zip(self.modules, self.chunk_indices)]
        cls = getattr(pipelining, SCHEDULE_CLASS[schedule])
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
        self.schedule = cls(
            self.stages if multi else self.stages[0],
            n_microbatches=n_microbatches,
            loss_fn=self._loss,
            scale_grads=True,
        )

    def _check_placement(
        self, schedule: str, n_chunks: int, n_microbatches: int, chunk_indices: Sequence[int]
    ) -> List[List[int]]:
        """The schedule's chunk placement, after checking this rank holds its chunks."""
        v = n_chunks // self.pp_size
        if v * self.pp_size != n_chunks:
            raise ValueError(f"{n_chunks} chunks do not divide over {self.pp_size} pp ranks")
        problems = schedule_problems(schedule, self.pp_size, v, n_microbatches)
        if problems:
            raise ValueError("; ".join(problems))
        placement = chunk_placement(self.pp_size, v, self.style)
        if sorted(chunk_indices) != sorted(placement[self.pp_rank]):
            raise ValueError(
                f"{schedule} expects pp rank {self.pp_rank} to own chunks {placement[self.pp_rank]}, "
                f"got {list(chunk_indices)}"
            )
        return placement

    def _stage(self, module: nn.Module, chunk: int, shapes: Optional[Tuple[Optional[int], Optional[int], torch.dtype]]):
        """torch's PipelineStage of one chunk; with static shapes it skips torch's shape inference."""
        from torch.distributed.pipelining import PipelineStage

        kwargs: Dict[str, Any] = {}
        if shapes is not None:
            microbatch_size, seq_len, dtype = shapes
            if microbatch_size is None or seq_len is None:
                raise ValueError("static_shapes needs microbatch_size and seq_len")
            x, y = unwrap_ddp(module).example_io(microbatch_size, seq_len, dtype)
            kwargs = {"input_args": (x,), "output_args": (y,)}
        stage = PipelineStage(module, chunk, self.n_chunks, self.device, group=self.group, **kwargs)
        self._feed_positions(stage, unwrap_ddp(module))
        if self._measure:
            self._instrument(stage)
        return stage

    def _feed_positions(self, stage, module: nn.Module) -> None:
        """Before torch runs microbatch i through this stage, give the stage microbatch i's position
        ids: every stage runs attention, so every stage needs the document bounds, and torch names
        the microbatch (fwd_chunk_id) whatever the schedule's order."""
        original = stage.forward_one_chunk

        def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
            positions = self._positions
            module.microbatch_position_ids = positions[fwd_chunk_id] if positions is not None else None
            return original(fwd_chunk_id, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk

    def _set_positions(self, position_ids: Optional[torch.Tensor], n_microbatches: Optional[int] = None) -> None:
        n = n_microbatches or self.n_microbatches
        self._positions = None if position_ids is None else to_device(position_ids, self.device).chunk(n)

    # -- instrumentation --------------------------------------------------------------------------
    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self._user_loss_fn(output, target)
        # Masked labels: the global batch's token mean (counted over the sp group under context parallelism).
        weight = label_weight(target, self.label_share, self.label_group)
        if weight != 1.0:
            loss = loss * weight
        return loss if self.loss_scale == 1.0 else loss * self.loss_scale

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not self._measure:
            return self._scaled_loss(output, target)
        t0 = time.perf_counter()
        try:
            return self._scaled_loss(output, target)
        finally:
            self.timing.loss += time.perf_counter() - t0
            self.timing.calls["loss"] = self.timing.calls.get("loss", 0) + 1

    def _instrument(self, stage) -> None:
        for method, slot, range_name in (
            ("forward_one_chunk", "forward", "partrain/forward"),
            ("backward_one_chunk", "backward", "partrain/backward"),
            ("backward_weight_one_chunk", "weight", "partrain/backward_weight"),
        ):
            original = getattr(stage, method)

            def timed(*args, _orig=original, _slot=slot, _range=range_name, **kwargs):
                t0 = time.perf_counter()
                try:
                    with record_function(_range):
                        return _orig(*args, **kwargs)
                finally:
                    setattr(self.timing, _slot, getattr(self.timing, _slot) + time.perf_counter() - t0)
                    self.timing.calls[_slot] = self.timing.calls.get(_slot, 0) + 1

            setattr(stage, method, timed)

    # -- one step -----------------------------------------------------------------------------------
    def step(
        self,
        inputs: Optional[torch.Tensor],
        labels: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor] = None,
    ) -> Optional[float]:
        """Forward + backward of one optimizer step's microbatches; gradients accumulate in the stages.

        inputs [B, S] are needed on the rank owning chunk 0 and labels [B, S] on the rank owning the
        last chunk (others may pass None); B must be a multiple of n_microbatches. position_ids [B, S]
        (packed examples) on every rank, or None. Returns the mean microbatch loss on the last chunk's
        rank, None elsewhere. Call optimizer.zero_grad() before.
        """
        self._set_positions(position_ids)
        args: Tuple[torch.Tensor, ...] = ()
        if self.has_first:
            if inputs is None:
                raise ValueError(f"pp rank {self.pp_rank} runs the first chunk and needs the inputs")
            self._check_batch(inputs)
            args = (to_device(inputs, self.device),)
        target = None
        if self.has_last:
            if labels is None:
                raise ValueError(f"pp rank {self.pp_rank} runs the last chunk and needs the labels")
            self._check_batch(labels)
            target = to_device(labels, self.device)
        losses: List[torch.Tensor] = []
        self.timing = StepTiming()
        t0 = time.perf_counter()
        # torch's schedule posts and waits for the stage-to-stage sends and receives itself: in a trace
        # they are its own send/recv operators inside this range, between partrain/forward and /backward.
        with record_function("partrain/pp/schedule"):
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self.timing.wall = time.perf_counter() - t0
        self.last_timing = self.timing
        if self.dp_group is not None:
            all_reduce_grads(self.modules, self.dp_group)
        if self.sync_tied:
            with record_function("partrain/pp/tied_weights"):
                tied_weight_sync(self.modules, self.group, self.first_owner, self.last_owner)
        if not self.has_last:
            return None
        return float(torch.stack([l.detach().float() for l in losses]).mean()) / self.loss_scale

    @torch.no_grad()
    def eval_step(
        self,
        inputs: Optional[torch.Tensor],
        labels: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor] = None,
    ) -> Optional[float]:
        """Forward only (`forward_only`): the mean microbatch loss on the last chunk's rank, None elsewhere.
        Gradients are untouched."""

        def loss(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            weight = label_weight(y, self.label_share, self.label_group)
            return torch.tensor(float(self._user_loss_fn(h, y)) * weight, dtype=torch.float64)

        values = self.forward_only(inputs, labels, position_ids, loss)
        return float(torch.stack(values).sum()) / self.n_microbatches if self.has_last else None

    @torch.no_grad()
    def forward_only(
        self,
        inputs: Optional[torch.Tensor],
        labels: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        on_last: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        n_microbatches: Optional[int] = None,
    ) -> List[torch.Tensor]:
        """Every microbatch through the chunks without gradients, one microbatch and one chunk at a time (no
        schedule, no overlap); on the last chunk's rank on_last(output, labels) of each microbatch, in order
        (an empty list elsewhere). The modules' train/eval mode is the caller's. n_microbatches: how many
        microbatches of the static shape the batch holds (the step's by default).

        torch's `schedule.eval()` fails for the V-shaped and zero-bubble schedules in 2.13, so this
        walks the chunks itself with blocking send/recv over the pp group. Every rank visits the
        (microbatch, chunk) pairs in the same order, so sends and receives always match. Needs
        plain-tensor activations of the static shape (microbatch_size, seq_len, hidden).
        """
        if self._io_shape is None:
            raise ValueError("forward_only needs microbatch_size and seq_len")
        n = n_microbatches or self.n_microbatches
        owner = owner_of_chunk(self.pp_size, self.n_chunks // self.pp_size, self.style)
        mine = dict(zip(self.chunk_indices, self.modules))
        if self.has_first:
            self._check_batch(inputs, n)
            xs = to_device(inputs, self.device).chunk(n)
        if self.has_last:
            self._check_batch(labels, n)
            ys = to_device(labels, self.device).chunk(n)
        b, s, hidden = self._io_shape
        self._set_positions(position_ids, n)
        out: List[torch.Tensor] = []
        for mb in range(n):
            h: Optional[torch.Tensor] = None
            for c in range(self.n_chunks):
                if c not in mine:
                    continue
                if c == 0:
                    h = xs[mb]
                elif owner[c - 1] != self.pp_rank:
                    h = torch.empty(b, s, hidden, dtype=self._activation_dtype, device=self.device)
                    with record_function("partrain/pp/recv"):
                        dist.recv(h, group=self.group, group_src=owner[c - 1])
                module = unwrap_ddp(mine[c])
                module.microbatch_position_ids = self._positions[mb] if self._positions is not None else None
                h = mine[c](h)
                if c == self.n_chunks - 1:
                    out.append(on_last(h, ys[mb]))
                elif owner[c + 1] != self.pp_rank:
                    with record_function("partrain/pp/send"):
                        dist.send(h.contiguous(), group=self.group, group_dst=owner[c + 1])
        return out

    def broadcast_rows(self, values: Optional[torch.Tensor], rows: int) -> torch.Tensor:
        """The last chunk's per-row values [rows] (float64) on every pp rank (collective over the pp group)."""
        t = values.detach().double().cpu() if values is not None else torch.zeros(rows, dtype=torch.float64)
        if self.pp_size > 1:
            dist.broadcast(t, group=self.group, group_src=self.last_owner)
        return t

    def _check_batch(self, t: torch.Tensor, n_microbatches: Optional[int] = None) -> None:
        n = n_microbatches or self.n_microbatches
        if t.dim() != 2 or t.shape[0] % n:
            raise ValueError(f"expected [B, S] with B a multiple of {n} microbatches, got {tuple(t.shape)}")

    def broadcast_loss(self, value: Optional[float]) -> float:
        """The last chunk's loss on every pp rank (collective over the pp group)."""
        t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64)
        if self.pp_size > 1:
            with record_function("partrain/pp/broadcast_loss"):
                dist.broadcast(t, group=self.group, group_src=self.last_owner)
        return float(t.item())

    def gather_timing(self) -> List[dict]:
        """Every pp rank's `last_timing` (collective over the pp group), indexed by pp rank."""
        mine = (self.last_timing or StepTiming()).to_json()
        out: List[Any] = [None] * self.pp_size
        dist.all_gather_object(out, mine, group=self.group)
        return out

    def parameters(self) -> Iterator[nn.Parameter]:
        for m in self.modules:
            yield from m.parameters()
