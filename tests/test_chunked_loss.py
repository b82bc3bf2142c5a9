"""The chunked output head + cross-entropy (`train.loss_chunk_tokens`) against the plain HF head:
same loss and gradients (1e-6, fp32, in-process), and no [tokens x vocab] tensor saved for backward.
The multi-process parity (TP loss parallel, FSDP, pipeline) is in tests/test_compile.py's shared launch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from partrain.blueprint.config.schema import ModelConfig
from partrain.models.build import build_meta_model
from partrain.models.loss import IGNORE_INDEX, forward_loss
from partrain.models.materialize import materialize

VOCAB = 256
TINY = {
    "gpt2": dict(
        n_embd=32,
        n_layer=1,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    ),
}


def _model(arch: str):
    cfg = ModelConfig(arch=arch, config=TINY[arch], name=f"{arch}-tiny")
    return materialize(build_meta_model(cfg), cfg, seed=3, device="cpu").train()


def _loss_and_grads(model, ids, labels, chunk):
    model.zero_grad(set_to_none=True)
    loss = forward_loss(model, ids, labels, head_path="lm_head", chunk_tokens=chunk)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_chunked_loss_matches_plain(arch):
    model = _model(arch)
    ids = torch.randint(0, VOCAB, (3, 37), generator=torch.Generator().manual_seed(1))
    labels = F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)
    labels[1, :5] = IGNORE_INDEX  # ignored tokens do not count, in any chunk
    plain, plain_grads = _loss_and_grads(model, ids, labels, chunk=0)
    # 3 x 37 tokens: 7 positions per chunk -> 6 chunks, the last one short; and one chunk of everything
    for chunk in (21, 3, 4096):
        loss, grads = _loss_and_grads(model, ids, labels, chunk)
        torch.testing.assert_close(loss, plain, rtol=1e-6, atol=1e-6)
        for name, g in plain_grads.items():
            torch.testing.assert_close(grads[name], g, rtol=1e-6, atol=1e-6, msg=f"{arch} chunk {chunk} {name}")
    assert isinstance(model.get_submodule("lm_head"), torch.nn.Linear)  # the head is back in place


def test_chunked_loss_saves_no_logits():
    """The autograd graph keeps no [*, vocab] tensor: chunks' logits are recomputed in backward."""
    model = _model("llama")
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    labels = F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)

    def vocab_sized(chunk):
        saved = []

        def pack(t):
            if t.dim() >= 2 and t.shape[-1] == VOCAB and not isinstance(t, torch.nn.Parameter):
                saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward_loss(model, ids, labels, head_path="lm_head", chunk_tokens=chunk).backward()
        return saved

    assert sum(vocab_sized(0)) >= 64 * VOCAB  # the plain head keeps its logits
    assert vocab_sized(16) == []
