"""Packed against padded fine-tuning examples (data.packing), one process, a tiny Llama on CPU.

A generated chat set of varied lengths (answers from a few bytes to several hundred) is rendered with
the byte tokenizer and chatml into the examples cache, then served both ways by partrain's own loaders
(PackedExampleBatches / ExampleBatches). Each way trains the same model for the same number of steps
(forward, backward, AdamW); reported: padding share of the rows, real (non-padding) tokens per second,
and the ratio packed / padded. Then the attention choice for document masks on one layer's shapes:
SDPA with the boolean block-diagonal mask Hugging Face derives from restarting position ids (what
partrain uses), a per-document loop of causal SDPA, and flex attention (where torch runs it on CPU).

    python benchmarks/packing.py [--steps 8] [--seq-len 512] [--batch 8] [--rows 600]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from partrain.blueprint.config.schema import DataConfig
from partrain.data.example_batches import ExampleBatches
from partrain.data.example_packing import PackedExampleBatches
from partrain.data.examples import prepare_examples
from partrain.models.loss import forward_loss, label_weight


def chat_rows(n: int, seed: int = 0) -> list:
    """Chats whose answers range from a few bytes to ~600 (a long tail, as real SFT sets have)."""
    rng = random.Random(seed)
    words = "lamp river stone cloud apple tiger music paper glass orbit bread field chair smile".split()
    rows = []
    for i in range(n):
        length = int(min(600, rng.expovariate(1 / 90))) + 1
        answer = " ".join(rng.choice(words) for _ in range(max(1, length // 6)))
        rows.append(
            {"messages": [{"role": "user", "content": f"Say {i} words"}, {"role": "assistant", "content": answer}]}
        )
    return rows


def tiny_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        use_cache=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def train(batches, steps: int) -> dict:
    """Real tokens / s over `steps` steps after one warm-up step."""
    model = tiny_llama().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    real, elapsed = 0, 0.0
    for step in range(steps + 1):
        inputs, labels, *positions = batches.rank_batch(step)
        t0 = time.perf_counter()
        loss = forward_loss(model, inputs, labels, *positions) * label_weight(labels, batches.label_share(step))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:  # the first step pays one-off costs
            elapsed += time.perf_counter() - t0
            pad = inputs == batches_pad_id(batches)
            real += int(inputs.numel() - (pad & (labels == -100)).sum())
    return {"tokens_per_s": real / elapsed, "step_s": elapsed / steps, "loss": float(loss.detach())}


def batches_pad_id(batches) -> int:
    rows = batches._rows
    return rows.examples.pad_id


def attention_choices(seq_len: int, batch: int, repeats: int = 5) -> dict:
    """Forward + backward seconds of one attention call on packed rows, three ways."""
    torch.manual_seed(0)
    heads, dim = 4, 32
    q, k, v = (torch.randn(batch, heads, seq_len, dim, requires_grad=True) for _ in range(3))
    rng = random.Random(1)
    bounds = []
    for _ in range(batch):
        cuts, at = [0], 0
        while at < seq_len:
            at = min(seq_len, at + rng.randint(16, seq_len // 3))
            cuts.append(at)
        bounds.append(cuts)
    doc = torch.stack(
        [torch.repeat_interleave(torch.arange(len(c) - 1), torch.tensor(c[1:]) - torch.tensor(c[:-1])) for c in bounds]
    )
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    mask = (causal & (doc[:, :, None] == doc[:, None, :]))[:, None]

    def sdpa_mask():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def per_document():
        rows = []
        for b, cuts in enumerate(bounds):
            parts = [
                F.scaled_dot_product_attention(
                    q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], is_causal=True
                )
                for s, e in zip(cuts, cuts[1:])
            ]
            rows.append(torch.cat(parts, dim=2))
        return torch.cat(rows)

    ways = {"sdpa_bool_mask": sdpa_mask, "per_document_loop": per_document}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def same_doc(b, h, qi, ki):
            return (qi >= ki) & (doc[b, qi] == doc[b, ki])

        block = create_block_mask(same_doc, batch, None, seq_len, seq_len, device="cpu")
        ways["flex_attention"] = lambda: flex_attention(q, k, v, block_mask=block)
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        print(f"flex attention unavailable here: {type(exc).__name__}: {exc}"[:200])
    reference = sdpa_mask().detach()
    out = {}
    for name, fn in ways.items():
        try:
            got = fn()
            err = float((got.detach() - reference).abs().max())
            got.sum().backward()
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn().sum().backward()
            out[name] = {"fwd_bwd_ms": 1000 * (time.perf_counter() - t0) / repeats, "max_abs_diff": err}
        except Exception as exc:  # noqa: BLE001 - reported, not hidden
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rows", type=int, default=600)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "chat.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(args.rows)))
        cfg = DataConfig(source=str(source), tokenizer="byte", chat_template="chatml", eval_fraction=0.0, cache_dir=tmp)
        examples = prepare_examples(cfg)
        padded = ExampleBatches(examples, args.seq_len, args.batch, seed=0)
        packed = PackedExampleBatches(examples, args.seq_len, args.batch, seed=0)
        lengths = (examples.offsets[1:] - examples.offsets[:-1]).tolist()
        results = {
            "examples": examples.n_examples,
            "tokens_per_example": {"mean": sum(lengths) / len(lengths), "max": max(lengths)},
            "seq_len": args.seq_len,
            "padded": {"rows": padded.n_examples, "padding_share": padded_share(padded)},
            "packed": {"rows": packed.n_windows, "padding_share": packed.padding_share},
        }
        results["padded"].update(train(padded, args.steps))
        results["packed"].update(train(packed, args.steps))
    results["packed_over_padded_tokens_per_s"] = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
    results["attention"] = attention_choices(args.seq_len, args.batch)
    print(json.dumps(results, indent=2))


def padded_share(batches: ExampleBatches) -> float:
    from partrain.data.example_packing import padded_share as share

    return share(batches._rows.examples, batches.index, batches.seq_len)


if __name__ == "__main__":
    main()
