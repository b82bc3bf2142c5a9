"""Typed schema of a partrain run.

Every Hydra group (model, cluster, parallel, data, optim, train, checkpoint) is backed by one
dataclass here. A composed config is merged into `RunConfig`, so unknown keys and wrong types are
errors. Each field carries an attribute docstring (the string literal under it); `partrain show
--explain` and the README are generated from them, and a test checks that none is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

AXES = ("tp", "sp", "dp", "pp")
"""Axes that multiply the world size, in the default order (fastest-varying first)."""

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv", "dualpipev")
SP_MODES = ("ulysses", "ring")
RECOMPUTE = ("none", "selective", "full")
FSDP_GRAD_SYNC = ("every_microbatch", "last_microbatch")
PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")


@dataclass
class ModelConfig:
    arch: str = "gpt2"
    """Hugging Face architecture family (its `model_type`): gpt2, llama, qwen2, mistral, mixtral, qwen2_moe,
    qwen3_moe."""
    config: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the HF config class (e.g. n_layer, hidden_size). Keys are checked against that class."""
    pretrained: Optional[str] = None
    """Local folder with an HF `save_pretrained` checkpoint; its config.json is the base and `config`
    keys override it. Nothing is downloaded."""
    trust_remote_code: bool = False
    """Allow custom modelling code shipped in a pretrained folder. Off: such code is never executed."""
    name: str = ""
    """Display name used in reports (defaults to the config file name)."""


@dataclass
class ClusterConfig:
    name: str = "local-cpu"
    """Display name of the cluster."""
    nodes: int = 1
    """Number of machines."""
    devices_per_node: int = 8
    """Processes (devices) per machine; the world size is nodes x devices_per_node."""
    device: str = "cpu"
    """Device type each process drives: cpu or cuda."""
    backend: str = "gloo"
    """torch.distributed backend: gloo (CPU) or nccl (CUDA)."""
    device_memory_gib: float = 24.0
    """Memory of one device in GiB (2**30 bytes), for the fit verdict and the planner."""
    peak_tflops: float = 0.1
    """Peak dense throughput of one device in TFLOP/s at the training precision (planner)."""
    intra_node_gbps: float = 10.0
    """Bandwidth between two devices of one node, GB/s (10**9 bytes/s) per direction (planner)."""
    inter_node_gbps: float = 10.0
    """Bandwidth between nodes, GB/s (10**9 bytes/s) per device per direction (planner)."""
    comm_profile: str = ""
    """A communication profile (JSON) written by `partrain bench comm`; when set, the planner times each
    collective with the bus bandwidth measured there instead of intra_node_gbps/inter_node_gbps."""
    compute_profile: str = ""
    """A compute profile (JSON) written by `partrain bench compute`; when set, the planner times each
    layer's matmuls at the rates measured there by shape (plus attention, elementwise and host time
    fitted to its layer measurements) instead of peak_tflops x a constant efficiency."""
    allow_tp_across_nodes: bool = False
    """Permit a tensor-parallel group to span nodes (normally a mistake: TP talks every layer)."""
    node_rank: int = 0
    """This machine's place in a multi-node run (0..nodes-1; `partrain train --node-rank`). Node 0 hosts
    the rendezvous store and holds checkpoint.dir's lock; torchrun's c10d rendezvous orders global ranks.
    Node-local: left out of the config agreement between nodes."""
    rdzv_endpoint: str = ""
    """HOST:PORT of the c10d rendezvous for a multi-node run (`partrain train --rdzv-endpoint`): node 0's
    address and a free port, the same on every node. Required when nodes > 1."""
    min_nodes: Optional[int] = None
    """Elastic multi-node run: keep training while at least this many of the `nodes` machines take part
    (torchrun's `--nnodes=MIN:MAX`). When a node is lost or one joins, torchrun restarts the workers and
    partrain re-plans the layout for the processes present (parallel=auto's rules, the same global batch)
    and resumes from the newest checkpoint. Unset = nodes (not elastic). Needs parallel=auto,
    checkpoint.every_steps > 0 and a shared checkpoint.dir."""
    elastic_wait_s: int = 30
    """Elastic runs only: once min_nodes have joined, how long the rendezvous waits for the others before
    starting without them (torchrun's last_call_timeout), at the start and after a node is lost."""


@dataclass
class ParallelConfig:
    dp: int = -1
    """Data-parallel degree (replicas or shards of the model); -1 = whatever the other degrees leave."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row slicing inside each layer)."""
    pp: int = 1
    """Pipeline-parallel degree (number of pipeline stages across ranks)."""
    sp: int = 1
    """Sequence/context-parallel degree (Ulysses or ring attention over sequence shards)."""
    ep: int = 1
    """Expert-parallel degree for MoE models; carved out of dp x sp ranks, does not multiply the world size."""
    moe_capacity_factor: Optional[float] = None
    """MoE only: expert capacity factor. Unset = dropless (every routed token reaches its experts). A value
    cf > 0 caps each expert at ceil(cf x tokens x top_k / num_experts) token slots per layer and microbatch
    (tokens = this rank's tokens); routed tokens over the cap are dropped (that expert adds nothing for them)."""
    moe_aux_loss_coef: Optional[float] = None
    """MoE only: weight of the router load-balancing loss added to the LM loss. Unset = the HF config's
    router_aux_loss_coef, added by default (HF itself adds it only when output_router_logits is true);
    0 = no aux loss."""
    moe_z_loss_coef: float = 0.0
    """MoE only: weight of the router z-loss (mean squared logsumexp of router logits, ST-MoE); 0 = off
    (Mixtral, Qwen2-MoE and Qwen3-MoE have none in HF)."""
    order: List[str] = field(default_factory=lambda: list(AXES))
    """Rank order of the axes, fastest-varying first (default tp, sp, dp, pp as in Megatron)."""
    zero_stage: int = 0
    """0 = replicate (DDP); 1 = shard optimizer state; 2 = FSDP, keep params after forward; 3 = FSDP full shard."""
    dp_shard: int = -1
    """Hybrid sharding: shard within groups of this many dp ranks, replicate across them; -1 = shard over all of dp."""
    fsdp_grad_sync: str = "every_microbatch"
    """FSDP (zero_stage 2/3) with several microbatches: every_microbatch reduce-scatters each microbatch's
    gradients at once (gradient memory stays sharded, 1/N); last_microbatch accumulates unsharded gradients
    and reduce-scatters once per step (less communication, as DDP/Accelerate do; holds full-size gradients
    of this rank's layers until the step ends)."""
    pp_schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, interleaved-zero-bubble, zbv, dualpipev."""
    pp_virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved schedules use >= 2; zbv and dualpipev exactly 2)."""
    pp_layers_per_stage: Optional[List[int]] = None
    """Decoder layers of each stage (pp x virtual stages entries); unset = balanced by cost."""
    sp_mode: str = "ulysses"
    """Context-parallel attention: ulysses (all-to-all over heads) or ring (K/V passed around a ring)."""
    tp_sequence_parallel: bool = False
    """Megatron sequence parallelism: norms and dropout on sequence shards inside the TP group."""
    recompute: str = "none"
    """Activation recompute: none, selective (attention core) or full (whole decoder blocks)."""
    recompute_every: int = 1
    """Recompute only every k-th decoder block (1 = all of them)."""
    auto: bool = False
    """Let the planner choose the layout (`parallel=auto`): the search over layouts `train` can run for this
    model, cluster, sequence length, sp and global batch picks the fastest predicted to fit within
    auto_memory_margin. Degrees and choices given on the command line (parallel.tp=1, train.micro_batch_size=2,
    ...) stay fixed; the recipe's own degrees are replaced."""
    auto_memory_margin: float = 0.1
    """parallel=auto only: fraction of device memory kept free: the chosen layout's predicted peak must be at
    most (1 - margin) x cluster.device_memory_gib. A run whose measured memory enters the margin says so."""


@dataclass
class DataConfig:
    source: str = "builtin"
    """builtin (this Python's standard-library sources, read at run time) or a local
    text/jsonl/parquet file or folder."""
    text_field: str = "text"
    """Field holding the text in jsonl/parquet records."""
    tokenizer: str = "byte"
    """byte (256-symbol byte-level, no download) or a local folder with an HF tokenizer."""
    max_bytes: int = 8_000_000
    """Read at most this many bytes of raw text (0 = all)."""
    eval_fraction: float = 0.02
    """Share of the token stream held out for evaluation."""
    cache_dir: str = ""
    """Where tokenized, packed token files are cached (default ~/.cache/partrain/data)."""


@dataclass
class OptimConfig:
    name: str = "adamw"
    """Optimizer; adamw is supported."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay as a fraction of lr."""
    warmup_steps: int = 10
    """Linear warmup steps before the cosine decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to biases and norms)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""


@dataclass
class TrainConfig:
    seq_len: int = 128
    """Tokens per sequence."""
    micro_batch_size: int = 4
    """Sequences per microbatch on one data-parallel rank."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all replicas; 0 = micro_batch_size x microbatches x dp."""
    microbatches: int = 0
    """Microbatches per step on one rank (gradient accumulation / pipeline microbatches); 0 = derived."""
    steps: int = 100
    """Optimizer steps to train."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (mixed precision: compute in low precision, master weights in fp32)."""
    seed: int = 1234
    """Seed for weights, data order and dropout; every layout starts from the same weights."""
    run_dir: str = ""
    """Run folder; default runs/<recipe>/<timestamp>."""
    eval_every: int = 50
    """Evaluate every this many steps (0 = only at the end)."""
    eval_batches: int = 4
    """Global batches (of global_batch_size sequences) per evaluation; the same for every layout. 0 = no eval."""
    log_every: int = 1
    """Console progress every this many steps (metrics.jsonl gets every step)."""
    threads_per_process: int = 0
    """torch intra-op threads per process; 0 = available cores / local processes (at least 1)."""
    max_restarts: int = 0
    """Restarts torchrun's elastic agent makes after a worker dies (resuming from the newest checkpoint)."""
    stop_on_nan: bool = True
    """Stop with an error when the loss becomes NaN or infinite."""
    loss_scale_init: float = 65536.0
    """fp16 only: starting dynamic loss scale; a step whose gradients overflow is skipped and the scale halved."""
    loss_scale_window: int = 1000
    """fp16 only: steps in a row without overflow before the loss scale doubles."""
    timeout_s: int = 120
    """Collective timeout in seconds: a hung or dead rank fails the job after this long."""


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save a checkpoint every this many steps (0 = never)."""
    dir: str = ""
    """Checkpoint folder; default <run_dir>/checkpoints."""
    resume: str = "none"
    """none, auto (the newest complete checkpoint in dir) or a checkpoint path."""
    keep_last: int = 3
    """Keep this many most recent checkpoints (0 = all)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model: HF architecture and its config."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """The machines: nodes, devices, backend and link speeds."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout: degrees, sharding, pipeline schedule, recompute."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training text and tokenizer."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and learning-rate schedule."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Batch, sequence length, steps, precision, seed, run folder."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Distributed checkpoints: cadence, folder, resume."""
    recipe: str = ""
    """Name of the recipe this run was composed from (set by partrain)."""
