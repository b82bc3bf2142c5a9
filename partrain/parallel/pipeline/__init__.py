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
`partrain.models.materialize.materialize` gives every chunk exactly the full model's weights and
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
bubbles) and `partrain.runtime.activations.saved_activation_bytes` (peak bytes autograd holds during a step).

Modules: `stage` (the chunk module), `tied_weights` (tied embedding/head sync and clipping),
`runner` (one step with torch's schedules), `timing`, `torch_orders` (torch's action orders).
"""

from partrain.parallel.pipeline.runner import PipelineRunner
from partrain.parallel.pipeline.stage import PipelineStageModule, build_stage_module
from partrain.parallel.pipeline.tied_weights import clip_grad_norm_, tied_weight_sync

__all__ = ["PipelineRunner", "PipelineStageModule", "build_stage_module", "clip_grad_norm_", "tied_weight_sync"]
