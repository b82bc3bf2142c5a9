"""Every parameter tensor of the HF models partrain trains, from the model facts alone.

`param_tensors(facts)` lists (name, shape) exactly as `model.named_parameters()` of the HF
`*ForCausalLM` does (names, shapes; tied weights once), for gpt2, llama, qwen2, mistral, mixtral,
qwen2_moe and qwen3_moe; a test checks it against meta-built models. `tensor_specs` adds where each tensor lives
(embeddings, a decoder layer, final norm, head) and how partrain shards it:

- tensor parallel (partrain/parallel/tensor_parallel.py): Llama family: q/k/v/gate/up weights and
  q/k/v biases column-parallel (dim 0 of the [out, in] weight), o/down row-parallel (dim 1; their
  biases replicated), token embedding and lm_head vocabulary-parallel (dim 0). GPT-2 (Conv1D
  weights stored [in, out]): c_attn weight dim 1 + bias, attn.c_proj weight dim 0, mlp.c_fc weight
  dim 1 + bias, mlp.c_proj weight dim 0, wte dim 0 (tied with lm_head); c_proj biases, norms and
  wpe replicated. Routed experts, routers and Qwen2-MoE shared experts stay replicated over TP, and so
  do Qwen3-MoE's per-head q_norm / k_norm (their gradients summed over TP).
- expert parallel: stacked expert tensors ([E, ...]) are split on dim 0 over ep.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

from partrain.blueprint.model_facts import ModelFacts
from partrain.blueprint.planner.spec import ModelExtras, default_extras

Shape = Tuple[int, ...]


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


def _gpt2_layer(f: ModelFacts, i: int) -> List[TensorSpec]:
    h, ffn = f.hidden, f.ffn
    p = f"transformer.h.{i}."
    L = lambda name, shape, tp_dim=None: TensorSpec(p + name, shape, "layer", i, tp_dim)  # noqa: E731
    return [
        L("ln_1.weight", (h,)),
        L("ln_1.bias", (h,)),
        L("attn.c_attn.weight", (h, 3 * h), 1),
        L("attn.c_attn.bias", (3 * h,), 0),
        L("attn.c_proj.weight", (h, h), 0),
        L("attn.c_proj.bias", (h,)),
        L("ln_2.weight", (h,)),
        L("ln_2.bias", (h,)),
        L("mlp.c_fc.weight", (h, ffn), 1),
        L("mlp.c_fc.bias", (ffn,), 0),
        L("mlp.c_proj.weight", (ffn, h), 0),
        L("mlp.c_proj.bias", (h,)),
    ]


def _llama_layer(f: ModelFacts, x: ModelExtras, i: int) -> List[TensorSpec]:
    h = f.hidden
    q, kv = f.heads * f.head_dim, f.kv_heads * f.head_dim
    p = f"model.layers.{i}."
    L = lambda name, shape, tp_dim=None, expert=False: TensorSpec(p + name, shape, "layer", i, tp_dim, expert)  # noqa: E731
    out = [L("self_attn.q_proj.weight", (q, h), 0)]
    if f.qkv_bias:
        out.append(L("self_attn.q_proj.bias", (q,), 0))
    out.append(L("self_attn.k_proj.weight", (kv, h), 0))
    if f.qkv_bias:
        out.append(L("self_attn.k_proj.bias", (kv,), 0))
    out.append(L("self_attn.v_proj.weight", (kv, h), 0))
    if f.qkv_bias:
        out.append(L("self_attn.v_proj.bias", (kv,), 0))
    out.append(L("self_attn.o_proj.weight", (h, q), 1))
    if x.out_bias:
        out.append(L("self_attn.o_proj.bias", (h,)))
    if f.arch == "qwen3_moe":  # per-head RMSNorm of q and k: replicated over TP (HF: replicated_with_grad_allreduce)
        out += [L("self_attn.q_norm.weight", (f.head_dim,)), L("self_attn.k_norm.weight", (f.head_dim,))]
    sparse = f.is_moe and (x.sparse_layers[i] if x.sparse_layers else True)
    if sparse:
        e, ffn = f.n_experts, f.ffn
        router = [L("mlp.gate.weight", (e, h))]
        experts = [
            L("mlp.experts.gate_up_proj", (e, 2 * ffn, h), None, True),
            L("mlp.experts.down_proj", (e, h, ffn), None, True),
        ]
        out += experts + router if f.arch == "qwen3_moe" else router + experts  # HF's registration order
        if f.arch == "qwen2_moe":
            s = f.shared_expert_ffn
            out += [
                L("mlp.shared_expert.gate_proj.weight", (s, h)),
                L("mlp.shared_expert.up_proj.weight", (s, h)),
                L("mlp.shared_expert.down_proj.weight", (h, s)),
                L("mlp.shared_expert_gate.weight", (1, h)),
            ]
    else:
        ffn = x.dense_ffn or f.ffn
        out.append(L("mlp.gate_proj.weight", (ffn, h), 0))
        if x.mlp_bias:
            out.append(L("mlp.gate_proj.bias", (ffn,), 0))
        out.append(L("mlp.up_proj.weight", (ffn, h), 0))
        if x.mlp_bias:
            out.append(L("mlp.up_proj.bias", (ffn,), 0))
        out.append(L("mlp.down_proj.weight", (h, ffn), 1))
        if x.mlp_bias:
            out.append(L("mlp.down_proj.bias", (h,)))
    out += [L("input_layernorm.weight", (h,)), L("post_attention_layernorm.weight", (h,))]
    return out


def layer_tensors(facts: ModelFacts, extras: Optional[ModelExtras], i: int) -> List[TensorSpec]:
    """Parameters of decoder layer i."""
    x = extras or default_extras(facts)
    return _gpt2_layer(facts, i) if facts.arch == "gpt2" else _llama_layer(facts, x, i)


def with_lora(tensors: List[TensorSpec], r: int, targets: Tuple[str, ...]) -> List[TensorSpec]:
    """`tensors` as a LoRA run holds them (r > 0): every one frozen, and beside each target projection's
    weight W [out, in] its adapters A [r, in] and B [out, r], split as partrain.parallel.lora splits
    them: a column-parallel W (split on out) keeps A whole and splits B like W; a row-parallel W (split
    on in) splits A like W and keeps B whole. r == 0: `tensors` unchanged."""
    if r <= 0:
        return tensors
    out: List[TensorSpec] = []
    for t in tensors:
        out.append(replace(t, trainable=False))
        module, _, leaf = t.name.rpartition(".")
        if leaf != "weight" or t.expert or len(t.shape) != 2 or module.rpartition(".")[2] not in targets:
            continue
        rows, cols = t.shape
        column = t.tp_dim == 0
        out.append(TensorSpec(f"{module}.lora_A.weight", (r, cols), t.part, t.layer, None if column else 1))
        out.append(TensorSpec(f"{module}.lora_B.weight", (rows, r), t.part, t.layer, 0 if column else None))
    return out


def embed_tensors(facts: ModelFacts) -> List[TensorSpec]:
    """Parameters of the first pipeline chunk besides its layers (token + learned position embeddings)."""
    h = facts.hidden
    if facts.arch == "gpt2":
        return [
            TensorSpec("transformer.wte.weight", (facts.vocab, h), "embed", tp_dim=0),
            TensorSpec("transformer.wpe.weight", (facts.max_positions, h), "embed"),
        ]
    return [TensorSpec("model.embed_tokens.weight", (facts.vocab, h), "embed", tp_dim=0)]


def final_tensors(facts: ModelFacts) -> List[TensorSpec]:
    """Final norm and the output head, as the whole (unsplit) model holds them (tied: no head)."""
    h = facts.hidden
    if facts.arch == "gpt2":
        out = [TensorSpec("transformer.ln_f.weight", (h,), "final"), TensorSpec("transformer.ln_f.bias", (h,), "final")]
    else:
        out = [TensorSpec("model.norm.weight", (h,), "final")]
    if not facts.tied_embeddings:
        out.append(TensorSpec("lm_head.weight", (facts.vocab, h), "head", tp_dim=0))
    return out


def tied_head_copy(facts: ModelFacts) -> TensorSpec:
    """The last pipeline chunk's copy of a tied embedding (same FQN as the token embedding)."""
    return TensorSpec(embed_tensors(facts)[0].name, (facts.vocab, facts.hidden), "head", tp_dim=0)


def tensor_specs(facts: ModelFacts, extras: Optional[ModelExtras] = None) -> List[TensorSpec]:
    """Every parameter of the unsplit model, in HF order."""
    out = embed_tensors(facts)
    for i in range(facts.n_layers):
        out += layer_tensors(facts, extras, i)
    return out + final_tensors(facts)


def param_tensors(facts: ModelFacts, extras: Optional[ModelExtras] = None) -> List[Tuple[str, Shape]]:
    """(name, shape) of every parameter, as `named_parameters()` of the HF model yields them."""
    return [(t.name, t.shape) for t in tensor_specs(facts, extras)]


def param_count(facts: ModelFacts, extras: Optional[ModelExtras] = None) -> int:
    """Exact number of parameters of the HF model (tied weights once)."""
    x = extras or default_extras(facts)
    return _param_count(facts, x)


@functools.lru_cache(maxsize=64)
def _param_count(facts: ModelFacts, x: ModelExtras) -> int:
    kinds: Dict[bool, int] = {}
    total = sum(t.numel for t in embed_tensors(facts) + final_tensors(facts))
    for i in range(facts.n_layers):
        sparse = layer_is_sparse(facts, x, i)
        if sparse not in kinds:
            kinds[sparse] = sum(t.numel for t in layer_tensors(facts, x, i))
        total += kinds[sparse]
    return total


def layer_is_sparse(facts: ModelFacts, extras: ModelExtras, i: int) -> bool:
    if not facts.is_moe:
        return False
    return extras.sparse_layers[i] if extras.sparse_layers else True


def active_param_count(facts: ModelFacts, extras: Optional[ModelExtras] = None) -> int:
    """Parameters one token uses (top-k of the experts) - the 'N' of 6N FLOPs per token."""
    x = extras or default_extras(facts)
    total = param_count(facts, x)
    if not facts.is_moe:
        return total
    idle = 3 * facts.hidden * facts.ffn * (facts.n_experts - facts.experts_per_token)
    return total - idle * sum(1 for i in range(facts.n_layers) if layer_is_sparse(facts, x, i))
