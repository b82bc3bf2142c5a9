"""Model-state elements (parameters, gradients, optimizer state) of each pipeline rank of a layout,
aggregated by kind of tensor group (a dense or MoE layer, embeddings, final norm/head, a tied head
copy), exactly as partrain's runtime shards them (`partrain plan --simulate` checks it)."""

from __future__ import annotations

import functools
from typing import Dict, List, Sequence, Tuple

from partrain.blueprint.planner.bubble import chunk_layer_counts, rank_chunks
from partrain.blueprint.planner.memory import (
    dtypes,
    tensor_state_elements,
    zero1_optimizer_elements,
)
from partrain.blueprint.planner.moe import expert_layer_elements, expert_shard
from partrain.blueprint.planner.params import (
    TensorSpec,
    embed_tensors,
    final_tensors,
    layer_is_sparse,
    layer_tensors,
    tied_head_copy,
    with_lora,
)
from partrain.blueprint.planner.spec import PlanSpec, spec_from_validated


@functools.lru_cache(maxsize=65536)
def group_parts(
    spec_key: Tuple, kind: Tuple, shard_index: int, expert_index: int = -1
) -> Tuple[int, int, int, int, int]:
    """tensor_state_elements of one kind of tensor group (a dense or MoE layer, embeddings, ...)."""
    facts, extras, lora, tp, ep, n_dense, n_exp, zero = spec_key
    tensors = with_lora(_kind_tensors(facts, extras, kind), *lora)
    return tensor_state_elements(tensors, tp, ep, n_dense, n_exp, zero, shard_index, expert_index)


@functools.lru_cache(maxsize=4096)
def _kind_tensors(facts, extras, kind: Tuple) -> List[TensorSpec]:
    if kind[0] == "layer":
        sparse = kind[1]
        index = next((i for i in range(facts.n_layers) if layer_is_sparse(facts, extras, i) == sparse), 0)
        return layer_tensors(facts, extras, index)
    if kind[0] == "embed":
        return embed_tensors(facts)
    if kind[0] == "final":
        return final_tensors(facts)
    if kind[0] == "tied":
        return [tied_head_copy(facts)]
    raise ValueError(kind)


def spec_key(spec: PlanSpec) -> Tuple:
    n_dense = spec.shard
    n_exp = expert_shard(spec)
    lora = (spec.lora_r, spec.lora_targets)
    return (spec.facts, spec.extras, lora, spec.tp, spec.ep, n_dense, n_exp, spec.zero_stage)


@functools.lru_cache(maxsize=1024)
def _sparse_prefix(facts, extras) -> Tuple[int, ...]:
    out = [0]
    for i in range(facts.n_layers):
        out.append(out[-1] + (1 if layer_is_sparse(facts, extras, i) else 0))
    return tuple(out)


class PipelineRank:
    """What one pipeline rank holds: its chunks, layer counts (dense / sparse), first/last chunk."""

    __slots__ = ("pp_rank", "chunks", "layers", "sparse", "first", "last", "n_chunks")

    def __init__(
        self,
        prefix: Sequence[int],
        n_chunks: int,
        pp_rank: int,
        chunks: Sequence[int],
        counts: Sequence[int],
        starts: Sequence[int],
    ):
        self.pp_rank = pp_rank
        self.chunks = list(chunks)
        self.n_chunks = n_chunks
        self.layers = sum(counts[c] for c in chunks)
        self.sparse = sum(prefix[starts[c] + counts[c]] - prefix[starts[c]] for c in chunks)
        self.first = 0 in chunks
        self.last = self.n_chunks - 1 in chunks

    def kinds(self, spec: PlanSpec) -> List[Tuple[Tuple, int]]:
        out: List[Tuple[Tuple, int]] = []
        if self.layers - self.sparse:
            out.append((("layer", False), self.layers - self.sparse))
        if self.sparse:
            out.append((("layer", True), self.sparse))
        if self.first:
            out.append((("embed",), 1))
        if self.last:
            out.append((("final",), 1))
            if spec.facts.tied_embeddings and self.n_chunks > 1:
                out.append((("tied",), 1))
        return out


def rank_state_elements(
    spec: PlanSpec, rank: PipelineRank, shard_index: int = 0, expert_index: int = -1
) -> Tuple[int, int, int, int]:
    """(params, grads, optimizer, unsharded local params) elements of one rank (at `shard_index` of
    its dense shard group and `expert_index` of its edp group; -1 = shard_index)."""
    key = spec_key(spec)
    p = o = g2 = g1 = g = 0
    for kind, count in rank.kinds(spec):
        pp_, oo, a2, a1, gg = group_parts(key, kind, shard_index, expert_index)
        p += pp_ * count
        o += oo * count
        g2 += a2 * count
        g1 += a1 * count
        g += gg * count
    if spec.zero_stage >= 2:
        unsharded = sum(group_parts(key[:-1] + (0,), kind, 0)[0] * count for kind, count in rank.kinds(spec))
        return p, g, o, unsharded
    # With ep > 1 the experts are their own ZeRO-1 parameter group, sharded over their replicas (edp).
    e2 = rank.sparse * expert_layer_elements(spec) if spec.ep > 1 and spec.zero_stage == 1 else 0
    o = zero1_optimizer_elements(g2 - e2, g1, spec.shard, spec.zero_stage) + zero1_optimizer_elements(
        e2, 0, expert_shard(spec), 1
    )
    return p, g, o, p


def pipeline_ranks(spec: PlanSpec) -> List[PipelineRank]:
    return _ranks_cached(spec.facts, spec.extras, spec.pp, spec.v, spec.seq, spec.layers_per_chunk, spec.schedule)


@functools.lru_cache(maxsize=1024)
def _ranks_cached(facts, extras, pp, v, seq, layers_per_chunk, schedule) -> List[PipelineRank]:
    counts = chunk_layer_counts(facts, pp, v, seq, layers_per_chunk)
    starts = [0]
    for c in counts[:-1]:
        starts.append(starts[-1] + c)
    prefix = _sparse_prefix(facts, extras)
    return [
        PipelineRank(prefix, pp * v, r, chunks, counts, starts) for r, chunks in enumerate(rank_chunks(pp, v, schedule))
    ]


def model_state_bytes_per_rank(v, mixed: str = "autocast") -> List[int]:
    """Predicted parameter + gradient + optimizer-state bytes of every rank (index = global rank),
    at rest after the first optimizer step, exactly as partrain's runtime holds them
    (`partrain.train.loop.model_state_bytes` sums the same local shards). `mixed="autocast"` is the
    runtime's 16-bit mode (fp32 weights); fp32 runs are the same in both modes."""
    spec = spec_from_validated(v, mixed=mixed)
    d = dtypes(spec.precision, spec.style)
    lay = v.layout
    out: List[int] = []
    cache: Dict[Tuple[int, int, int], int] = {}
    for rank in range(lay.world_size):
        key = (lay.base_coords(rank)["pp"], _shard_index(lay, rank), lay.coords(rank)["edp"])
        if key not in cache:
            p, g, o = predicted_rank_elements(spec, lay, rank)
            cache[key] = p * d.param + g * d.grad + o * d.optim
        out.append(cache[key])
    return out


def _shard_index(lay, rank: int) -> int:
    """Position of `rank` in its FSDP shard group (dp_shard x sp, in the order the axes have)."""
    c = lay.base_coords(rank)
    dp_shard_index = c["dp"] % lay.dp_shard
    if lay.order.index("dp") < lay.order.index("sp"):
        return dp_shard_index + lay.dp_shard * c["sp"]
    return c["sp"] + lay.sp * dp_shard_index


def predicted_rank_elements(spec: PlanSpec, lay, rank: int) -> Tuple[int, int, int]:
    """(parameter, gradient, optimizer-state) elements that global `rank` of layout `lay` holds;
    optimizer elements count each Adam moment's element once (multiply by the optimizer bytes)."""
    p, g, o, _ = rank_state_elements(
        spec, pipeline_ranks(spec)[lay.base_coords(rank)["pp"]], _shard_index(lay, rank), lay.coords(rank)["edp"]
    )
    return p, g, o
