"""Activation recompute: saved-activation bytes per microbatch and step time for none / selective / full.

    python benchmarks/recompute.py [--arch llama|gpt2] [--seq 256] [--micro 4] [--steps 8]

One process, one thread, the same model, data and seed for the three policies (partrain's own
build -> apply_recompute -> materialize path). Saved bytes are counted with saved-tensor hooks
during the forward of one microbatch (distinct storages, parameters excluded). Also checks that
the losses are identical and that under `full` each decoder block keeps at most its inputs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from partrain.blueprint.config.schema import ModelConfig
from partrain.models.adapters import get_adapter
from partrain.models.build import build_meta_model
from partrain.models.loss import forward_loss
from partrain.models.materialize import materialize
from partrain.parallel.recompute import apply_recompute
from partrain.runtime.activations import SavedActivations

CONFIGS = {
    "llama": dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "gpt2": dict(
        vocab_size=256,
        n_embd=256,
        n_layer=4,
        n_head=8,
        n_positions=1024,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
}


def build(arch: str, policy: str):
    cfg = ModelConfig(arch=arch, config=CONFIGS[arch])
    model = build_meta_model(cfg)
    apply_recompute(model, get_adapter(model), policy)
    return materialize(model, cfg, seed=3, device="cpu").train()


def measure(arch: str, policy: str, seq: int, micro: int, steps: int) -> dict:
    model = build(arch, policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    gen = torch.Generator().manual_seed(0)
    times, losses, saved = [], [], None
    for _ in range(steps):
        ids = torch.randint(0, 256, (micro, seq + 1), generator=gen)
        t0 = time.perf_counter()
        with SavedActivations() as counted:
            loss = forward_loss(model, ids[:, :-1], ids[:, 1:])
        saved = saved if saved is not None else counted.total
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"saved_bytes": saved, "step_ms": statistics.median(times[2:] or times) * 1e3, "losses": losses}


def block_saved_bytes(arch: str, policy: str, seq: int, micro: int) -> tuple:
    """(saved bytes of one decoder block, bytes of its inputs) for one microbatch."""
    model = build(arch, policy)
    adapter = get_adapter(model)
    layer = adapter.layers(model)[0]
    captured = {}

    def grab(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, kwargs

    handle = layer.register_forward_pre_hook(grab, with_kwargs=True)
    ids = torch.randint(0, 256, (micro, seq))
    with torch.no_grad():
        forward_loss(model, ids, ids)
    handle.remove()
    args = [a.detach() if torch.is_tensor(a) else a for a in captured["args"]]
    kwargs = {
        k: (v.detach() if torch.is_tensor(v) else tuple(x.detach() for x in v) if isinstance(v, tuple) else v)
        for k, v in captured["kwargs"].items()
    }
    inputs = sum(
        t.numel() * t.element_size()
        for t in list(args) + [x for v in kwargs.values() for x in (v if isinstance(v, tuple) else [v])]
        if torch.is_tensor(t)
    )
    with SavedActivations() as counted:
        out = layer(*args, **kwargs)
    del out
    return counted.total, inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=sorted(CONFIGS))
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {p: measure(args.arch, p, args.seq, args.micro, args.steps) for p in ("none", "selective", "full")}
    base = results["none"]
    print(
        f"{args.arch}: hidden {CONFIGS[args.arch].get('hidden_size', CONFIGS[args.arch].get('n_embd'))}, 4 layers, "
        f"micro batch {args.micro} x seq {args.seq}, fp32, 1 thread"
    )
    print(f"{'policy':<10} {'saved MiB/microbatch':>22} {'vs none':>8} {'step ms':>9} {'vs none':>8}")
    for policy, r in results.items():
        print(
            f"{policy:<10} {r['saved_bytes'] / 2**20:>22.2f} {r['saved_bytes'] / base['saved_bytes']:>8.2f} "
            f"{r['step_ms']:>9.1f} {r['step_ms'] / base['step_ms']:>8.2f}"
        )
    same = all(r["losses"] == base["losses"] for r in results.values())
    print(f"losses identical across policies: {same}")
    block, inputs = block_saved_bytes(args.arch, "full", args.seq, args.micro)
    print(
        f"full recompute, one decoder block: saves {block / 2**20:.3f} MiB, its inputs are {inputs / 2**20:.3f} MiB "
        f"-> {'OK' if block <= inputs else 'MORE THAN INPUTS'}"
    )


if __name__ == "__main__":
    main()
