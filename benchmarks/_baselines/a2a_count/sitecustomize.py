"""Loaded at interpreter start when benchmarks/ep.py puts this folder first on PYTHONPATH (its
counted run only): wraps torch.distributed.all_to_all_single so every partrain worker records the
bytes it sends to other ranks - token rows in forward, their gradients in backward, and the
int64 split counts - into PARTRAIN_BENCH_A2A_DIR/a2a-RANK.json (rewritten after every call, so
the figures survive however the worker exits). Without that variable it does nothing.
"""

import os

_out = os.environ.get("PARTRAIN_BENCH_A2A_DIR")
if _out and "RANK" in os.environ:
    import json

    import torch
    import torch.distributed as _dist

    _inner = _dist.all_to_all_single
    _totals = {"forward_sent_bytes": 0, "backward_sent_bytes": 0, "count_sent_bytes": 0, "calls": 0}
    _path = os.path.join(_out, f"a2a-{os.environ['RANK']}.json")

    def _counted(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        me, n = _dist.get_rank(group), _dist.get_world_size(group)
        rows = input.shape[0] if input.dim() else 1
        splits = list(input_split_sizes) if input_split_sizes else [rows // n] * n
        row_bytes = (input.numel() // max(rows, 1)) * input.element_size()
        sent = sum(s for j, s in enumerate(splits) if j != me) * row_bytes
        if not input.is_floating_point():
            key = "count_sent_bytes"
        elif torch._C._current_graph_task_id() != -1:  # inside autograd: a backward exchange
            key = "backward_sent_bytes"
        else:
            key = "forward_sent_bytes"
        _totals[key] += sent
        _totals["calls"] += 1
        with open(_path, "w") as f:
            json.dump(_totals, f)
        return _inner(output, input, output_split_sizes, input_split_sizes, group=group, async_op=async_op)

    _dist.all_to_all_single = _counted
