"""Data-parallel gradient synchronisation strategies (`parallel.dp_sync`), side by side.

- `allreduce` (default): the backend's all-reduce through DDP (bucketed by `parallel.dp_bucket_mb`,
  overlapped with backward);
- `ring`: partrain's own ring reduce-scatter + all-gather over send/recv (`ring.py`);
- `hierarchical`: ring reduce-scatter inside each node, ring all-reduce of the shards across nodes,
  ring all-gather inside the node (`strategies.py`);
- `parameter-server`: `parallel.ps_servers` co-located servers own fp32 master shards and the
  optimizer state; workers push gradients and pull parameters (`param_server.py`).

`ring` and `hierarchical` launch each bucket from post-accumulate-grad hooks as soon as its
gradients are final and run it on a communication thread (`buckets.py`, which measures the overlap);
with tensor-parallel DTensor parameters or pipeline stages they average one flat buffer after
backward. Every message goes through a byte counter (`counter.py`): the bench reports real bytes.
"""
