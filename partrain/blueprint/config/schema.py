"""Typed schema of a partrain run.

Every Hydra group (model, cluster, parallel, data, optim, train, checkpoint) is backed by one
dataclass here. A composed config is merged into `RunConfig`, so unknown keys and wrong types are
errors. Each field carries an attribute docstring (the string literal under it); `partrain show
--explain` and docs/config-reference.md are generated from them, and a test checks that none is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

# The data group's schema lives in its own module (it is the largest group); re-exported here.
from partrain.blueprint.config.data_schema import DATA_FORMATS, LONG_EXAMPLES, TRAIN_ON, DataConfig  # noqa: F401

AXES = ("tp", "sp", "dp", "pp")
"""Axes that multiply the world size, in the default order (fastest-varying first)."""

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zero-bubble", "zbv", "dualpipev")
SP_MODES = ("ulysses", "ring")
RECOMPUTE = ("none", "selective", "full")
FSDP_GRAD_SYNC = ("every_microbatch", "last_microbatch")
DP_SYNC = ("allreduce", "ring", "hierarchical", "parameter-server")
PS_PLACEMENTS = ("colocated", "dedicated")
PRECISIONS = ("fp32", "bf16", "fp16")
PARAM_DTYPES = ("auto", "fp32", "16bit")
DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
OPTIMIZER_IMPLEMENTATIONS = ("for_loop", "foreach", "fused")
ZERO_STAGES = (0, 1, 2, 3)
TRACKERS = ("tensorboard", "wandb", "mlflow")
PEFT_METHODS = ("none", "lora")
OBJECTIVES = ("lm", "dpo", "simpo")
PREFERENCE_REFERENCES = ("auto", "adapters", "table", "copy")

CHOICES = {
    "parallel.pp_schedule": PP_SCHEDULES,
    "parallel.sp_mode": SP_MODES,
    "parallel.recompute": RECOMPUTE,
    "parallel.fsdp_grad_sync": FSDP_GRAD_SYNC,
    "train.precision": PRECISIONS,
    "checkpoint.export_dtype": PRECISIONS,
    "train.param_dtype": PARAM_DTYPES,
    "cluster.device": DEVICES,
    "cluster.backend": BACKENDS,
    "optim.name": OPTIMIZERS,
    "optim.schedule": LR_SCHEDULES,
    "optim.implementation": OPTIMIZER_IMPLEMENTATIONS,
    "parallel.zero_stage": ZERO_STAGES,
    "peft.method": PEFT_METHODS,
    "train.objective": OBJECTIVES,
    "train.preference_reference": PREFERENCE_REFERENCES,
    "data.format": DATA_FORMATS,
    "data.train_on": TRAIN_ON,
    "data.long_examples": LONG_EXAMPLES,
}
"""Keys whose value is one of a fixed list: validation refuses others, and a value of the wrong type
(`parallel.zero_stage=two`) is answered with the list."""

AT_LEAST = {
    "cluster.nodes": 1,
    "cluster.devices_per_node": 1,
    "train.seq_len": 1,
    "train.micro_batch_size": 1,
    "train.steps": 1,
    "train.global_batch_size": 0,
    "train.microbatches": 0,
    "train.eval_every": 0,
    "train.eval_batches": 0,
    "train.log_every": 1,
    "train.threads_per_process": 0,
    "train.max_restarts": 0,
    "train.timeout_s": 1,
    "checkpoint.every_steps": 0,
    "checkpoint.keep_last": 0,
    "optim.warmup_steps": 0,
    "parallel.pp_virtual_stages": 1,
    "parallel.recompute_every": 1,
    "data.max_bytes": -1,
    "train.loss_scale_window": 1,
    "peft.r": 1,
}
"""Integer keys with a lower bound (validation's range rule and the type errors' hint)."""


@dataclass
class ModelConfig:
    arch: str = "gpt2"
    """Hugging Face architecture family (its `model_type`): gpt2, llama, qwen2, qwen3, mistral, smollm3, granite,
    gemma2, gemma3_text, olmo2, phi3, glm4, cohere2, mixtral, qwen2_moe, qwen3_moe, gpt_oss, deepseek_v3, and the
    families of the generic, generic MoE and template paths (docs/families.md). With model.pretrained: the
    folder's model_type unless given on the command line or in the recipe."""
    config: Dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the HF config class (e.g. n_layer, hidden_size). Keys are checked against that class.
    With model.pretrained only the keys given on the command line or in the recipe apply (the model group's
    size keys do not), each overriding the folder's config.json."""
    pretrained: Optional[str] = None
    """Local folder with an HF `save_pretrained` checkpoint, or a Hub id (gpt2, org/name, org/name@revision)
    fetched into the Hub cache (HF_HOME; with HF_HUB_OFFLINE=1 only the cache is read). The model is the
    folder's as it is: its config.json (arch and sizes), its weights and, with data.tokenizer=auto, its
    tokenizer (partrain.blueprint.config.pretrained). The run records the commit in RUN_DIR/hub.json."""
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
    """Memory of one device in GiB (2**30 bytes), for the fit verdict and the planner. On a cpu cluster: the memory
    of one node, which its devices_per_node processes share (each rank may fill its share)."""
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
    the rendezvous store, runs global rank 0 (torchrun's static rendezvous: node K runs global ranks
    K*devices_per_node onwards; an elastic run's c10d orders them itself) and holds checkpoint.dir's lock.
    Node-local: left out of the config agreement between nodes."""
    rdzv_endpoint: str = ""
    """HOST:PORT of the rendezvous (torchrun's static one; c10d when elastic) for a multi-node run
    (`partrain train --rdzv-endpoint`): node 0's address and a free port, the same on every node.
    Required when nodes > 1."""
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
    moe_bias_update_speed: float = 0.0
    """MoE with a router selection bias (DeepSeek-V3's e_score_correction_bias) only: auxiliary-loss-free
    load balancing. After each optimizer step every MoE layer's bias moves by this speed towards balance,
    bias_e += speed x sign(mean load - load_e), the loads counted over the step's tokens on every rank (so
    every layout applies the same update); the bias is saved and resumed with the model. 0 = the bias stays
    as loaded. DeepSeek-V3 trained with 0.001."""
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
    dp_sync: str = "allreduce"
    """How data-parallel ranks synchronise gradients (zero_stage 0/1): allreduce = the backend's collective
    through DDP; ring = partrain's ring reduce-scatter + all-gather over send/recv (each rank sends
    2(N-1)/N of the gradients whatever N); hierarchical = reduce-scatter inside each node, all-reduce of the
    shards across nodes, all-gather inside the node (inter-node links carry 1/devices-per-node of it);
    parameter-server = ps_servers ranks own fp32 master shards and the optimizer state, workers push
    gradients and pull parameters (the servers' links are the bottleneck). `partrain bench dp-sync` compares them."""
    dp_bucket_mb: float = 25.0
    """Gradient bucket size in MiB: DDP's bucket_cap_mb for allreduce; for ring and hierarchical a bucket is
    launched from backward as soon as all its gradients are ready (smaller = earlier start, more messages)."""
    ps_servers: int = 1
    """parameter-server only: how many server ranks share the parameters (1..dp); each owns 1/ps_servers of
    them. More servers spread the bottleneck traffic."""
    ps_placement: str = "colocated"
    """parameter-server only: colocated = servers are also workers (training supports this); dedicated =
    servers hold no data shard (measured by `partrain bench dp-sync` only: it would change the global batch)."""
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
class OptimConfig:
    name: str = "adamw"
    """Optimizer: adamw (torch.optim.AdamW) or sgd (torch.optim.SGD with momentum; not with zero_stage=1,
    whose sharded state and checkpoints hold AdamW's moments)."""
    implementation: str = "for_loop"
    """The optimizer's kernel: for_loop (one tensor at a time: bit-identical updates whatever the layout shards,
    the parity tests' choice; DTensor parameters are stepped on their local shards), foreach (batched over
    tensors, faster) or fused (one fused kernel, fastest)."""
    lr: float = 1e-3
    """Peak learning rate."""
    schedule: str = "cosine"
    """Learning-rate schedule after the linear warmup (transformers' schedule functions): cosine (to min_lr_ratio),
    linear (to min_lr_ratio), constant, or wsd (warmup-stable-decay: constant, then a linear decay to
    min_lr_ratio over the last decay_fraction of the steps)."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine, linear and wsd decays as a fraction of lr."""
    warmup_steps: int = 10
    """Linear warmup steps up to lr: optimizer step s (0-based) runs at lr x (s+1)/warmup_steps (linear and wsd,
    transformers' get_wsd_schedule, start the warmup from min_lr_ratio x lr)."""
    decay_fraction: float = 0.2
    """wsd only: fraction of train.steps spent in the final decay (warmup + decay must fit in train.steps)."""
    weight_decay: float = 0.1
    """Weight decay on matrices and embeddings, not on biases and norms (AdamW: decoupled; sgd: L2 added to
    the gradient, torch's SGD semantics)."""
    momentum: float = 0.9
    """sgd only: momentum factor (0 = plain SGD)."""
    beta1: float = 0.9
    """adamw only: beta1."""
    beta2: float = 0.95
    """adamw only: beta2."""
    eps: float = 1e-8
    """adamw only: epsilon."""
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
    """Optimizer steps to train (see epochs)."""
    epochs: float = 0.0
    """Passes over the training split instead of train.steps (0 = off; 0.5 = half a pass): steps become
    ceil(epochs x global batches a pass), counted from the prepared data (the dry run shows it); not
    with data.streaming."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (mixed precision: compute in low precision, master weights in fp32)."""
    float8: bool = False
    """Run the decoder's linear layers' matmuls in float8 through torchao (pip install 'partrain[float8]'):
    needs train.precision=bf16 (composes with tp, Megatron-SP, FSDP, pp, ep and peft=lora, whose frozen
    base runs in float8 and adapters in bf16); the head, MoE routers and routed experts stay in bf16,
    linears whose dimensions are not multiples of 16 (16 x tp under tp) are skipped (counted in the
    log). Weights stay bf16/fp32."""
    float8_recipe: str = "tensorwise"
    """train.float8 only: torchao's scaling recipe, tensorwise (one scale per tensor; FSDP all-gathers its
    weights in float8) or rowwise (one scale per row: closer to bf16)."""
    param_dtype: str = "auto"
    """bf16/fp16 under zero_stage 0/1: what the model's parameters are. fp32 = fp32 weights and gradients,
    torch.autocast makes 16-bit copies per op (4+4+8 bytes/param); 16bit = parameters in the 16-bit
    dtype, gradients accumulated in an fp32 buffer, fp32 master weights and Adam state in the optimizer,
    sharded over dp under ZeRO-1 (Megatron's mixed precision: 2+4+12/N bytes/param, no weight copies).
    auto = 16bit on cuda, fp32 on cpu (where 16-bit matmuls are slow anyway). zero_stage 2/3 always run
    FSDP2's MixedPrecisionPolicy (16-bit compute copies of fp32 shards) whatever this says."""
    seed: int = 1234
    """Seed for weights, data order and dropout; every layout starts from the same weights."""
    run_dir: str = ""
    """Run folder; default runs/<recipe>/<run_id>."""
    run_id: str = ""
    """The run folder's last part when train.run_dir is unset (runs/<recipe>/<run_id>): one folder name
    (letters, digits, _ . -). The same run_id is the same run: its folder and checkpoints are reused
    (with checkpoint.resume=auto a run continues). Empty = a new timestamp each time, or $SLURM_JOB_ID
    under srun. `partrain launch slurm` writes one into its script, so resubmitting the script continues."""
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
    loggers: List[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers rank 0 logs to, any of tensorboard, wandb, mlflow (wandb and mlflow: pip install
    partrain[wandb] / partrain[mlflow]); metrics are namespaced (train/loss, eval/loss, perf/tokens_per_s,
    memory/peak_bytes) and the resolved config is logged as hyperparameters. metrics.jsonl is always written."""
    tracker_project: str = "partrain"
    """wandb project and mlflow experiment the run is logged under."""
    tracker_run_name: str = ""
    """The run's name in wandb and mlflow; empty = the run folder's name."""
    mlflow_tracking_uri: str = ""
    """Where mlflow logs (a server URL, or file:/path for a local store); empty = mlflow's own default
    (MLFLOW_TRACKING_URI, else ./mlruns)."""
    loss_chunk_tokens: int = 4096
    """Output head + cross-entropy computed over chunks of about this many tokens (per microbatch), so
    the [tokens x vocab] fp32 logits never exist whole (each chunk's logits are recomputed in backward:
    the head's matmul runs once more). 0 = off: one head call over the whole microbatch, as HF does."""
    objective: str = "lm"
    """What the loss is: lm (next-token cross-entropy over the labelled tokens), dpo (Direct Preference
    Optimization on data.format=preference rows: -log sigmoid(beta x the policy's log-ratio margin over the
    reference's; the reference is the base model with the LoRA adapters switched off under peft=lora, and in
    full fine-tuning the starting model's log-probabilities of every pair, computed once before step 1 and
    cached beside the data) or simpo (reference-free: -log sigmoid(beta x the margin of length-averaged
    log-probs - simpo_gamma)). A pair is two rows of one microbatch (chosen, rejected):
    train.micro_batch_size counts rows and must be even. See docs/preference-tuning.md."""
    preference_reference: str = "auto"
    """dpo: where the reference's log-probabilities come from. adapters: the model with its LoRA adapters
    switched off (peft=lora; one forward without gradients a microbatch, nothing more held). table: the
    starting model's log-probabilities of every pair, computed once before step 1 by the run's own layout and
    cached beside the data (8 bytes a row; reused on resume and under another layout). copy: a frozen copy
    of the starting model sharded as the policy is (its parameters held again; one forward a microbatch;
    parallel.pp=1). auto: adapters under peft=lora, else table."""
    preference_beta: float = 0.1
    """dpo and simpo: beta, the scale of the margin inside the sigmoid (TRL's beta; SimPO's paper uses 2-10)."""
    preference_label_smoothing: float = 0.0
    """dpo and simpo: the share of pairs assumed mislabelled (conservative DPO: the loss is (1 - e) x the
    loss of the pair + e x the loss of the pair reversed); 0 = plain DPO, below 0.5."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin gamma subtracted inside the sigmoid (TRL's CPOTrainer simpo_gamma)."""
    compile: str = "auto"
    """torch.compile each decoder block: auto (on for CUDA, off for CPU, where inductor's C++ build is
    slow), true or false. One graph serves every block; compiling happens at the first step."""
    compile_backend: str = "inductor"
    """torch.compile backend when compiling: inductor (generated kernels), or aot_eager / eager (trace
    only, no code generation: quick, used by the CPU tests and to tell tracing from inductor failures)."""
    profile_steps: List[int] = field(default_factory=list)
    """[A, B]: run torch.profiler over optimizer steps A to B inclusive on every rank, steps counted from 1
    as `step` in metrics.jsonl, and write one Chrome/Perfetto trace per rank, RUN_DIR/profile/rank-K.pt.trace.json
    (ui.perfetto.dev, chrome://tracing, TensorBoard's profiler view), with partrain/... ranges for forward,
    backward, optimizer and the collectives partrain issues. [] = off."""
    memory_history: bool = False
    """CUDA only: record the caching allocator's history from the first step and dump
    RUN_DIR/memory/rank-K.pickle (for pytorch.org/memory_viz) at the end of the run's second step (step 2
    from a fresh start; the last step when fewer) and on out-of-memory. Refused on cluster.device=cpu."""


@dataclass
class CheckpointConfig:
    every_steps: int = 0
    """Save a checkpoint every this many steps (0 = only the final one, see save_final)."""
    save_final: bool = True
    """Save the last step when the run ends, finished or stopped (adapters included); the summary prints
    it and its export commands. false with every_steps=0 = the run keeps nothing (the launch says so)."""
    dir: str = ""
    """Checkpoint folder; default <run_dir>/checkpoints. A run over several nodes that saves checkpoints
    (every_steps > 0, save_final or export_hf) must set it to one folder every node mounts (exit 2
    otherwise, under torchrun, srun and `launch slurm`)."""
    resume: str = "none"
    """none, auto (the newest complete checkpoint in dir) or a checkpoint path."""
    init_from: str = ""
    """A partrain checkpoint folder (step-NNNNNNNN, any layout) whose model weights start this new run:
    step 0, fresh optimizer, schedule and data order, fresh LoRA adapters under peft=lora (e.g. LoRA on a
    model partrain pre-trained). Only base weights are read (a LoRA checkpoint's adapters are not). Must be
    the same model (exit 2 otherwise); with resume=auto the run's own newest checkpoint wins once it has one."""
    keep_last: int = 3
    """Keep this many most recent checkpoints (0 = all)."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    export_hf: bool = False
    """At the end of training, also write an HF `save_pretrained` folder to <run_dir>/hf (safetensors
    shards written in parallel by the training ranks, index, config, tokenizer), from the last step's
    checkpoint, which is saved for it if checkpoint.every_steps did not land on the last step."""
    export_dtype: str = "fp32"
    """Dtype of the weights checkpoint.export_hf writes: fp32, bf16 or fp16 (training keeps fp32
    master weights; bf16 halves the folder)."""


@dataclass
class PeftConfig:
    method: str = "none"
    """Parameter-efficient fine-tuning: none (every weight trains) or lora (the base weights are frozen:
    no gradients, no optimizer state; only low-rank adapters next to the target projections train)."""
    r: int = 8
    """LoRA rank: each adapted projection W [out, in] gains A [r, in] and B [out, r]."""
    alpha: float = 16.0
    """LoRA scaling numerator: the adapter adds (alpha / r) * B A x to the projection's output."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0 = none; the base projection never sees it)."""
    target_modules: List[str] = field(default_factory=list)
    """Projection names (the last part of their module path) that get adapters; empty = every attention
    and MLP projection of the family (Llama, Qwen2, Qwen3, Mistral, SmolLM3, Granite, Gemma 2, Gemma 3,
    OLMo 2, Cohere 2: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; Phi-3: qkv_proj,
    o_proj, gate_up_proj, down_proj; GLM-4: q_proj, k_proj, v_proj, o_proj, gate_up_proj, down_proj;
    GPT-2: c_attn, c_proj (attention's and the MLP's), c_fc). MoE
    families: attention and the dense MLP projections (Qwen2-MoE's shared expert, Qwen3-MoE's mlp_only_layers);
    the routed experts (stacked 3-D tensors) and the router get no adapters and stay frozen."""


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
    peft: PeftConfig = field(default_factory=PeftConfig)
    """Parameter-efficient fine-tuning (LoRA adapters on a frozen base)."""
    recipe: str = ""
    """Name of the recipe this run was composed from (set by partrain)."""
