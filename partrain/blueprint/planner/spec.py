"""The numbers the planner works on: one plain, frozen `PlanSpec` per layout.

`spec_from_validated(v)` reads a `ValidatedRun`; the search builds many specs directly (no Hydra, no
validator) and validates only the ones it reports. Pure Python: nothing here imports torch.

What `ModelFacts` does not say but the planner needs (activation function, dropout, attention
kernel, biases, which layers of a Qwen2-/Qwen3-MoE hold experts) is read from the same merged HF config
kwargs the facts come from (`ModelExtras`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

from partrain.blueprint.families import family
from partrain.blueprint.families.base import ModelExtras
from partrain.blueprint.model_facts import ModelFacts, attention_implementation, load_snapshot, merged_kwargs
from partrain.blueprint.precision_mode import uses_master_weights

GIB = float(1 << 30)
"""Bytes in one GiB (2**30). Device memory is given in GiB."""
GB = 1e9
"""Bytes in one GB (10**9). Link bandwidths are given in GB/s; the ZeRO paper's numbers are in GB."""

MIXED_PRECISION_STYLES = ("zero", "autocast")
"""How 16-bit training keeps its state (for train.precision bf16/fp16).

- "zero": the ZeRO/Megatron accounting, K=12 (Rajbhandari et al.): 16-bit parameters (2 bytes) and
  gradients (2), fp32 master weights + Adam m + v in the optimizer (12); activations in 16 bits.
  The default of `estimate`, as the planning issue specifies.
- "autocast": what partrain's runtime holds (the "runtime" accounting): with train.param_dtype fp32,
  fp32 parameters (4) and gradients (4), Adam m + v (8), torch.autocast casting each weight to 16
  bits per use: the cast copies are saved for the backward of every in-flight microbatch, and the
  residual stream stays fp32. Where the run has 16-bit parameters (`precision_mode`), the runtime
  accounting is "master" (`PlanSpec.style`): 16-bit parameters (2), an fp32 gradient buffer (4),
  fp32 master weights + Adam m + v (12, sharded under ZeRO-1), activations in 16 bits; ZeRO-1
  all-reduces the fp32 gradients and all-gathers 16-bit parameters (partrain.parallel.master_weights).
"""


@functools.lru_cache(maxsize=8)
def _snapshot() -> Dict[str, dict]:
    return load_snapshot()


def model_extras(arch: str, config: Dict[str, Any], pretrained: Optional[str], facts: ModelFacts) -> ModelExtras:
    """`ModelExtras` from the same merged HF kwargs as `partrain.blueprint.model_facts` (cached, cheap)."""
    return _model_extras(arch, json.dumps(dict(config or {}), sort_keys=True, default=str), pretrained, facts)


@functools.lru_cache(maxsize=256)
def _model_extras(arch: str, config_json: str, pretrained: Optional[str], facts: ModelFacts) -> ModelExtras:
    config = json.loads(config_json)
    config.pop("use_cache", None)
    values = merged_kwargs(arch, config, pretrained, _snapshot())
    return family(arch).extras(values, facts, attention_implementation(config.get("attn_implementation"), values, arch))


def default_extras(facts: ModelFacts) -> ModelExtras:
    """Extras when only facts are known (HF defaults, no dropout)."""
    return family(facts.arch).default_extras(facts)


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    devices_per_node: int
    device: str
    device_memory_bytes: float
    peak_flops: float
    """Peak dense FLOP/s of one device at the training precision."""
    intra_bw: float
    """Bytes/s between two devices of a node, per direction."""
    inter_bw: float
    """Bytes/s per device between nodes, per direction."""
    measured: Tuple[Tuple[str, float], ...] = ()
    """Bus bandwidths (bytes/s) measured by `partrain bench comm`, keyed "link/op" (e.g.
    "intra/all_gather"); empty = nominal link speeds. See `bw`."""
    bandwidth_source: str = "nominal"
    """Where the bandwidths come from: "nominal" (the cluster config) or "profile:<path>"."""
    latencies: Tuple[Tuple[str, float], ...] = ()
    """Seconds per call of each op, keyed "link/op", from the comm profile (comm_profile.planner_latencies)."""
    cpu_costs: Tuple[Tuple[str, float], ...] = ()
    """CPU seconds per ring step of each op, keyed "link/op", from a comm profile measured on CPU devices
    (comm_profile.planner_cpu_costs); empty: unknown (planner/cpu_host.py then counts no collective CPU)."""
    compute_profile: str = ""
    """A compute profile written by `partrain bench compute` (compute_model.py times compute from it);
    empty = FLOPs / (peak x efficiency)."""
    compute_source: str = "nominal"
    """Where compute time comes from: "nominal" (peak x efficiency) or "profile:<path>"."""

    def alpha(self, link: str, op: str = "all_reduce") -> float:
        """Seconds of fixed cost per call of `op` on a link class: measured with a comm profile, else 0."""
        for key, value in self.latencies:
            if key == f"{link}/{op}":
                return value
        return 0.0

    def bw(self, link: str, op: str = "all_reduce") -> float:
        """Bytes/s of `op` on a link class ("intra" / "inter"): the measured bus bandwidth when the
        profile has it, else the link's bandwidth (intra_bw / inter_bw; with a profile these are
        its all-reduce figures, or the nominal speed for a link class it did not measure)."""
        if self.measured:
            for key, value in self.measured:
                if key == f"{link}/{op}":
                    return value
        return self.inter_bw if link == "inter" else self.intra_bw


@dataclass(frozen=True)
class PlanSpec:
    """Everything an estimate depends on, as plain numbers (one layout of one run)."""

    facts: ModelFacts
    extras: ModelExtras
    cluster: ClusterSpec
    tp: int
    pp: int
    dp: int
    sp: int = 1
    ep: int = 1
    dp_shard: int = 0
    """Ranks of dp that shard model state (hybrid sharding); 0 = all of dp."""
    order: Tuple[str, ...] = ("tp", "sp", "dp", "pp")
    zero_stage: int = 0
    recompute: str = "none"
    recompute_every: int = 1
    schedule: str = "1f1b"
    v: int = 1
    """Virtual pipeline stages (model chunks) per pipeline rank."""
    layers_per_chunk: Optional[Tuple[int, ...]] = None
    tp_sp: bool = False
    """Megatron sequence parallelism inside the TP group."""
    sp_mode: str = "ulysses"
    seq: int = 128
    mbs: int = 1
    global_batch: int = 1
    precision: str = "fp32"
    mixed: str = "autocast"
    """Mixed-precision accounting for bf16/fp16 (see MIXED_PRECISION_STYLES)."""
    param_dtype: str = "fp32"
    """train.param_dtype: with the runtime accounting, whether ZeRO 0/1 hold 16-bit parameters (`style`)."""
    fsdp_grad_sync: str = "every_microbatch"
    """FSDP gradient reduce-scatter each microbatch, or once per step (parallel.fsdp_grad_sync)."""
    dp_overlap: bool = True
    """Data-parallel gradient reduction overlaps the backward pass (DDP/FSDP buckets, as partrain
    runs); False = it starts after the backward (Megatron-LM 2021's local DDP)."""
    moe_capacity_factor: Optional[float] = None
    """MoE expert capacity factor (parallel.moe_capacity_factor); None = dropless (planner/moe.py)."""
    dp_sync: str = "allreduce"
    """parallel.dp_sync: how ZeRO 0/1 gradients are synchronised (planner/dp_sync_cost.py)."""
    float8: str = ""
    """train.float8's recipe (tensorwise/rowwise; empty = off): on CUDA the decoder layers' linear matmuls
    (not attention's core or the head) run at FLOAT8_PEAK_RATIO x the bf16 peak (estimate.py; nominal
    timing only: a compute profile's measured rates count as measured). Weights stay as torchao holds
    them (bf16/fp32); under FSDP with tensorwise those linears' weights are all-gathered in float8, one
    byte per element (step_inputs.py)."""
    dp_bucket_mb: float = 25.0
    """parallel.dp_bucket_mb: one alpha per ring step per bucket."""
    ps_servers: int = 1
    """parallel.ps_servers (parameter-server)."""
    loss_chunk_tokens: int = 0
    """train.loss_chunk_tokens: the head and loss run over chunks of this many tokens (0 = whole)."""
    lora_r: int = 0
    """peft=lora's rank (0 = no LoRA): the base is frozen, only adapters take gradients and optimizer state."""
    lora_targets: Tuple[str, ...] = ()
    """The projections LoRA adapts (peft.target_modules or the family's default)."""
    reference_forward: bool = False
    """dpo whose reference runs in the step (train.preference_reference adapters or copy): each microbatch
    also runs forward once without gradients; one more forward of the layers and head per microbatch."""
    reference_copy: bool = False
    """dpo with train.preference_reference=copy: the frozen copy holds this rank's parameters again (sharded
    as the policy's; no gradients, no optimizer state)."""

    def loss_chunk(self, tokens: float) -> float:
        """Tokens whose logits exist at once on a rank for a microbatch of `tokens` tokens: the
        runtime's chunk (chunk_tokens // micro batch positions per row), or all of them."""
        if self.loss_chunk_tokens <= 0:
            return tokens
        return min(tokens, self.mbs * max(1, self.loss_chunk_tokens // max(1, self.mbs)))

    def loss_chunked(self, tokens: float) -> bool:
        """More than one chunk: the runtime checkpoints each chunk (nothing of the loss is saved)."""
        return self.loss_chunk(tokens) < tokens

    @property
    def style(self) -> str:
        """The accounting in effect: `mixed`, or "master" where the runtime holds 16-bit parameters
        with fp32 master weights (decided per candidate: the search changes zero stages)."""
        on = uses_master_weights(self.precision, self.param_dtype, self.zero_stage, self.cluster.device, self.ep)
        return "master" if self.mixed == "autocast" and on else self.mixed

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.sp

    @property
    def microbatches(self) -> int:
        return self.global_batch // (self.mbs * self.dp)

    @property
    def fsdp_sync_once(self) -> bool:
        """FSDP reduce-scatters gradients once per step and holds unsharded gradients until then:
        parallel.fsdp_grad_sync=last_microbatch, or any pipeline (torch's schedules do it themselves)."""
        return (
            self.zero_stage >= 2 and self.microbatches > 1 and (self.fsdp_grad_sync == "last_microbatch" or self.pp > 1)
        )

    @property
    def shard(self) -> int:
        """Size of the group that shards dense model state: dp_shard x sp for FSDP (ZeRO 2/3);
        dp_shard for ZeRO-1 (partrain's sharded optimizer runs over the dp_shard group, so the sp
        ranks of one dp rank hold the same optimizer slice)."""
        return (self.dp_shard or self.dp) * (1 if self.zero_stage == 1 else self.sp)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq

    def with_(self, **changes) -> "PlanSpec":
        return replace(self, **changes)


def rank_memory_gib(cl) -> float:
    """Memory one rank may fill, in GiB: a GPU's own memory; on a CPU cluster the node's memory
    (cluster.device_memory_gib) shared by its devices_per_node processes."""
    return cl.device_memory_gib / (cl.devices_per_node if cl.device == "cpu" else 1)


def cluster_spec(cl) -> ClusterSpec:
    intra, inter = cl.intra_node_gbps * GB, cl.inter_node_gbps * GB
    measured: Tuple[Tuple[str, float], ...] = ()
    latencies: Tuple[Tuple[str, float], ...] = ()
    cpu_costs: Tuple[Tuple[str, float], ...] = ()
    source = "nominal"
    if getattr(cl, "comm_profile", ""):
        # Measured bus bandwidths replace the nominal ones (validate.py has checked the file); a link
        # class the profile lacks (inter-node, measured on one node) keeps the config's speed.
        from partrain.blueprint.comm_profile import (
            planner_bandwidths,
            planner_cpu_costs,
            planner_latencies,
        )

        measured = planner_bandwidths(cl.comm_profile)
        latencies = planner_latencies(cl.comm_profile)
        cpu_costs = planner_cpu_costs(cl.comm_profile)
        by_key = dict(measured)
        intra, inter = by_key.get("intra/all_reduce", intra), by_key.get("inter/all_reduce", inter)
        source = f"profile:{cl.comm_profile}"
    return ClusterSpec(
        nodes=cl.nodes,
        devices_per_node=cl.devices_per_node,
        device=cl.device,
        device_memory_bytes=rank_memory_gib(cl) * GIB,
        peak_flops=cl.peak_tflops * 1e12,
        intra_bw=intra,
        inter_bw=inter,
        measured=measured,
        bandwidth_source=source,
        latencies=latencies,
        cpu_costs=cpu_costs,
        compute_profile=getattr(cl, "compute_profile", "") or "",
        compute_source=f"profile:{cl.compute_profile}" if getattr(cl, "compute_profile", "") else "nominal",
    )


def run_settings(run) -> Dict[str, Any]:
    """The PlanSpec fields a run fixes whatever its layout: sequence, precision and the run-level
    settings the estimate depends on (parameter dtype, FSDP and DP gradient sync, buckets,
    parameter servers, MoE capacity, loss chunking, axis order, sp mode). One function, so that a
    validated run, the layout search and `parallel=auto` estimate every layout with the same settings."""
    from partrain.blueprint.validate_objective import reference_kind
    from partrain.blueprint.validate_peft import lora_targets

    p, t = run.parallel, run.train
    lora = run.peft.method == "lora"
    return dict(
        lora_r=run.peft.r if lora else 0,
        lora_targets=lora_targets(run.model.arch, run.peft.target_modules) if lora else (),
        order=tuple(p.order),
        sp_mode=p.sp_mode,
        seq=t.seq_len,
        precision=t.precision,
        param_dtype=t.param_dtype,
        fsdp_grad_sync=p.fsdp_grad_sync,
        moe_capacity_factor=p.moe_capacity_factor,
        dp_sync=p.dp_sync,
        dp_bucket_mb=p.dp_bucket_mb,
        ps_servers=p.ps_servers,
        # The preference objectives compute each microbatch's logits whole (partrain.train.preference).
        loss_chunk_tokens=t.loss_chunk_tokens if t.objective == "lm" else 0,
        reference_forward=reference_kind(t, run.peft.method) in ("adapters", "copy"),
        reference_copy=reference_kind(t, run.peft.method) == "copy",
        float8=t.float8_recipe if t.float8 else "",
    )


def _check_mixed(mixed: str) -> None:
    if mixed not in MIXED_PRECISION_STYLES:
        raise ValueError(f"mixed must be one of {MIXED_PRECISION_STYLES}, got {mixed!r}")


def spec_from_run(
    run, facts: ModelFacts, global_batch: int, mixed: str = "autocast", dp_overlap: bool = True
) -> PlanSpec:
    """The layout search's base PlanSpec of a RunConfig: its model, cluster, sp and run settings
    (`run_settings`) with a neutral layout (dp = world / sp, micro batch 1, no ZeRO, no recompute)
    that every candidate replaces. The run's own degrees, micro batch, ZeRO stage and recompute are
    never read, so they need not be valid."""
    _check_mixed(mixed)
    cl = run.cluster
    sp = max(1, run.parallel.sp)
    return PlanSpec(
        facts=facts,
        extras=model_extras(run.model.arch, run.model.config, run.model.pretrained, facts),
        cluster=cluster_spec(cl),
        tp=1,
        pp=1,
        dp=max(1, cl.nodes * cl.devices_per_node // sp),
        sp=sp,
        mbs=1,
        global_batch=global_batch,
        mixed=mixed,
        dp_overlap=dp_overlap,
        **run_settings(run),
    )


def spec_from_validated(v, mixed: str = "autocast", dp_overlap: bool = True) -> PlanSpec:
    """The PlanSpec of a `partrain.blueprint.validate.ValidatedRun`."""
    _check_mixed(mixed)
    run, lay = v.run, v.layout
    p, t = run.parallel, run.train
    settings = {**run_settings(run), "order": tuple(lay.order)}
    return PlanSpec(
        facts=v.facts,
        extras=model_extras(run.model.arch, run.model.config, run.model.pretrained, v.facts),
        cluster=cluster_spec(run.cluster),
        tp=lay.tp,
        pp=lay.pp,
        dp=lay.dp,
        sp=lay.sp,
        ep=lay.ep,
        dp_shard=lay.dp_shard,
        zero_stage=p.zero_stage,
        recompute=p.recompute,
        recompute_every=p.recompute_every,
        schedule=p.pp_schedule if lay.pp > 1 else "1f1b",
        v=p.pp_virtual_stages if lay.pp > 1 else 1,
        layers_per_chunk=tuple(p.pp_layers_per_stage) if p.pp_layers_per_stage else None,
        tp_sp=bool(p.tp_sequence_parallel) and lay.tp > 1,
        mbs=t.micro_batch_size,
        global_batch=v.global_batch_size,
        mixed=mixed,
        dp_overlap=dp_overlap,
        **settings,
    )
