"""What the planner knows about one model family, and the plain values every family file builds.

A `Family` is the planner's (torch-free) half of a family: how its HF config kwargs become
`ModelFacts` fields and `ModelExtras`, every parameter tensor of the model (names, shapes, how
tensor and expert parallelism split them), and the few traits the memory, FLOPs and compute
formulas of partrain/blueprint/planner/ branch on. The runtime half is partrain/models/families/.
Family files import nothing of the planner: they sit below it (and below model_facts), so the
planner asks them and never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from partrain.errors import ConfigError, Problem

Shape = Tuple[int, ...]
Values = Dict[str, Any]
"""Merged HF config kwargs (class defaults <- config.json <- model.config): model_facts.merged_kwargs."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    """FQN in the HF model (as named_parameters yields it)."""
    shape: Shape
    part: str
    """embed, layer, final (final norm) or head (an untied lm_head)."""
    layer: int = -1
    """Decoder layer index for part == layer."""
    tp_dim: Optional[int] = None
    """Dimension split by tensor parallelism; None = replicated over the TP group."""
    expert: bool = False
    """Stacked experts: dim 0 is the expert index, split by expert parallelism."""
    trainable: bool = True
    """Takes a gradient and optimizer state (False: a base weight frozen under LoRA)."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def local_shape(self, tp: int = 1, ep: int = 1) -> Shape:
        """Shape on one rank after tensor and expert parallelism (both split evenly: validated)."""
        shape = list(self.shape)
        if self.tp_dim is not None and tp > 1:
            shape[self.tp_dim] //= tp
        if self.expert and ep > 1:
            shape[0] //= ep
        return tuple(shape)


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents."""

    q_lora_rank: int
    """Width of the query latent (q_a_proj's output); 0: one q_proj straight from the hidden state."""
    kv_lora_rank: int
    """Width of the key/value latent shared by every head (kv_b_proj expands it per head)."""
    qk_nope_head_dim: int
    """Per-head query/key width without rotary."""
    qk_rope_head_dim: int
    """Rotary width, per query head; one rotary key part is shared by every head."""
    v_head_dim: int
    """Per-head value width."""


@dataclass(frozen=True)
class ModelExtras:
    """Model details beyond ModelFacts that change memory or FLOPs."""

    activation: str = "silu"
    """MLP activation (HF name): gelu_new (GPT-2's Python tanh-GELU), gelu, silu, ..."""
    resid_dropout: bool = False
    """Dropout after the attention and MLP output projections (GPT-2 resid_pdrop > 0)."""
    embd_dropout: bool = False
    """Dropout on the input embeddings (GPT-2 embd_pdrop > 0)."""
    attn_dropout: bool = False
    """Dropout on the attention probabilities."""
    attn_impl: str = "sdpa"
    """HF attention implementation; sdpa/flash never store the s x s scores, eager does."""
    out_bias: bool = False
    """Attention output projection has a bias (GPT-2 always; Llama with attention_bias)."""
    mlp_bias: bool = False
    """MLP projections have biases (GPT-2 always; Llama with mlp_bias)."""
    dense_ffn: int = 0
    """Width of the dense MLP of layers without experts (Qwen2-MoE intermediate_size); 0 = facts.ffn."""
    sparse_layers: Tuple[bool, ...] = ()
    """For each decoder layer, whether it holds experts (empty for dense models)."""
    norm_topk_prob: bool = True
    """MoE router renormalises the top-k weights (Mixtral yes, Qwen2-/Qwen3-MoE by default no)."""


@dataclass(frozen=True)
class Family:
    """The planner's description of one HF architecture (`arch`, its `model_type`).

    `facts` and friends take a `ModelFacts` (typed Any here: model_facts sits above this package).
    """

    name: str
    """Family whose files describe it (gpt2, llama, mixtral, qwen2_moe, qwen3_moe); mistral and
    qwen2 are variants of llama."""
    arch: str
    """HF model_type."""
    facts: Callable[[Values, str], Dict[str, Any]]
    """(values, arch) -> the ModelFacts fields besides arch and config_class."""
    extras: Callable[[Values, Any, str], ModelExtras]
    """(values, facts, attention implementation) -> ModelExtras."""
    default_extras: Callable[[Any], ModelExtras]
    """facts -> ModelExtras when only the facts are known (HF defaults, no dropout)."""
    embed_tensors: Callable[[Any], List[TensorSpec]]
    """facts -> parameters of the first pipeline chunk besides its layers, token embedding first."""
    layer_tensors: Callable[[Any, ModelExtras, int], List[TensorSpec]]
    """(facts, extras, i) -> parameters of decoder layer i, in HF's registration order."""
    final_norm_tensors: Callable[[Any], List[TensorSpec]]
    """facts -> parameters of the norm after the last layer."""
    config_keys: Mapping[str, str] = field(default_factory=dict)
    """Generic size name (hidden, ffn, layers, heads, kv_heads, vocab, positions) -> HF config key."""
    block: str = "llama"
    """Decoder-block shape the planner's memory, FLOPs and kernel models count: "gpt2" (LayerNorm,
    one fused Conv1D q|k|v, GELU MLP, learned positions) or "llama" (RMSNorm, separate q, k, v,
    rotary positions, gated MLP or MoE)."""
    qk_norm: bool = False
    """Per-head RMSNorm of q and k inside attention (Qwen3-MoE), replicated over TP."""
    residual_norms: int = 2
    """RMSNorms of a Llama-style layer on the residual stream: 2 (before attention and before the MLP);
    Gemma 3 has 4 (also after each)."""
    shared_expert: bool = False
    """An always-on shared expert beside the routed ones, with its own sigmoid gate (Qwen2-MoE)."""
    router_bias: bool = False
    """The router adds a per-expert bias to its scores when it picks the experts, not when it weights them
    (DeepSeek-V3's e_score_correction_bias): what parallel.moe_bias_update_speed moves."""
    moe_input_casts: int = 1
    """16-bit copies autocast keeps of a MoE block's input: one per projection reading it (Qwen2-MoE:
    router, experts, shared expert, shared-expert gate)."""
    routing_weights_in_compute_dtype: bool = False
    """Each (token, expert) routing weight is kept in the compute dtype (Qwen-MoE), not fp32 (Mixtral)."""
    lora_projections: Tuple[str, ...] = ()
    """Projections LoRA can adapt (nn.Linear or Conv1D modules), also peft's default target_modules."""
    conv1d_projections: Tuple[str, ...] = ()
    """Projections that are HF Conv1D modules, weight stored [in, out] (GPT-2)."""
    undeclared_fields: Mapping[str, Any] = field(default_factory=dict)
    """Config keys the HF modeling code reads (getattr with a default) that the config class does not
    declare, with their defaults: model.config may set them."""
    tp_plan_gathers: bool = False
    """transformers' tp plan gathers some column projections' outputs (`colwise_gather_output`: OLMo 2's
    norms over the whole q and k, Phi-3's and GLM-4's fused projections): what follows them runs whole
    on every rank, and Megatron-SP, which keeps each block's input as a sequence shard, is not derived."""
    generic: bool = False
    """A family on the generic path (families/generic.py): Llama's tensors found by building it, not a
    family file; dp, ZeRO/FSDP, tp and LoRA only."""
    attention_sinks: bool = False
    """Attention adds a learned sink logit per head to every softmax (gpt-oss): transformers has no SDPA
    path for it (eager attention by default, model.config.attn_implementation=sdpa refused), partrain's
    Ulysses attention slices the sinks by head, and ring attention is refused."""
    window_always: bool = False
    """The HF class applies config.sliding_window whenever it is set (Mistral, Mixtral); the others
    only with use_sliding_window or "sliding_attention" layer_types."""

    def hf_config(self, **sizes: int) -> Dict[str, int]:
        """HF config kwargs for generic sizes (hidden=..., layers=...); a size the family has no key
        for (GPT-2 has no kv_heads) is left out."""
        return {self.config_keys[k]: v for k, v in sizes.items() if k in self.config_keys}


# ---- reading HF config values (shared by the family files) ----------------------------------------

MAX_LAYERS = 100_000
"""Most decoder layers a model may have: the planner and the dry run keep figures per layer, and no
real model comes near it (GPT-3 175B has 96, Llama 3 405B 126)."""


def positive_int(values: Values, name: str, arch: str) -> int:
    value = values.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            Problem(f"model.config.{name}", value, f"{arch} needs a positive integer here", f"set model.config.{name}")
        )
    return value


def layer_count(values: Values, name: str, arch: str) -> int:
    n = positive_int(values, name, arch)
    if n > MAX_LAYERS:
        raise ConfigError(
            Problem(
                f"model.config.{name}",
                n,
                f"more than {MAX_LAYERS:,} layers (the planner keeps figures per layer)",
                f"set model.config.{name} to the model's real depth",
            )
        )
    return n


def optional_int(values: Values, name: str, arch: str) -> Optional[int]:
    """A field HF derives when it is unset (None); when set, a positive integer."""
    return None if values.get(name) is None else positive_int(values, name, arch)


def must_divide(part: int, whole: int, key: str, rule: str) -> None:
    if whole % part:
        raise ConfigError(
            Problem(key, part, f"{rule}; {whole} % {part} = {whole % part}", f"choose a divisor of {whole}")
        )
