"""A pipeline chunk of an HF causal LM as one module: embeddings on the first chunk, a range of
decoder layers, the final norm and head on the last, keeping the full model's parameter names."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from partrain.models.adapters import Adapter
from partrain.models.logits import final_softcap, softcapped


class PipelineStageModule(nn.Module):
    """One pipeline chunk of an HF causal LM, with the full model's parameter FQNs.

    forward(x): the first chunk takes input_ids [b, s] (LongTensor), others hidden states
    [b, s, hidden]; the last chunk returns logits [b, s, vocab], others hidden states.
    """

    def __init__(self, full: nn.Module, adapter: Adapter, chunk_index: int, n_chunks: int, layer_range: range):
        super().__init__()
        if not 0 <= chunk_index < n_chunks:
            raise ValueError(f"chunk_index {chunk_index} outside 0..{n_chunks - 1}")
        self.adapter = adapter
        self.chunk_index, self.n_chunks = chunk_index, n_chunks
        self.is_first, self.is_last = chunk_index == 0, chunk_index == n_chunks - 1
        self.layer_ids = list(layer_range)
        self.config = full.config
        self.tied = adapter.tied_embeddings(full)
        self.seq_len: Optional[int] = None
        """Full sequence length when activations are sequence-sharded (SP); None = from the input."""
        self.position_ids: Optional[torch.Tensor] = None
        """[1, local seq] global positions of this rank's tokens under context parallelism (apply_sp)."""
        self.microbatch_position_ids: Optional[torch.Tensor] = None
        """[b, local seq] position ids of the microbatch being run (packed examples: restarting at 0 per
        example, which HF's mask builder turns into a block-diagonal mask); set by the runner before
        each forward, None = the positions above."""
        self.head_in_loss = False
        """Last chunk: return the final-norm output and leave the head to the loss (chunked loss,
        `train.loss_chunk_tokens`), so the stage never materialises the whole logits."""

        base_prefix = adapter.base_prefix
        base = full.get_submodule(base_prefix)
        layer_attr = adapter.layer_prefix[len(base_prefix) + 1 :]
        token_path = adapter.embedding_paths[0]
        keep_embed = set(adapter.embedding_paths) if self.is_first else set()
        if self.tied and self.is_last:
            keep_embed.add(token_path)  # the last chunk's copy of the tied weight, under its own FQN
        memo: Dict[int, Any] = {}  # one memo: weights tied in the full model stay tied in the copy

        container = nn.Module()
        for name, child in base.named_children():
            path = f"{base_prefix}.{name}"
            if name == layer_attr:
                layers = full.get_submodule(adapter.layer_prefix)
                container.add_module(
                    name, nn.ModuleDict({str(i): copy.deepcopy(layers[i], memo) for i in self.layer_ids})
                )
            elif path in adapter.embedding_paths:
                if path in keep_embed:
                    container.add_module(name, copy.deepcopy(child, memo))
            elif path == adapter.final_norm_path:
                if self.is_last:
                    container.add_module(name, copy.deepcopy(child, memo))
            elif next(child.parameters(), None) is None:
                container.add_module(name, copy.deepcopy(child, memo))  # rotary, dropout: every chunk
            else:
                raise NotImplementedError(f"pipeline split does not know where {path} belongs")
        self.add_module(base_prefix, container)  # registered first: its FQNs win for shared weights
        if self.is_last:
            head_path = adapter.lm_head_path
            if "." in head_path:
                raise NotImplementedError(f"nested lm_head path {head_path}")
            self.add_module(head_path, copy.deepcopy(full.get_submodule(head_path), memo))
        self._layer_attr = layer_attr
        self._mask_kinds = [_mask_kind(self.config, i) for i in self.layer_ids]

    # -- lookups --------------------------------------------------------------------------------
    def layers(self) -> nn.ModuleDict:
        """This chunk's decoder layers keyed by their index in the full model."""
        return getattr(self.get_submodule(self.adapter.base_prefix), self._layer_attr)

    def tied_weight(self) -> Optional[nn.Parameter]:
        """This chunk's copy of the tied embedding/head weight, or None (untied, or a middle chunk)."""
        if not self.tied or not (self.is_first or self.is_last):
            return None
        return self.get_submodule(self.adapter.embedding_paths[0]).weight

    def example_io(
        self, microbatch_size: int, seq_len: int, dtype: torch.dtype = torch.float32
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Meta tensors shaped like one microbatch's input and output (skips torch's shape inference)."""
        hidden, vocab = self.config.hidden_size, self.config.vocab_size
        if self.is_first:
            x = torch.empty(microbatch_size, seq_len, dtype=torch.long, device="meta")
        else:
            x = torch.empty(microbatch_size, seq_len, hidden, dtype=dtype, device="meta", requires_grad=True)
        out_dim = vocab if self.is_last and not self.head_in_loss else hidden
        y = torch.empty(microbatch_size, seq_len, out_dim, dtype=dtype, device="meta", requires_grad=True)
        return x, y

    # -- forward --------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        adapter, base = self.adapter, self.get_submodule(self.adapter.base_prefix)
        seq = self.seq_len or x.shape[1]
        if self.microbatch_position_ids is not None:
            position_ids = self.microbatch_position_ids.to(x.device)
        elif self.position_ids is None:
            position_ids = torch.arange(seq, device=x.device).unsqueeze(0)
        else:
            position_ids = self.position_ids.to(x.device)
        if self.is_first:
            h = self.get_submodule(adapter.embedding_paths[0])(x)
            if adapter.embedding_multiplier_key:  # what the HF base model's forward does after the lookup
                h = h * getattr(self.config, adapter.embedding_multiplier_key)
            for path in adapter.embedding_paths[1:]:  # learned positions (GPT-2 wpe)
                h = h + self.get_submodule(path)(position_ids)
            drop = getattr(base, "drop", None)
            if drop is not None:
                h = drop(h)
        else:
            h = x
        rotary = adapter.rotary(self)
        rotated = {}
        if rotary is not None:
            rotated = {
                kind: adapter.position_embeddings(rotary, h, position_ids, kind) for kind in set(self._mask_kinds)
            }
        masks = self._masks(h, position_ids)
        for (_name, layer), kind in zip(self.layers().items(), self._mask_kinds):
            extra = {"position_embeddings": rotated[kind]} if rotated else {}
            h = layer(h, attention_mask=masks[kind], position_ids=position_ids, **extra)
            if isinstance(h, tuple):  # older HF layers return (hidden, ...)
                h = h[0]
        if self.is_last:
            h = self.get_submodule(adapter.final_norm_path)(h)
            if not self.head_in_loss:
                h = self.get_submodule(adapter.lm_head_path)(h)
            if adapter.logits_divisor_key:
                # What HF's causal-LM forward does to the logits; with the head in the loss (chunked),
                # dividing its input is the same: the head is linear without bias.
                h = h / getattr(self.config, adapter.logits_divisor_key)
            if adapter.logits_multiplier_key:
                h = h * getattr(self.config, adapter.logits_multiplier_key)
            if not self.head_in_loss:  # with the head in the loss, the loss caps each chunk's logits
                h = softcapped(h, final_softcap(self.config))
        return h

    def _masks(self, h: torch.Tensor, position_ids: torch.Tensor) -> Dict[str, Optional[torch.Tensor]]:
        """HF's own causal masks for this chunk's layers: None under SDPA without padding (causal
        kernel), a real mask for eager attention or sliding windows shorter than the sequence."""
        from transformers.masking_utils import (
            create_causal_mask,
            create_sliding_window_causal_mask,
        )

        kwargs = dict(config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids)
        out: Dict[str, Optional[torch.Tensor]] = {}
        for kind in set(self._mask_kinds):
            fn = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
            out[kind] = fn(**kwargs)
        return out


def _mask_kind(config: Any, layer_index: int) -> str:
    """The attention type HF's base model gives decoder layer `layer_index`."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        return layer_types[layer_index]
    # Mistral, Mixtral, Phi-3: every layer whenever sliding_window is set. Qwen3-MoE: HF keeps
    # sliding_window only under use_sliding_window, and then masks every layer.
    if getattr(config, "model_type", "") in ("mistral", "mixtral", "phi3", "qwen3_moe") and getattr(
        config, "sliding_window", None
    ):
        return "sliding_attention"
    return "full_attention"


def build_stage_module(
    model: nn.Module, adapter: Adapter, chunk_index: int, n_chunks: int, layer_range: range
) -> PipelineStageModule:
    """The module of one chunk, cut from the full (meta) model; the full model is left unchanged.

    Holds decoder layers `layer_range` (a ModuleDict keyed by their original index), the embeddings
    on chunk 0, final norm + head on the last chunk (plus the tied embedding copy, see module
    docstring), and parameter-free modules (rotary, dropout) everywhere. Modules are deep copies,
    so two chunks on one rank never share a module.
    """
    return PipelineStageModule(model, adapter, chunk_index, n_chunks, layer_range)


def unwrap_ddp(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module
