"""AdamW `for_loop` on DTensor parameters steps their local shards (`LocalStepAdamW`): the same numbers
as torch's AdamW through DTensor's dispatch, bit for bit, with the state kept as DTensors. Multi-rank
layouts are checked by the TP/FSDP parity runs; here one rank's mesh, every kind of gradient."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from partrain.parallel.optimizer import LocalStepAdamW
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
torch.manual_seed(0)
start = [torch.randn(8, 4), torch.randn(6), torch.randn(4, 4), torch.randn(3)]
runs = []
for cls in (torch.optim.AdamW, LocalStepAdamW):
    params = [
        torch.nn.Parameter(distribute_tensor(start[0].clone(), mesh, [Shard(0)])),
        torch.nn.Parameter(distribute_tensor(start[1].clone(), mesh, [Replicate()])),
        torch.nn.Parameter(start[2].clone()),
        torch.nn.Parameter(distribute_tensor(start[3].clone(), mesh, [Replicate()])),
    ]
    opt = cls([{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "weight_decay": 0.0}],
              lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for k in range(6):
        for i, p in enumerate(params):
            g = torch.full(p.shape, 0.1 * (k + 1) * (i + 1))
            if i == 3:  # a gradient still Partial over its mesh (as Qwen3-MoE's head norms under SP)
                p.grad = DTensor.from_local(g, mesh, [Partial()])
            elif hasattr(p, "device_mesh"):
                p.grad = distribute_tensor(g, mesh, p.placements)
            else:
                p.grad = g
        if k == 2:
            params[2].grad = None  # a step without this parameter's gradient
        opt.step()
    runs.append((params, opt))
(torch_params, _), (local_params, local_opt) = runs
for a, b in zip(torch_params, local_params):
    a = a.full_tensor() if hasattr(a, "full_tensor") else a
    b = b.full_tensor() if hasattr(b, "full_tensor") else b
    assert torch.equal(a.detach(), b.detach()), (a, b)
assert type(local_opt.state[local_params[0]]["exp_avg"]).__name__ == "DTensor"
assert float(local_opt.state[local_params[0]]["step"]) == 6.0
dist.destroy_process_group()
print("ok")
"""


def test_local_shard_steps_equal_torchs_adamw_bit_for_bit():
    ran = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout[-2000:] + ran.stderr[-2000:]
