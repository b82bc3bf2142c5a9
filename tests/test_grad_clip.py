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
