"""Ring and Ulysses attention in real gloo processes against full one-process attention (fp64)."""

from __future__ import annotations

import pytest
import torch

from partrain.parallel.sequence_attention import (
    contiguous_positions,
    ring_attention,
    ulysses_attention,
    zigzag_positions,
)
from partrain.runtime.spawn import run_spawned

B, H, S, D = 2, 4, 16, 8


def _full(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )


def _case(sp, sp_rank, group, mode, causal, seed, dtype=torch.float64, kernel="auto", kv_heads=H):
    """Max abs difference of output, dq, dk, dv between the sharded op and the full attention slice."""
    gen = torch.Generator().manual_seed(seed)
    q, w = (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = _full(*full, causal)
    (ref * w).sum().backward()

    pos = zigzag_positions(S, sp, sp_rank) if mode == "zigzag" else contiguous_positions(S, sp, sp_rank)
    local = [t[:, :, pos].to(dtype).requires_grad_(True) for t in (q, k, v)]
    if mode == "ulysses":
        out = ulysses_attention(*local, group, lambda a, b, c: _full(a, b, c, causal))
    else:
        out = ring_attention(*local, group, causal=causal, zigzag=mode == "zigzag", block_kernel=kernel)
    (out * w[:, :, pos].to(dtype)).sum().backward()
    errs = [(out.double() - ref[:, :, pos]).abs().max()]
    errs += [(loc.grad.double() - ref_t.grad[:, :, pos]).abs().max() for loc, ref_t in zip(local, full)]
    return max(float(e.detach()) for e in errs)


def _all_cases(rank, world):
    import torch.distributed as dist

    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pair = pairs[rank // 2]
    results = {}
    for kernel in ("flash_cpu", "math"):
        for mode in ("zigzag", "contiguous"):
            for causal in (True, False):
                name = f"ring-{kernel}-{mode}-causal{int(causal)}"
                results[f"{name}-sp4"] = _case(4, rank, None, mode, causal, 1, kernel=kernel)
                results[f"{name}-sp2"] = _case(2, rank % 2, pair, mode, causal, 2 + rank // 2, kernel=kernel)
    results["ulysses-causal-sp2"] = _case(2, rank % 2, pair, "ulysses", True, seed=5)
    results["ulysses-sp4"] = _case(4, rank, None, "ulysses", False, seed=6)
    # GQA (2 K/V heads for 4 query heads): the ring moves unrepeated K/V; Ulysses moves them as they
    # are when sp divides them (sp=2), repeated once first otherwise (sp=4).
    for kernel in ("flash_cpu", "math"):
        results[f"gqa-ring-{kernel}-sp4"] = _case(4, rank, None, "zigzag", True, 7, kernel=kernel, kv_heads=2)
        results[f"gqa-ring-{kernel}-sp2"] = _case(2, rank % 2, pair, "contiguous", True, 8, kernel=kernel, kv_heads=1)
    results["gqa-ulysses-sp2"] = _case(2, rank % 2, pair, "ulysses", True, 9, kv_heads=2)
    results["gqa-ulysses-sp4"] = _case(4, rank, None, "ulysses", True, 10, kv_heads=2)
    # bf16 inputs: the merge still accumulates in fp32, so the error is bf16 rounding, not worse
    for kernel in ("flash_cpu", "math"):
        results[f"bf16-ring-{kernel}-sp4"] = _case(4, rank, None, "zigzag", True, 1, torch.bfloat16, kernel)
    results["sinks-ulysses-sp2"] = _sinks_case(2, rank % 2, pair, seed=11)
    results["sinks-ulysses-sp4"] = _sinks_case(4, rank, None, seed=12)
    try:  # 3 heads over sp=2: refused before any collective
        ulysses_attention(*(torch.zeros(1, 3, 4, 2) for _ in range(3)), pair, lambda a, b, c: a)
        results["ulysses-refuses-3-heads"] = False
    except ValueError as e:
        results["ulysses-refuses-3-heads"] = "divisible by sp" in str(e)
    return results


def _gpt_oss_eager(q, k, v, sinks):
    """transformers' own eager attention of gpt-oss (causal mask, sink logits), q/k/v [B, H|KV, S, D]."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    n = q.shape[2]
    mask = torch.zeros(n, n, dtype=q.dtype).masked_fill(
        ~torch.ones(n, n, dtype=torch.bool).tril(), torch.finfo(q.dtype).min
    )
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    out, _ = eager_attention_forward(module, q, k, v, mask[None, None], scaling=q.shape[-1] ** -0.5)
    return out.transpose(1, 2)  # [B, H, S, D]


def _sinks_case(sp, sp_rank, group, seed):
    """partrain's Ulysses attention of a module with sink logits (gpt-oss) against transformers' eager
    attention of the whole sequence: each sp rank must add the sinks of the heads it runs."""
    from types import SimpleNamespace

    from partrain.parallel.context_parallel import SP_ATTR, SequenceShard, _sp_attention

    gen = torch.Generator().manual_seed(seed)
    q, w = (torch.randn(B, H, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, 2, S, D, generator=gen, dtype=torch.float64) for _ in range(2))
    sinks = torch.randn(H, generator=gen, dtype=torch.float64) * 3  # large, and different per head
    full = [t.clone().requires_grad_(True) for t in (q, k, v, sinks)]
    ref = _gpt_oss_eager(*full)
    (ref * w).sum().backward()
    pos = contiguous_positions(S, sp, sp_rank)
    local = [t[:, :, pos].clone().requires_grad_(True) for t in (q, k, v)]
    mine = sinks.clone().requires_grad_(True)
    module = SimpleNamespace(is_causal=True, **{SP_ATTR: SequenceShard("ulysses", sp, sp_rank, group)})
    out, _ = _sp_attention(module, *local, None, scaling=D**-0.5, s_aux=mine)  # [B, S, H, D]
    (out.transpose(1, 2) * w[:, :, pos]).sum().backward()
    # Each rank's sink gradient covers its own heads over the whole sequence: the sum over ranks is the whole.
    import torch.distributed as dist

    sink_grad = mine.grad.clone()
    dist.all_reduce(sink_grad, group=group)
    errs = [(out.transpose(1, 2) - ref[:, :, pos]).abs().max(), (sink_grad - full[3].grad).abs().max()]
    errs += [(loc.grad - ref_t.grad[:, :, pos]).abs().max() for loc, ref_t in zip(local, full)]
    return max(float(e.detach()) for e in errs)


@pytest.mark.slow
def test_ring_and_ulysses_match_full_attention(tmp_path):
    for rank, results in enumerate(run_spawned(_all_cases, 4, tmp_path)):
        assert results.pop("ulysses-refuses-3-heads") is True
        assert results.pop("bf16-ring-flash_cpu-sp4") < 0.05 and results.pop("bf16-ring-math-sp4") < 0.05
        assert len(results) == 26
        for name, err in results.items():
            assert err < 1e-6, (rank, name, err)


def test_positions_partition_the_sequence():
    for sp in (1, 2, 4):
        zz = torch.cat([zigzag_positions(32, sp, r) for r in range(sp)])
        cont = torch.cat([contiguous_positions(32, sp, r) for r in range(sp)])
        assert sorted(zz.tolist()) == list(range(32)) and cont.tolist() == list(range(32))
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]


def test_bad_shapes_are_refused():
    q = torch.zeros(1, 2, 5, 4)
    with pytest.raises(ValueError, match="even local sequence length"):
        ring_attention(q, q, q, None, causal=True, zigzag=True)
    with pytest.raises(ValueError, match="multiple of 4"):
        zigzag_positions(10, 2, 0)
    with pytest.raises(ValueError, match="must divide the query heads"):
        ring_attention(q, torch.zeros(1, 3, 5, 4), torch.zeros(1, 3, 5, 4), None, causal=True, zigzag=False)


def test_size_one_group_is_plain_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for kernel in ("flash_cpu", "math"):
        for zigzag in (True, False):
            out = ring_attention(q, k, v, None, causal=True, zigzag=zigzag, block_kernel=kernel)
            assert torch.allclose(out, _full(q, k, v, True), atol=1e-12)
        small = [t.detach()[:1, :2, :4, :2].clone().requires_grad_(True) for t in (q, k, v)]
        assert torch.autograd.gradcheck(
            lambda a, b, c: ring_attention(a, b, c, None, causal=True, zigzag=True, block_kernel=kernel),
            small,
            fast_mode=True,
        )


def test_autocast_inputs_are_cast_like_sdpa():
    """Llama's rotary gives fp32 q, k beside a 16-bit v under autocast: the ring takes them as SDPA would."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=gen) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ring_attention(q, k, v.bfloat16(), None, causal=True, zigzag=True)
        ref = _full(q, k, v.bfloat16(), True)
    assert out.dtype == ref.dtype == torch.bfloat16
    print(f"bf16 ring vs SDPA: largest difference {(out.float() - ref.float()).abs().max().item():.2e} (2e-2 allowed)")
    assert torch.allclose(out.float(), ref.float(), atol=2e-2)
    with pytest.raises(ValueError, match="share a dtype"):
        ring_attention(q, k, v.bfloat16(), None, causal=True, zigzag=True)
