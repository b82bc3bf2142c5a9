"""Model facts (layers, heads, widths, vocabulary, experts) read from the HF config class, without
building the model.

Importing a transformers config class imports torch (about 2.5 s), too slow for a dry run that must
answer in well under 3 s. So the fields and defaults of every supported config class are kept in a
snapshot, `hf_facts.json`, generated from transformers itself (`python -m partrain.models.facts_snapshot`)
and checked against the installed transformers by a test. The snapshot is only a cache of the
class: the rules that derive facts from it (GQA default, GPT-2's 4h MLP, ...) live in each
family's file, partrain/blueprint/families/<family>.py.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from partrain.blueprint.config.paths import is_there
from partrain.blueprint.families import FAMILIES, family, unknown_arch
from partrain.blueprint.families.base import LatentAttention
from partrain.errors import ConfigError, Problem

SNAPSHOT_PATH = Path(__file__).with_name("hf_facts.json")
SUPPORTED_ARCHS = tuple(FAMILIES)
"""One entry per blueprint/families/ family (gpt2, llama, qwen2, qwen3, mistral, smollm3, mixtral, qwen2_moe, ...)."""
IMPLEMENTATION_KEYS = ("attn_implementation", "experts_implementation")
"""model.config keys that pick transformers' kernels (HF configs take them as constructor kwargs, not
fields): they change no fact of the model, and merged_kwargs leaves them out of its values."""
UNDECLARED_FIELDS: Dict[str, Dict[str, Any]] = {a: dict(f.undeclared_fields) for a, f in FAMILIES.items()}
"""Keys the HF modeling code reads (getattr with a default) that the config class does not declare
(each family's `undeclared_fields`)."""


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
    latent_attention: Optional[LatentAttention] = None
    """Multi-head latent attention's ranks and head widths (DeepSeek-V3); None: plain q/k/v heads."""

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def load_snapshot() -> Dict[str, dict]:
    return json.loads(SNAPSHOT_PATH.read_text())


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
        if pretrained and stored.get("model_type") == arch:  # the folder's own model_type: name its file
            known = unknown_arch(arch)
            raise ConfigError(
                Problem(
                    "model.pretrained",
                    pretrained,
                    f"its config.json has model_type={arch!r}, {known.rule}",
                    "fine-tune a model of a supported family (docs/families.md lists what runs under which layout)",
                )
            )
        raise ConfigError(unknown_arch(arch))
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
    if config.get("use_cache"):  # the same refusal as models/build.py's, before any process starts
        raise ConfigError(
            Problem(
                "model.config.use_cache",
                config["use_cache"],
                "training needs use_cache=False (a KV cache makes recomputed activations wrong)",
                "remove model.config.use_cache",
            )
        )
    layers.append(({k: v for k, v in config.items() if k not in IMPLEMENTATION_KEYS}, "model.config"))
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
    _check_attention_kernel(arch, config.get("attn_implementation"), values)
    return values


def attention_implementation(named: Optional[str], values: Mapping[str, Any], arch: str) -> str:
    """The attention kernel a run uses: model.config.attn_implementation when named, else SDPA, or
    transformers' eager attention where the model caps its attention scores (attn_logit_softcapping:
    Gemma 2) or its family's attention has no SDPA path (gpt-oss' sinks)."""
    if named:
        return str(named)
    eager = values.get("attn_logit_softcapping") or family(arch).attention_sinks
    return "eager" if eager else "sdpa"


ATTENTION_KERNELS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")
"""model.config.attn_implementation values transformers knows (a Hub kernel, "org/name", is taken as named)."""


def _check_attention_kernel(arch: str, named: Any, values: Mapping[str, Any]) -> None:
    """An unknown kernel name is refused before launch (transformers would refuse it in every worker);
    SDPA named for a model that caps its attention scores would train another function (SDPA ignores
    the cap): refused, naming both keys."""
    if named is not None and not (isinstance(named, str) and (named in ATTENTION_KERNELS or "/" in named)):
        close = difflib.get_close_matches(str(named), ATTENTION_KERNELS, n=1)
        raise ConfigError(
            Problem(
                "model.config.attn_implementation",
                named,
                "not an attention kernel transformers knows ("
                + ", ".join(ATTENTION_KERNELS)
                + ", or a Hub kernel org/name)",
                f"did you mean {close[0]}?" if close else "drop it (sdpa, or eager where the model caps its scores)",
            )
        )
    if named == "sdpa" and family(arch).attention_sinks:
        raise ConfigError(
            Problem(
                "model.config.attn_implementation",
                named,
                f"transformers has no SDPA attention for {arch} (its attention adds per-head sink logits)",
                "drop model.config.attn_implementation (eager attention is then used)",
            )
        )
    cap = values.get("attn_logit_softcapping")
    if named == "sdpa" and cap:
        raise ConfigError(
            Problem(
                "model.config.attn_implementation",
                named,
                f"this {arch} model caps its attention scores (attn_logit_softcapping={cap}) and SDPA cannot",
                "drop model.config.attn_implementation (eager attention is then used) or set "
                "model.config.attn_logit_softcapping=null",
            )
        )


def facts_from_kwargs(arch: str, values: Dict[str, Any], class_name: str) -> ModelFacts:
    """ModelFacts from merged HF kwargs, read by the arch's family (partrain/blueprint/families/)."""
    return ModelFacts(arch=arch, config_class=class_name, **family(arch).facts(values, arch))


def model_facts(
    arch: str, config: Mapping[str, Any], pretrained: Optional[str] = None, snapshot: Optional[Dict[str, dict]] = None
) -> ModelFacts:
    snapshot = snapshot if snapshot is not None else load_snapshot()
    values = merged_kwargs(arch, config, pretrained, snapshot)
    return facts_from_kwargs(arch, values, snapshot[arch]["class"])
