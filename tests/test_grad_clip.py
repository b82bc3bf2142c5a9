"""Gradient clipping really clips (`partrain.parallel.grad_norm`): torch's clip_grads_with_norm_ takes
parameters, and given the gradient tensors it scaled nothing, so no run was ever clipped."""

from __future__ import annotations

import torch

from partrain.parallel.grad_norm import clip_gradients


def _params(*grads):
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        out.append(p)
    return out


def test_gradients_above_the_limit_are_scaled_to_it():
    params = _params(torch.full((3,), 4.0), torch.full((4,), 3.0))  # norm sqrt(48 + 36) = 9.165
    total = clip_gradients(params, max_norm=1.0)
    assert abs(total - 84**0.5) < 1e-5
    after = torch.cat([p.grad for p in params]).norm().item()
    assert abs(after - 1.0) < 1e-5
    assert torch.allclose(params[0].grad, torch.full((3,), 4.0 / 84**0.5), atol=1e-6)


def test_gradients_below_the_limit_and_a_zero_limit_are_left_alone():
    params = _params(torch.full((2,), 0.1))
    assert abs(clip_gradients(params, max_norm=1.0) - 0.02**0.5) < 1e-6
    assert torch.equal(params[0].grad, torch.full((2,), 0.1))
    params = _params(torch.full((2,), 10.0))
    clip_gradients(params, max_norm=0.0)
    assert torch.equal(params[0].grad, torch.full((2,), 10.0))


def test_a_tied_copy_left_out_of_the_norm_is_still_scaled():
    counted, copy = _params(torch.full((4,), 2.0), torch.full((4,), 2.0))
    total = clip_gradients([counted, copy], max_norm=1.0, not_counted=[copy])
    assert abs(total - 4.0) < 1e-5
    assert torch.allclose(copy.grad, counted.grad) and abs(counted.grad.norm().item() - 1.0) < 1e-5


DTENSOR_CLIP = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from partrain.parallel.grad_norm import clip_gradients
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
values = [torch.full((4, 2), 1.0), torch.full((3,), 2.0), torch.full((2, 2), 3.0), torch.full((5,), 0.5)]
grads = [
    values[0].clone(),
    distribute_tensor(values[1].clone(), mesh, [Replicate()]),
    distribute_tensor(values[2].clone(), mesh, [Shard(0)]),
    DTensor.from_local(values[3].clone(), mesh, [Partial()]),
]
params = []
for g in grads:
    p = torch.nn.Parameter(torch.zeros_like(g))
    p.grad = g
    params.append(p)
want = torch.cat([v.flatten() for v in values]).norm().item()
total = clip_gradients(params, max_norm=1.0)
assert abs(total - want) < 1e-5, (total, want)
after = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
assert abs(torch.cat([a.flatten() for a in after]).norm().item() - 1.0) < 1e-5
dist.destroy_process_group()
print("ok")
"""


def test_dtensor_gradients_plain_replicated_sharded_and_partial():
    """Every kind of gradient a rank holds is counted once and scaled in place (its local shard is its
    storage): plain, Replicate, Shard (squares summed over the shard's group; one rank here) and a
    pending Partial sum (DTensor's own norm). Multi-rank sums are checked by the TP/FSDP parity runs."""
    import subprocess
    import sys

    ran = subprocess.run([sys.executable, "-c", DTENSOR_CLIP], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout[-2000:] + ran.stderr[-2000:]
