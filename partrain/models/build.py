"""Turn a partrain ModelConfig into an HF config and an unallocated (meta-device) model.

Weights are never allocated here: parallel code first shards the meta model (TP, FSDP, pipeline
split) and `partrain.models.materialize.materialize` then fills only each rank's shards.
"""

from __future__ import annotations

from typing import Any, Dict

import torch
from torch import nn

from partrain.blueprint.config.schema import ModelConfig
from partrain.blueprint.model_facts import IMPLEMENTATION_KEYS, attention_implementation, load_snapshot, merged_kwargs
from partrain.errors import ConfigError, Problem

# The default attention kernel (model_facts.attention_implementation) is SDPA: it runs on CPU and GPU,
# its CPU kernels are deterministic (no atomics,
# fixed reduction order for a given thread count), it never materialises the S x S score matrix, and
# with attention_mask=None it runs causal, which pipeline stages rely on. "eager" is the slower
# reference, and the default where the model caps its attention scores (Gemma 2), which SDPA cannot;
# a user may still pick any HF implementation with model.config.attn_implementation.

EXPERTS_IMPLEMENTATION = "eager"
"""Default MoE experts kernel: HF's plain per-expert loop of F.linear calls. It works for meta,
DTensor and CPU tensors alike and keeps expert-parallel code simple; transformers would otherwise
pick "grouped_mm". Override with model.config.experts_implementation."""


def hf_config(model_cfg: ModelConfig) -> Any:
    """The `transformers.PretrainedConfig` for `model_cfg`, ready for training.

    Built from `model_cfg.arch` and the `model_cfg.config` kwargs, or loaded from the local
    `model_cfg.pretrained` folder (never downloaded) with the kwargs applied on top (the same order
    as `partrain.blueprint.model_facts`, so the planner and the model agree). Always sets use_cache=False
    (a KV cache is rebuilt during reentrant recompute and gives wrong gradients) and the attention /
    experts implementations above unless the kwargs name others. Raises ConfigError for unknown
    archs or keys, an arch that differs from the pretrained folder's, or values HF rejects.
    """
    kwargs: Dict[str, Any] = dict(model_cfg.config or {})
    implementations = {k: kwargs.pop(k) for k in IMPLEMENTATION_KEYS if k in kwargs}
    if kwargs.get("use_cache"):
        raise ConfigError(
            Problem(
                "model.config.use_cache",
                kwargs["use_cache"],
                "training needs use_cache=False (a KV cache makes recomputed activations wrong)",
                "remove model.config.use_cache",
            )
        )
    kwargs.pop("use_cache", None)
    # One validator for unknown archs, unknown keys and arch/pretrained mismatch: the facts layer.
    merged_kwargs(model_cfg.arch, {**kwargs, **implementations}, model_cfg.pretrained, load_snapshot())

    try:
        if model_cfg.pretrained:
            config = _load_pretrained_config(model_cfg, kwargs)
        else:
            from transformers import CONFIG_MAPPING

            config = CONFIG_MAPPING[model_cfg.arch](**kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # HF's strict dataclass and __post_init__ checks raise various types
        raise ConfigError(
            Problem(
                "model.config",
                kwargs,
                f"transformers rejects this {model_cfg.arch} config: {exc}",
                "fix the named value",
            )
        ) from exc

    _dense_weights(config, model_cfg)
    config.use_cache = False
    softcap = {"attn_logit_softcapping": getattr(config, "attn_logit_softcapping", None)}
    config._attn_implementation = attention_implementation(
        implementations.get("attn_implementation"), softcap, model_cfg.arch
    )
    config._experts_implementation = implementations.get("experts_implementation", EXPERTS_IMPLEMENTATION)
    return config


DEQUANTIZED_ON_LOAD = ("mxfp4",)
"""Quantized weight formats partrain reads by dequantizing them (partrain.models.pretrained): gpt-oss' experts."""


def _dense_weights(config: Any, model_cfg: ModelConfig) -> None:
    """partrain trains dense weights: a folder's MXFP4 experts are dequantized on load, so the model's config
    (and what an export writes) says nothing of a quantization; any other quantized release is refused."""
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    if str(method) not in DEQUANTIZED_ON_LOAD:
        raise ConfigError(
            Problem(
                "model.pretrained",
                model_cfg.pretrained,
                f"its weights are quantized ({method}); partrain trains dense weights and dequantizes only "
                f"{', '.join(DEQUANTIZED_ON_LOAD)} on load",
                "use the model's unquantized (bf16 or fp32) release",
            )
        )
    del config.quantization_config


def _load_pretrained_config(model_cfg: ModelConfig, kwargs: Dict[str, Any]) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(
            model_cfg.pretrained, local_files_only=True, trust_remote_code=model_cfg.trust_remote_code, **kwargs
        )
    except ValueError as exc:
        if "trust_remote_code" in str(exc):
            raise ConfigError(
                Problem(
                    "model.trust_remote_code",
                    model_cfg.trust_remote_code,
                    "the pretrained folder ships its own modelling code",
                    "set model.trust_remote_code=true if you trust that code",
                )
            ) from exc
        raise
    except OSError as exc:
        raise ConfigError(
            Problem(
                "model.pretrained",
                model_cfg.pretrained,
                f"cannot read the HF config there: {exc}",
                "point model.pretrained at a local save_pretrained folder",
            )
        ) from exc


def build_meta_model(model_cfg: ModelConfig) -> nn.Module:
    """The HF `*ForCausalLM` for `model_cfg` on the meta device, fp32, with no storage allocated.

    Parameters and buffers are placeholders (shape and dtype only) until `materialize` fills them.
    """
    config = hf_config(model_cfg)
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            # dtype=fp32 explicitly: a pretrained config.json may say bf16; master weights are fp32
            # and mixed precision is applied later by the parallel wrappers.
            return AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, trust_remote_code=model_cfg.trust_remote_code
            )
    except (ValueError, ImportError) as exc:  # e.g. an attention implementation that is not installed
        raise ConfigError(
            Problem(
                "model.config",
                dict(model_cfg.config or {}),
                f"transformers cannot build this model: {exc}",
                "fix the named setting",
            )
        ) from exc


def import_model_module(model_cfg: ModelConfig) -> None:
    """Import the transformers module of the model's architecture now (what building the model would
    import later), so that a memory baseline taken next already holds it. Raises what transformers
    raises for an architecture it does not map (a custom model: its module comes with the model)."""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM._model_mapping[type(hf_config(model_cfg))]
