"""Model facts (layers, heads, widths, vocabulary, experts) read from the HF config class, without
building the model.

Importing a transformers config class imports torch (about 2.5 s), too slow for a dry run that must
answer in well under 3 s. So the fields and defaults of every supported config class are kept in a
snapshot, `hf_facts.json`, generated from transformers itself (`python -m partrain.models.facts_snapshot`)
and checked against the installed transformers by a test. The snapshot is only a cache of the
class: the rules that derive facts from it (GQA default, GPT-2's 4h MLP, ...) live here.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from partrain.blueprint.config.paths import is_there
from partrain.errors import ConfigError, Problem

SNAPSHOT_PATH = Path(__file__).with_name("hf_facts.json")
SUPPORTED_ARCHS = ("gpt2", "llama", "qwen2", "mistral", "mixtral", "qwen2_moe", "qwen3_moe")
UNDECLARED_FIELDS: Dict[str, Dict[str, Any]] = {"qwen3_moe": {"head_dim": None}}
"""Keys the HF modeling code reads (getattr with a default) that the config class does not declare:
Qwen3-MoE's attention takes head_dim from the config when set (Qwen3-30B-A3B: 128, not hidden / heads)."""


@dataclass(frozen=True)
class ModelFacts:
    """What the layout, validator and planner need to know about a model."""

    arch: str
    config_class: str
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    """Width of the dense MLP (for MoE: of each expert)."""
    vocab: int
    max_positions: int
    tied_embeddings: bool
    norm: str
    """layernorm (with bias) or rmsnorm."""
    gated_mlp: bool
    """SwiGLU-style MLP with gate, up and down projections."""
    qkv_bias: bool
    n_experts: int = 0
    experts_per_token: int = 0
    shared_expert_ffn: int = 0
    moe_layers: int = 0
    """How many of the decoder layers hold experts."""
    learned_positions: bool = False

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def to_json(self) -> dict:
        return dict(self.__dict__)


def load_snapshot() -> Dict[str, dict]:
    return json.loads(SNAPSHOT_PATH.read_text())


def _problem_unknown_arch(arch: str) -> Problem:
    close = difflib.get_close_matches(arch, SUPPORTED_ARCHS, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return Problem(
        "model.arch",
        arch,
        f"not a supported HF architecture family ({', '.join(SUPPORTED_ARCHS)})",
        f"{hint}set model.arch to one of them",
    )


def read_pretrained_config(folder: str) -> dict:
    path = Path(folder).expanduser() / "config.json"
    if not is_there(path, "file"):
        raise ConfigError(
            Problem(
                "model.pretrained",
                folder,
                "no config.json in that folder (an HF save_pretrained folder is expected)",
                "point model.pretrained at a local folder written by save_pretrained, or unset it",
            )
        )
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            Problem(
                "model.pretrained", folder, f"{path} is not readable JSON ({exc})", "repair or re-export the folder"
            )
        )


def merged_kwargs(
    arch: str, config: Mapping[str, Any], pretrained: Optional[str], snapshot: Dict[str, dict]
) -> Dict[str, Any]:
    """Class defaults <- pretrained config.json <- model.config, with attribute-map aliases resolved.

    Raises ConfigError for an unknown arch or a key the config class does not have.
    """
    stored = read_pretrained_config(pretrained) if pretrained else {}  # a missing config.json first: it
    # is also why an arch taken from it (partrain.blueprint.config.pretrained) would be empty
    if arch not in SUPPORTED_ARCHS or arch not in snapshot:
        raise ConfigError(_problem_unknown_arch(arch))
    entry = snapshot[arch]
    fields, aliases = {**UNDECLARED_FIELDS.get(arch, {}), **entry["defaults"]}, entry["attribute_map"]
    values = dict(fields)
    layers = []
    if pretrained:
        if stored.get("model_type", arch) != arch:
            raise ConfigError(
                Problem(
                    "model.arch",
                    arch,
                    f"model.pretrained holds a {stored.get('model_type')!r} model",
                    f"drop model.arch (a pretrained folder names its own) or set model.arch={stored.get('model_type')}",
                )
            )
        layers.append(({k: v for k, v in stored.items() if k in fields or k in aliases}, None))
    layers.append((dict(config), "model.config"))
    for source, key_prefix in layers:
        for key, value in source.items():
            # An alias whose target is no field (Qwen3-MoE maps num_experts to num_local_experts but
            # declares num_experts) names the field itself.
            name = aliases.get(key, key) if aliases.get(key, key) in fields else key
            if name not in fields:
                if key_prefix is None:
                    continue
                close = difflib.get_close_matches(key, list(fields) + list(aliases), n=1)
                hint = f"did you mean {close[0]}?" if close else f"see the fields of transformers.{entry['class']}"
                raise ConfigError(
                    Problem(f"{key_prefix}.{key}", value, f"not a field of transformers.{entry['class']}", hint)
                )
            values[name] = value
    return values


def _int(values: Dict[str, Any], name: str, arch: str) -> int:
    value = values.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(
            Problem(f"model.config.{name}", value, f"{arch} needs a positive integer here", f"set model.config.{name}")
        )
    return value


MAX_LAYERS = 100_000
"""Most decoder layers a model may have: the planner and the dry run keep figures per layer, and no
real model comes near it (GPT-3 175B has 96, Llama 3 405B 126)."""


def _layers(values: Dict[str, Any], name: str, arch: str) -> int:
    n = _int(values, name, arch)
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


def _opt_int(values: Dict[str, Any], name: str, arch: str) -> Optional[int]:
    """A field HF derives when it is unset (None); when set, a positive integer."""
    return None if values.get(name) is None else _int(values, name, arch)


def _divides(part: int, whole: int, key: str, rule: str) -> None:
    if whole % part:
        raise ConfigError(
            Problem(key, part, f"{rule}; {whole} % {part} = {whole % part}", f"choose a divisor of {whole}")
        )


def facts_from_kwargs(arch: str, values: Dict[str, Any], class_name: str) -> ModelFacts:
    if arch == "gpt2":
        hidden, heads = _int(values, "n_embd", arch), _int(values, "n_head", arch)
        _divides(heads, hidden, "model.config.n_head", f"must divide the hidden size n_embd={hidden}")
        return ModelFacts(
            arch=arch,
            config_class=class_name,
            n_layers=_layers(values, "n_layer", arch),
            hidden=hidden,
            heads=heads,
            kv_heads=heads,
            head_dim=hidden // heads,
            ffn=_opt_int(values, "n_inner", arch) or 4 * hidden,
            vocab=_int(values, "vocab_size", arch),
            max_positions=_int(values, "n_positions", arch),
            tied_embeddings=bool(values.get("tie_word_embeddings", True)),
            norm="layernorm",
            gated_mlp=False,
            qkv_bias=True,
            learned_positions=True,
        )
    hidden, heads = _int(values, "hidden_size", arch), _int(values, "num_attention_heads", arch)
    kv_heads = _opt_int(values, "num_key_value_heads", arch) or heads
    _divides(
        kv_heads,
        heads,
        "model.config.num_key_value_heads",
        f"must divide the attention heads num_attention_heads={heads} (each KV head serves a group of query heads)",
    )
    n_layers = _layers(values, "num_hidden_layers", arch)
    common = dict(
        arch=arch,
        config_class=class_name,
        n_layers=n_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=_opt_int(values, "head_dim", arch) or hidden // heads,
        vocab=_int(values, "vocab_size", arch),
        max_positions=_int(values, "max_position_embeddings", arch),
        tied_embeddings=bool(values.get("tie_word_embeddings", False)),
        norm="rmsnorm",
        gated_mlp=True,
        qkv_bias=bool(values.get("attention_bias") or values.get("qkv_bias") or arch in ("qwen2", "qwen2_moe")),
    )
    if arch == "mixtral":
        return ModelFacts(
            **common,
            ffn=_int(values, "intermediate_size", arch),
            n_experts=_int(values, "num_local_experts", arch),
            experts_per_token=_int(values, "num_experts_per_tok", arch),
            moe_layers=n_layers,
        )
    if arch in ("qwen2_moe", "qwen3_moe"):
        # Qwen3-MoE: Qwen2-MoE's routed experts and sparse-layer rule, without the shared expert.
        step = _opt_int(values, "decoder_sparse_step", arch) or 1
        dense_only = values.get("mlp_only_layers") or []
        if not isinstance(dense_only, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in dense_only
        ):
            raise ConfigError(
                Problem(
                    "model.config.mlp_only_layers", dense_only, "must be a list of layer indices", "e.g. [0, 1], or []"
                )
            )
        moe_layers = n_layers // step - sum(1 for i in set(dense_only) if 0 <= i < n_layers and (i + 1) % step == 0)
        return ModelFacts(
            **common,
            ffn=_int(values, "moe_intermediate_size", arch),
            n_experts=_int(values, "num_experts", arch),
            experts_per_token=_int(values, "num_experts_per_tok", arch),
            shared_expert_ffn=(_opt_int(values, "shared_expert_intermediate_size", arch) or 0)
            if arch == "qwen2_moe"
            else 0,
            moe_layers=moe_layers,
        )
    return ModelFacts(**common, ffn=_int(values, "intermediate_size", arch))


def model_facts(
    arch: str, config: Mapping[str, Any], pretrained: Optional[str] = None, snapshot: Optional[Dict[str, dict]] = None
) -> ModelFacts:
    snapshot = snapshot if snapshot is not None else load_snapshot()
    values = merged_kwargs(arch, config, pretrained, snapshot)
    return facts_from_kwargs(arch, values, snapshot[arch]["class"])
