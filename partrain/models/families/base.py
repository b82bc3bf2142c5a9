"""The shape of one family's runtime description: where things live inside an HF causal LM, and
partrain's own tensor-parallel layer plan where transformers ships none.

Paths are dotted FQNs from the root of the `*ForCausalLM` model (e.g. "model.layers"); paths
called `*_attr` are relative to one decoder layer (e.g. "mlp.experts"). This module imports neither
torch nor transformers, so dry runs can use it cheaply.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

if TYPE_CHECKING:  # pragma: no cover - typing only
    from torch import nn


@dataclass(frozen=True)
class Conv1DBlock:
    """One block of a decoder layer (attention or MLP) under partrain's own TP plan: HF Conv1D
    projections (weight stored [in, out]), column-parallel ones first, then row-parallel ones."""

    path: str
    """The block inside a layer ("attn", "mlp")."""
    column: Tuple[Tuple[str, int], ...]
    """(projection, fused parts) of each column-parallel projection: a fused [q | k | v] output has
    3 parts and each rank takes its own share of every part, not a slice of the whole."""
    row: Tuple[str, ...]
    """Row-parallel projections (their output is the block's output)."""
    per_rank: Tuple[str, ...] = ()
    """Attributes of the block that count heads or widths, divided by tp once the block is sliced."""


@dataclass(frozen=True)
class Conv1DLayerPlan:
    """partrain's tensor-parallel plan of one decoder layer, for a family whose HF class has no
    `base_model_tp_plan` (GPT-2); partrain.parallel.tensor_parallel applies it."""

    blocks: Tuple[Conv1DBlock, ...]
    sequence_norms: Tuple[str, ...] = ()
    """Norms inside a layer that run on sequence shards under Megatron-SP."""
    sequence_dropouts: Tuple[str, ...] = ()
    """Dropouts inside a layer that run on sequence shards under Megatron-SP."""


@dataclass(frozen=True)
class LegacyExperts:
    """How `save_pretrained` lays the experts out on disk: one Linear per expert.

    transformers 5 keeps experts as two 3-D parameters (`gate_up_proj` [E, 2I, H] and `down_proj`
    [E, H, I]) but still writes checkpoints in the older per-expert form, so a loader must stack them.
    """

    file_experts_attr: str
    """Experts container in the file, relative to a layer (Mixtral: "block_sparse_moe.experts")."""
    gate: str
    """Per-expert gate projection name (Mixtral: w1, Qwen2-MoE: gate_proj)."""
    up: str
    """Per-expert up projection name (Mixtral: w3, Qwen2-MoE: up_proj)."""
    down: str
    """Per-expert down projection name (Mixtral: w2, Qwen2-MoE: down_proj)."""


@dataclass(frozen=True)
class Adapter:
    """Layout of one HF family. Every path is a dotted submodule path (see module docstring)."""

    family: str
    """Short family name used in reports (gpt2, llama, mixtral, qwen2_moe, qwen3_moe)."""
    archs: Tuple[str, ...]
    """HF `model_type`s this adapter describes."""
    base_prefix: str
    """Attribute of the causal-LM wrapper holding the base model ("model" or "transformer")."""
    layer_prefix: str
    """The decoder-layer container ("model.layers"); layer i is f"{layer_prefix}.{i}"."""
    embedding_paths: Tuple[str, ...]
    """Input embeddings, token first (GPT-2 adds learned positions "transformer.wpe")."""
    final_norm_path: str
    """Norm applied after the last decoder layer."""
    lm_head_path: str = "lm_head"
    """Output projection to the vocabulary."""
    rotary_path: Optional[str] = None
    """Rotary-embedding module (None when positions are learned, as in GPT-2)."""
    attention_attr: str = "self_attn"
    """Attention block inside a layer."""
    mlp_attr: str = "mlp"
    """MLP (or MoE block) inside a layer."""
    conv1d_weights: bool = False
    """Projections are HF Conv1D: weight stored [in, out], so column-parallel shards dim 1, not 0."""
    fused_qkv_attr: Optional[str] = None
    """One projection producing [q | k | v] (GPT-2 "attn.c_attn"); TP must split each part, not the whole."""
    is_moe: bool = False
    """Whether layers may hold routed experts."""
    experts_attr: Optional[str] = None
    """Experts module inside a layer; its parameters are 3-D with the expert index first."""
    expert_param_names: Tuple[str, ...] = ()
    """Parameters of the experts module (each [num_experts, ...])."""
    router_attr: Optional[str] = None
    """Router (top-k gate) inside a layer."""
    shared_expert_attr: Optional[str] = None
    """Always-on shared expert MLP inside a layer (Qwen2-MoE)."""
    legacy_experts: Optional[LegacyExperts] = None
    """On-disk per-expert layout written by save_pretrained (see LegacyExperts)."""
    checkpoint_renames: Tuple[Tuple[str, str], ...] = ()
    """(in the model, in the file) substrings: names save_pretrained writes differently."""
    layer_tp_plan: Optional[Conv1DLayerPlan] = None
    """partrain's own TP plan of a decoder layer; None: transformers' `base_model_tp_plan` is used."""
    layer_norms: Tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    """The norms of a decoder layer on the residual stream (Megatron-SP runs them on sequence shards and
    sums their weights' gradients over tp); Gemma 3 adds pre/post_feedforward_layernorm."""
    embedding_multiplier_key: Optional[str] = None
    """Config key of a factor the HF base model's forward multiplies the token embeddings by (Granite:
    "embedding_multiplier"). A pipeline stage runs the layers itself, not that forward, so it applies it."""
    logits_divisor_key: Optional[str] = None
    """Config key of a divisor the HF causal-LM forward applies to the head's logits (Granite:
    "logits_scaling"); the pipeline's last stage applies it. The head is linear without bias, so dividing
    its input is the same: the chunked loss, whose passthrough head gets HF's division, needs nothing."""
    logits_multiplier_key: Optional[str] = None
    """Config key of a factor the HF causal-LM forward multiplies the head's logits by (Cohere 2:
    "logit_scale"); the pipeline's last stage applies it, as it does logits_divisor_key."""

    # ---- lookups -------------------------------------------------------------------------------

    def layers(self, model: "nn.Module") -> "nn.Module":
        """The decoder-layer container (an nn.ModuleList; a pipeline stage may hold a ModuleDict)."""
        return model.get_submodule(self.layer_prefix)

    def layer_fqn(self, index: int) -> str:
        """FQN of decoder layer `index` in the unsplit model."""
        return f"{self.layer_prefix}.{index}"

    def embeddings(self, model: "nn.Module") -> List["nn.Module"]:
        """Embedding modules present in `model` (a later pipeline stage has none)."""
        return [m for m in (_maybe_submodule(model, p) for p in self.embedding_paths) if m is not None]

    def final_norm(self, model: "nn.Module") -> Optional["nn.Module"]:
        return _maybe_submodule(model, self.final_norm_path)

    def lm_head(self, model: "nn.Module") -> Optional["nn.Module"]:
        return _maybe_submodule(model, self.lm_head_path)

    def rotary(self, model: "nn.Module") -> Optional["nn.Module"]:
        return _maybe_submodule(model, self.rotary_path) if self.rotary_path else None

    def position_embeddings(self, rotary: "nn.Module", hidden: Any, position_ids: Any, layer_type: str) -> Any:
        """What HF's base model hands a decoder layer of `layer_type` as position_embeddings: a rotary module
        whose forward takes a `layer_type` (Gemma 3, OLMo 3: local and global layers rotate with different
        bases) gets it, as the family's own forward gives it."""
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            return rotary(hidden, position_ids, layer_type)
        return rotary(hidden, position_ids)

    def attention(self, layer: "nn.Module") -> "nn.Module":
        return layer.get_submodule(self.attention_attr)

    def mlp(self, layer: "nn.Module") -> "nn.Module":
        return layer.get_submodule(self.mlp_attr)

    def experts(self, layer: "nn.Module") -> Optional["nn.Module"]:
        """Experts module of `layer`, or None (dense model, or a Qwen2-MoE dense-only layer)."""
        return _maybe_submodule(layer, self.experts_attr) if self.experts_attr else None

    def router(self, layer: "nn.Module") -> Optional["nn.Module"]:
        return _maybe_submodule(layer, self.router_attr) if self.router_attr else None

    def tied_embeddings(self, model_or_config: Any) -> bool:
        """Whether lm_head shares its weight with the token embedding (read from the HF config)."""
        config = getattr(model_or_config, "config", model_or_config)
        return bool(getattr(config, "tie_word_embeddings", False))

    def hf_plan(self, model_or_config: Any, kind: str) -> Optional[Dict[str, Any]]:
        """transformers' own plan for the base model, kind in {"tp", "ep", "pp"}, with root FQNs.

        These class attributes (`base_model_tp_plan`, ...) are the source of truth where they exist;
        None means HF has none (GPT-2) and partrain must supply its own.
        """
        config = getattr(model_or_config, "config", model_or_config)
        plan: Optional[Mapping[str, Any]] = getattr(config, f"base_model_{kind}_plan", None)
        if not plan:
            return None
        return {f"{self.base_prefix}.{key}": value for key, value in plan.items()}


def _maybe_submodule(module: "nn.Module", path: Optional[str]) -> Optional["nn.Module"]:
    """Submodule at `path`, or None when absent (pipeline stages drop modules or set them to None)."""
    if not path:
        return None
    current: Any = module
    for part in path.split("."):
        current = getattr(current, part, None)
        if current is None:
            return None
    return current
