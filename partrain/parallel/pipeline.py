"""Pipeline parallelism: split an HF causal LM into chunks and run them with torch's schedules.

Order of use in a worker (see also `PipelineRunner`):

    meta = build_meta_model(model_cfg); adapter = get_adapter(meta)
    plan = stage_split.plan_chunks(facts, pp, v, schedule, seq_len, layers_per_chunk)
    chunks = plan["placement"][pp_rank]                       # chunk indices this rank runs
    stages = [build_stage_module(meta, adapter, c, pp * v, plan["ranges"][c]) for c in chunks]
    for s in stages: apply TP to s; fully_shard(layer) for each layer in s.layers(), then fully_shard(s)
    for s in stages: materialize(s, model_cfg, seed, device)  # same FQNs as the full model
    (zero_stage 0/1: DDP(s, process_group=dp) around each materialized stage, except for the
     zero-bubble schedules: there pass the plain stages and dp_group=mesh["dp_sp"] to the runner)
    optimizer over the parameters of all of this rank's stages
    runner = PipelineRunner(stages, chunks, n_chunks, mesh["pp"], schedule, microbatches,
                            token_loss, device, microbatch_size, seq_len)
    each step: zero_grad; loss = runner.step(inputs or None, labels or None)   # fwd+bwd, dp, tied sync
               norm = clip_grad_norm_(stages, max_norm, mesh["pp"]); optimizer.step()
               loss = runner.broadcast_loss(loss)                               # then mean over dp
    eval: runner.eval_step(inputs, labels) (forward only), then broadcast_loss

Stage modules keep the full model's parameter names (`model.layers.5.mlp.up_proj.weight`), so
`partrain.models.init.materialize` gives every chunk exactly the full model's weights and
checkpoints of any layout line up.

Tied embeddings (GPT-2: lm_head.weight is transformer.wte.weight): the embedding lives on the first
chunk and the head on the last, usually on different ranks, so there are two copies. The last chunk
holds its copy under the *same* FQN, `transformer.wte.weight`, with its lm_head tied to it inside
the stage, so materialize (or a checkpoint) fills both copies with the same value. After backward,
`tied_weight_sync` adds the two gradients (first + last, exchanged point-to-point between the two
owning pp ranks, or added locally when one rank owns both chunks, as in ZBV/DualPipeV) and writes
the sum into both: exactly the gradient of the one tied weight of the unsplit model, as Megatron's
embedding-group all-reduce does. Same values + same gradients + same optimizer -> the copies stay
identical. Gradient-norm clipping must count that weight once (`clip_grad_norm_` does). The sync
exchanges local shards, so with FSDP/TP both copies must be sharded alike (a vocab-parallel
embedding and a column-parallel head both shard the [vocab, hidden] weight on dim 0).

Measurements: `PipelineRunner.last_timing` (busy = time inside the stages' forward, backward and
weight-gradient calls and the loss; idle = the rest of the step: waiting for neighbours, sends,
bubbles) and `saved_activation_bytes` (peak bytes autograd holds during a step).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from ..models.adapters import Adapter
from .stage_split import (SCHEDULE_CLASS, ZERO_BUBBLE_SCHEDULES, chunk_placement, owner_of_chunk, schedule_problems,
                          schedule_style)


# ---- stage modules ------------------------------------------------------------------------------

class PipelineStageModule(nn.Module):
    """One pipeline chunk of an HF causal LM, with the full model's parameter FQNs.

    forward(x): the first chunk takes input_ids [b, s] (LongTensor), others hidden states
    [b, s, hidden]; the last chunk returns logits [b, s, vocab], others hidden states.
    """

    def __init__(self, full: nn.Module, adapter: Adapter, chunk_index: int, n_chunks: int, layer_range: range):
        super().__init__()
        if not 0 <= chunk_index < n_chunks:
            raise ValueError(f"chunk_index {chunk_index} outside 0..{n_chunks - 1}")
        self.adapter = adapter
        self.chunk_index, self.n_chunks = chunk_index, n_chunks
        self.is_first, self.is_last = chunk_index == 0, chunk_index == n_chunks - 1
        self.layer_ids = list(layer_range)
        self.config = full.config
        self.tied = adapter.tied_embeddings(full)
        self.seq_len: Optional[int] = None
        """Full sequence length when activations are sequence-sharded (SP); None = from the input."""
        self.position_ids: Optional[torch.Tensor] = None
        """[1, local seq] global positions of this rank's tokens under context parallelism (apply_sp)."""

        base_prefix = adapter.base_prefix
        base = full.get_submodule(base_prefix)
        layer_attr = adapter.layer_prefix[len(base_prefix) + 1:]
        token_path = adapter.embedding_paths[0]
        keep_embed = set(adapter.embedding_paths) if self.is_first else set()
        if self.tied and self.is_last:
            keep_embed.add(token_path)  # the last chunk's copy of the tied weight, under its own FQN
        memo: Dict[int, Any] = {}  # one memo: weights tied in the full model stay tied in the copy

        container = nn.Module()
        for name, child in base.named_children():
            path = f"{base_prefix}.{name}"
            if name == layer_attr:
                layers = full.get_submodule(adapter.layer_prefix)
                container.add_module(name, nn.ModuleDict(
                    {str(i): copy.deepcopy(layers[i], memo) for i in self.layer_ids}))
            elif path in adapter.embedding_paths:
                if path in keep_embed:
                    container.add_module(name, copy.deepcopy(child, memo))
            elif path == adapter.final_norm_path:
                if self.is_last:
                    container.add_module(name, copy.deepcopy(child, memo))
            elif next(child.parameters(), None) is None:
                container.add_module(name, copy.deepcopy(child, memo))  # rotary, dropout: every chunk
            else:
                raise NotImplementedError(f"pipeline split does not know where {path} belongs")
        self.add_module(base_prefix, container)  # registered first: its FQNs win for shared weights
        if self.is_last:
            head_path = adapter.lm_head_path
            if "." in head_path:
                raise NotImplementedError(f"nested lm_head path {head_path}")
            self.add_module(head_path, copy.deepcopy(full.get_submodule(head_path), memo))
        self._layer_attr = layer_attr
        self._mask_kinds = [_mask_kind(self.config, i) for i in self.layer_ids]

    # -- lookups --------------------------------------------------------------------------------
    def layers(self) -> nn.ModuleDict:
        """This chunk's decoder layers keyed by their index in the full model."""
        return getattr(self.get_submodule(self.adapter.base_prefix), self._layer_attr)

    def tied_weight(self) -> Optional[nn.Parameter]:
        """This chunk's copy of the tied embedding/head weight, or None (untied, or a middle chunk)."""
        if not self.tied or not (self.is_first or self.is_last):
            return None
        return self.get_submodule(self.adapter.embedding_paths[0]).weight

    def example_io(self, microbatch_size: int, seq_len: int, dtype: torch.dtype = torch.float32
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Meta tensors shaped like one microbatch's input and output (skips torch's shape inference)."""
        hidden, vocab = self.config.hidden_size, self.config.vocab_size
        if self.is_first:
            x = torch.empty(microbatch_size, seq_len, dtype=torch.long, device="meta")
        else:
            x = torch.empty(microbatch_size, seq_len, hidden, dtype=dtype, device="meta", requires_grad=True)
        out_dim = vocab if self.is_last else hidden
        y = torch.empty(microbatch_size, seq_len, out_dim, dtype=dtype, device="meta", requires_grad=True)
        return x, y

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter, base = self.adapter, self.get_submodule(self.adapter.base_prefix)
        seq = self.seq_len or x.shape[1]
        position_ids = torch.arange(seq, device=x.device).unsqueeze(0) if self.position_ids is None else self.position_ids.to(x.device)
        if self.is_first:
            h = self.get_submodule(adapter.embedding_paths[0])(x)
            for path in adapter.embedding_paths[1:]:  # learned positions (GPT-2 wpe)
                h = h + self.get_submodule(path)(position_ids)
            drop = getattr(base, "drop", None)
            if drop is not None:
                h = drop(h)
        else:
            h = x
        rotary = adapter.rotary(self)
        extra = {}
        if rotary is not None:
            extra["position_embeddings"] = rotary(h, position_ids)
        masks = self._masks(h, position_ids)
        for (key, layer), kind in zip(self.layers().items(), self._mask_kinds):
            h = layer(h, attention_mask=masks[kind], position_ids=position_ids, **extra)
            if isinstance(h, tuple):  # older HF layers return (hidden, ...)
                h = h[0]
        if self.is_last:
            h = self.get_submodule(adapter.final_norm_path)(h)
            h = self.get_submodule(adapter.lm_head_path)(h)
        return h

    def _masks(self, h: torch.Tensor, position_ids: torch.Tensor) -> Dict[str, Optional[torch.Tensor]]:
        """HF's own causal masks for this chunk's layers: None under SDPA without padding (causal
        kernel), a real mask for eager attention or sliding windows shorter than the sequence."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        kwargs = dict(config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids)
        out: Dict[str, Optional[torch.Tensor]] = {}
        for kind in set(self._mask_kinds):
            fn = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            out[kind] = fn(**kwargs)
        return out


def _mask_kind(config: Any, layer_index: int) -> str:
    """The attention type HF's base model gives decoder layer `layer_index`."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_index]
    if getattr(config, "model_type", "") in ("mistral", "mixtral") and getattr(config, "sliding_window", None):
        return "sliding_attention"
    return "full_attention"


def build_stage_module(model: nn.Module, adapter: Adapter, chunk_index: int, n_chunks: int,
                       layer_range: range) -> PipelineStageModule:
    """The module of one chunk, cut from the full (meta) model; the full model is left unchanged.

    Holds decoder layers `layer_range` (a ModuleDict keyed by their original index), the embeddings
    on chunk 0, final norm + head on the last chunk (plus the tied embedding copy, see module
    docstring), and parameter-free modules (rotary, dropout) everywhere. Modules are deep copies,
    so two chunks on one rank never share a module.
    """
    return PipelineStageModule(model, adapter, chunk_index, n_chunks, layer_range)


def _unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


# ---- tied weights -------------------------------------------------------------------------------

def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def tied_weight_sync(stage_modules: Sequence[nn.Module], pp_group: Optional[dist.ProcessGroup],
                     first_owner: int, last_owner: int) -> bool:
    """Make both copies of the tied embedding/head weight hold grad(first) + grad(last).

    Call on every pp rank after the pipeline backward (after DDP/FSDP have reduced the gradients
    over dp), before clipping. first_owner / last_owner are the pp-group ranks owning chunk 0 and
    the last chunk. Ranks owning neither return at once; the two owners exchange their (local
    shard of the) gradient point-to-point and both add in the same order (first + last), so the
    copies stay bit-identical. Returns whether this rank held a tied copy.
    """
    mods = [_unwrap(m) for m in stage_modules]
    first = next((m.tied_weight() for m in mods if m.is_first and m.tied_weight() is not None), None)
    last = next((m.tied_weight() for m in mods if m.is_last and m.tied_weight() is not None), None)
    if first is None and last is None:
        return False
    for p in (first, last):
        # A tensor-parallel embedding's gradient can come back Partial/Replicate: bring it to the
        # parameter's own sharding so both copies exchange equal-sized local shards.
        if p is not None and p.grad is not None and hasattr(p.grad, "placements") and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    if first is not None and last is not None:
        if first is last:  # one chunk holds both: the module itself ties them
            return True
        total = _local(first.grad) + _local(last.grad)
        _local(first.grad).copy_(total)
        _local(last.grad).copy_(total)
        return True
    mine = first if first is not None else last
    if mine.grad is None:
        raise RuntimeError("tied weight has no gradient: call tied_weight_sync after backward")
    grad = _local(mine.grad)
    peer = last_owner if first is not None else first_owner
    send, recv = grad.contiguous().clone(), torch.empty_like(grad, memory_format=torch.contiguous_format)
    ops = [dist.P2POp(dist.isend, send, group=pp_group, group_peer=peer),
           dist.P2POp(dist.irecv, recv, group=pp_group, group_peer=peer)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    grad.copy_(send + recv if first is not None else recv + send)  # always first + last
    return True


def all_reduce_grads(modules: Sequence[nn.Module], group: Optional[dist.ProcessGroup]) -> None:
    """Average every gradient of `modules` over `group` (see data_parallel.allreduce_gradients_of)."""
    from .data_parallel import allreduce_gradients_of

    allreduce_gradients_of(modules, group, dist.get_world_size(group) if group is not None else 1)


@torch.no_grad()
def clip_grad_norm_(stage_modules: Sequence[nn.Module], max_norm: float,
                    pp_group: Optional[dist.ProcessGroup] = None) -> float:
    """Global gradient norm of the whole pipelined model; clips to max_norm when > 0.

    Each rank takes the norm of its stages' gradients (plain, and DTensor shards of FSDP/TP combined
    over their own meshes), the last chunk's tied-weight copy left out (it equals the first chunk's),
    then the squares are summed over the pp group. Every pp rank gets the same norm.
    """
    from .grad_norm import clip_gradients

    params = {id(p): p for m in stage_modules for p in m.parameters()}.values()
    return clip_gradients(params, max_norm, not_counted=second_tied_copies(stage_modules), sum_group=pp_group)


def second_tied_copies(stage_modules: Sequence[nn.Module]) -> List[nn.Parameter]:
    """The last chunk's copy of a tied embedding/head weight (its gradient equals the first chunk's)."""
    copies = []
    for m in stage_modules:
        inner = _unwrap(m)
        if inner.is_last and not inner.is_first and inner.tied_weight() is not None:
            copies.append(inner.tied_weight())
    return copies


# ---- the runner ---------------------------------------------------------------------------------

@dataclass
class StepTiming:
    """Where one pipeline step's time went on this rank (seconds)."""

    wall: float = 0.0
    """Time inside the schedule's step (forward, backward, waits, sends)."""
    forward: float = 0.0
    backward: float = 0.0
    """Full backward, or the input-gradient part (I) for zero-bubble schedules."""
    weight: float = 0.0
    """Weight-gradient part (W) of zero-bubble schedules."""
    loss: float = 0.0
    calls: Dict[str, int] = field(default_factory=dict)

    @property
    def busy(self) -> float:
        return self.forward + self.backward + self.weight + self.loss

    @property
    def idle(self) -> float:
        return max(0.0, self.wall - self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Share of the step this rank was not computing (the measured bubble)."""
        return self.idle / self.wall if self.wall > 0 else 0.0

    def to_json(self) -> dict:
        return {"wall_s": self.wall, "busy_s": self.busy, "idle_s": self.idle, "forward_s": self.forward,
                "backward_s": self.backward, "weight_s": self.weight, "loss_s": self.loss,
                "bubble_fraction": self.bubble_fraction, "calls": dict(self.calls)}


def _group_of(pp: Any) -> Optional[dist.ProcessGroup]:
    return pp.get_group() if hasattr(pp, "get_group") else pp


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

    def __init__(self, stage_modules: Sequence[nn.Module], chunk_indices: Sequence[int], n_chunks: int, pp: Any,
                 schedule: str, n_microbatches: int, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: Union[str, torch.device], microbatch_size: Optional[int] = None, seq_len: Optional[int] = None,
                 static_shapes: bool = True, sync_tied: bool = True, measure: bool = True,
                 activation_dtype: torch.dtype = torch.float32, dp_group: Any = None):
        import torch.distributed.pipelining as pipelining
        from torch.distributed.pipelining import PipelineStage

        if len(stage_modules) != len(chunk_indices):
            raise ValueError("one chunk index per stage module")
        self.group = _group_of(pp)
        self.pp_size = dist.get_world_size(self.group)
        self.pp_rank = dist.get_rank(self.group)
        v = n_chunks // self.pp_size
        if v * self.pp_size != n_chunks:
            raise ValueError(f"{n_chunks} chunks do not divide over {self.pp_size} pp ranks")
        problems = schedule_problems(schedule, self.pp_size, v, n_microbatches)
        if problems:
            raise ValueError("; ".join(problems))
        self.style = schedule_style(schedule)
        placement = chunk_placement(self.pp_size, v, self.style)
        if sorted(chunk_indices) != sorted(placement[self.pp_rank]):
            raise ValueError(f"{schedule} expects pp rank {self.pp_rank} to own chunks {placement[self.pp_rank]}, "
                             f"got {list(chunk_indices)}")
        ddp = [isinstance(m, nn.parallel.DistributedDataParallel) for m in stage_modules]
        if any(ddp) and schedule in ZERO_BUBBLE_SCHEDULES:
            raise ValueError(f"{schedule} splits backward into input and weight passes, which torch 2.13 does not "
                             "synchronise under DistributedDataParallel: pass the unwrapped stage modules and "
                             "dp_group=<data-parallel group> (or shard them with FSDP)")
        self.dp_group = _group_of(dp_group) if dp_group is not None else None
        if self.dp_group is not None and any(ddp):
            raise ValueError("stage modules are DDP-wrapped and dp_group is set: gradients would be averaged twice")
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
        """Multiplier of the loss before backward (fp16 dynamic loss scaling); step() returns the unscaled loss."""
        self._activation_dtype = activation_dtype
        hidden = _unwrap(stage_modules[0]).config.hidden_size
        self._io_shape = (microbatch_size, seq_len, hidden) if microbatch_size and seq_len else None

        self.stages = []
        for module, chunk in zip(self.modules, self.chunk_indices):
            kwargs: Dict[str, Any] = {}
            if static_shapes:
                if microbatch_size is None or seq_len is None:
                    raise ValueError("static_shapes needs microbatch_size and seq_len")
                x, y = _unwrap(module).example_io(microbatch_size, seq_len, activation_dtype)
                kwargs = {"input_args": (x,), "output_args": (y,)}
            stage = PipelineStage(module, chunk, n_chunks, self.device, group=self.group, **kwargs)
            if measure:
                self._instrument(stage)
            self.stages.append(stage)
        cls = getattr(pipelining, SCHEDULE_CLASS[schedule])
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
        self.schedule = cls(self.stages if multi else self.stages[0], n_microbatches=n_microbatches,
                            loss_fn=self._loss, scale_grads=True)

    # -- instrumentation --------------------------------------------------------------------------
    def _scaled_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self._user_loss_fn(output, target)
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
        for method, slot in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                             ("backward_weight_one_chunk", "weight")):
            original = getattr(stage, method)

            def timed(*args, _orig=original, _slot=slot, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _orig(*args, **kwargs)
                finally:
                    setattr(self.timing, _slot, getattr(self.timing, _slot) + time.perf_counter() - t0)
                    self.timing.calls[_slot] = self.timing.calls.get(_slot, 0) + 1

            setattr(stage, method, timed)

    # -- one step -----------------------------------------------------------------------------------
    def step(self, inputs: Optional[torch.Tensor], labels: Optional[torch.Tensor]) -> Optional[float]:
        """Forward + backward of one optimizer step's microbatches; gradients accumulate in the stages.

        inputs [B, S] are needed on the rank owning chunk 0 and labels [B, S] on the rank owning the
        last chunk (others may pass None); B must be a multiple of n_microbatches. Returns the mean
        microbatch loss on the last chunk's rank, None elsewhere. Call optimizer.zero_grad() before.
        """
        args: Tuple[torch.Tensor, ...] = ()
        if self.has_first:
            if inputs is None:
                raise ValueError(f"pp rank {self.pp_rank} runs the first chunk and needs the inputs")
            self._check_batch(inputs)
            args = (inputs.to(self.device),)
        target = None
        if self.has_last:
            if labels is None:
                raise ValueError(f"pp rank {self.pp_rank} runs the last chunk and needs the labels")
            self._check_batch(labels)
            target = labels.to(self.device)
        losses: List[torch.Tensor] = []
        self.timing = StepTiming()
        t0 = time.perf_counter()
        self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        self.timing.wall = time.perf_counter() - t0
        self.last_timing = self.timing
        if self.dp_group is not None:
            all_reduce_grads(self.modules, self.dp_group)
        if self.sync_tied:
            tied_weight_sync(self.modules, self.group, self.first_owner, self.last_owner)
        if not self.has_last:
            return None
        return float(torch.stack([l.detach().float() for l in losses]).mean()) / self.loss_scale

    @torch.no_grad()
    def eval_step(self, inputs: Optional[torch.Tensor], labels: Optional[torch.Tensor]) -> Optional[float]:
        """Forward only, one microbatch and one chunk at a time (no schedule, no overlap): the mean
        microbatch loss on the last chunk's rank, None elsewhere. Gradients are untouched.

        torch's `schedule.eval()` fails for the V-shaped and zero-bubble schedules in 2.13, so this
        walks the chunks itself with blocking send/recv over the pp group. Every rank visits the
        (microbatch, chunk) pairs in the same order, so sends and receives always match. Needs
        plain-tensor activations of the static shape (microbatch_size, seq_len, hidden).
        """
        if self._io_shape is None:
            raise ValueError("eval_step needs microbatch_size and seq_len")
        owner = owner_of_chunk(self.pp_size, self.n_chunks // self.pp_size, self.style)
        mine = dict(zip(self.chunk_indices, self.modules))
        if self.has_first:
            self._check_batch(inputs)
            xs = inputs.to(self.device).chunk(self.n_microbatches)
        if self.has_last:
            self._check_batch(labels)
            ys = labels.to(self.device).chunk(self.n_microbatches)
        b, s, hidden = self._io_shape
        total = torch.zeros((), dtype=torch.float64)
        for mb in range(self.n_microbatches):
            h: Optional[torch.Tensor] = None
            for c in range(self.n_chunks):
                if c not in mine:
                    continue
                if c == 0:
                    h = xs[mb]
                elif owner[c - 1] != self.pp_rank:
                    h = torch.empty(b, s, hidden, dtype=self._activation_dtype, device=self.device)
                    dist.recv(h, group=self.group, group_src=owner[c - 1])
                h = mine[c](h)
                if c == self.n_chunks - 1:
                    total += float(self._user_loss_fn(h, ys[mb]))
                elif owner[c + 1] != self.pp_rank:
                    dist.send(h.contiguous(), group=self.group, group_dst=owner[c + 1])
        return float(total) / self.n_microbatches if self.has_last else None

    def _check_batch(self, t: torch.Tensor) -> None:
        if t.dim() != 2 or t.shape[0] % self.n_microbatches:
            raise ValueError(f"expected [B, S] with B a multiple of {self.n_microbatches} microbatches, got "
                             f"{tuple(t.shape)}")

    def broadcast_loss(self, value: Optional[float]) -> float:
        """The last chunk's loss on every pp rank (collective over the pp group)."""
        t = torch.tensor([value if value is not None else 0.0], dtype=torch.float64)
        if self.pp_size > 1:
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


# ---- measurements -------------------------------------------------------------------------------

class _Held:
    """What autograd keeps for one saved tensor; releasing it lowers the running total."""

    __slots__ = ("tensor", "key", "ledger")

    def __init__(self, tensor: torch.Tensor, key: int, ledger: "_Ledger"):
        self.tensor, self.key, self.ledger = tensor, key, ledger

    def __del__(self):
        self.ledger.release(self.key)


class _Ledger:
    def __init__(self, skip: set):
        self.skip = skip
        self.refs: Dict[int, List[int]] = {}
        self.current = 0
        self.peak = 0

    def hold(self, t: torch.Tensor):
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.device.type == "meta":
            return t
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = storage.data_ptr()
        if key == 0 or key in self.skip:
            return t
        entry = self.refs.get(key)
        if entry is None:
            self.refs[key] = [1, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Held(t, key, self)

    def release(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.refs[key]


def saved_activation_bytes(fn: Callable[[], Any], params: Sequence[torch.Tensor] = ()) -> Tuple[Any, int]:
    """Run fn() and return (its result, peak bytes autograd held in saved tensors meanwhile).

    Uses torch.autograd.graph.saved_tensors_hooks: every tensor saved for backward is counted by
    its storage (once, however many ops save it) until autograd frees it. Storages of `params`
    (the model's parameters, which ops like linear also save) are not activations and are skipped.
    Wrap a whole `PipelineRunner.step` to see how many microbatches a schedule keeps in flight.
    """
    skip = set()
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type != "meta":
            skip.add(local.untyped_storage().data_ptr())
    ledger = _Ledger(skip)

    def unpack(x):
        return x.tensor if isinstance(x, _Held) else x

    with torch.autograd.graph.saved_tensors_hooks(ledger.hold, unpack):
        result = fn()
    return result, ledger.peak


def torch_rank_orders(schedule: str, pp: int, v: int, n_microbatches: int):
    """torch's own per-rank action order for `schedule`, as `schedule_picture.Action`s (imports torch;
    DualPipeV's overlapped F+B pairs are listed as their F then their B). Pass the result to
    `schedule_picture.schedule_grid(..., orders=...)` for an exact picture at run time."""
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    from ..schedule_picture import Action

    name = SCHEDULE_CLASS[schedule][len("Schedule"):]
    if schedule == "1f1b":  # torch's IR for single-stage 1F1B is not what it executes; use ours
        from ..schedule_picture import rank_orders

        return rank_orders(schedule, pp, 1, n_microbatches)
    ops = get_schedule_ops(name, pp, n_microbatches, None if schedule == "gpipe" else v)
    out = []
    for row in ops:
        actions = []
        for a in row:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):
                kind = sub.computation_type.value
                if kind in ("F", "B", "I", "W"):
                    actions.append(Action(kind, sub.microbatch_index, sub.stage_index))
        out.append(actions)
    return out
