"""Every parameter tensor of the HF models partrain trains, from the model facts alone.

`param_tensors(facts)` lists (name, shape) exactly as `model.named_parameters()` of the HF
`*ForCausalLM` does (names, shapes; tied weights once), for every family of partrain/blueprint/families/;
a test checks it against meta-built models. `tensor_specs` adds where each tensor lives
(embeddings, a decoder layer, final norm, head) and how partrain shards it. Each family's own
tensors come from its file, partrain/blueprint/families/<family>.py; this module assembles them:

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
from dataclasses import replace
from typing import Dict, List, Optional, Tuple

from partrain.blueprint.families import FAMILIES, family
from partrain.blueprint.families.base import Shape, TensorSpec  # importers may keep taking them from here
from partrain.blueprint.model_facts import ModelFacts
from partrain.blueprint.planner.spec import ModelExtras, default_extras


def layer_tensors(facts: ModelFacts, extras: Optional[ModelExtras], i: int) -> List[TensorSpec]:
    """Parameters of decoder layer i."""
    x = extras or default_extras(facts)
    return family(facts.arch).layer_tensors(facts, x, i)


CONV1D_PROJECTIONS = frozenset(name for f in FAMILIES.values() for name in f.conv1d_projections)
"""Projections that are HF Conv1D modules, whose weight is stored [in, out] (GPT-2's)."""


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
        conv1d = module.rpartition(".")[2] in CONV1D_PROJECTIONS  # W stored [in, out]
        rows, cols = reversed(t.shape) if conv1d else t.shape
        column = t.tp_dim == (1 if conv1d else 0)
        out.append(TensorSpec(f"{module}.lora_A.weight", (r, cols), t.part, t.layer, None if column else 1))
        out.append(TensorSpec(f"{module}.lora_B.weight", (rows, r), t.part, t.layer, 0 if column else None))
    return out


def embed_tensors(facts: ModelFacts) -> List[TensorSpec]:
    """Parameters of the first pipeline chunk besides its layers (token + learned position embeddings)."""
    return family(facts.arch).embed_tensors(facts)


def final_tensors(facts: ModelFacts) -> List[TensorSpec]:
    """Final norm and the output head, as the whole (unsplit) model holds them (tied: no head)."""
    return with_head(family(facts.arch).final_norm_tensors(facts), facts)


def with_head(tensors: List[TensorSpec], facts: ModelFacts) -> List[TensorSpec]:
    """`tensors` with the head's weight where it is not tied: before the head's other tensors (Phi's bias),
    as transformers registers them, else last."""
    if facts.tied_embeddings:
        return tensors
    at = next((k for k, t in enumerate(tensors) if t.part == "head"), len(tensors))
    return [*tensors[:at], TensorSpec("lm_head.weight", (facts.vocab, facts.hidden), "head", tp_dim=0), *tensors[at:]]


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
    sparse = [i for i in range(facts.n_layers) if layer_is_sparse(facts, x, i)]
    if not sparse:
        return total
    # Every stacked expert tensor (weights and per-expert biases) splits evenly by expert.
    per_expert = sum(t.numel for t in layer_tensors(facts, x, sparse[0]) if t.expert) // facts.n_experts
    return total - per_expert * (facts.n_experts - facts.experts_per_token) * len(sparse)
