"""The HF model a checkpoint record describes, on the meta device, and the config files of an export."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Dict

from partrain.blueprint.config.schema import ModelConfig


def hf_model_from_record(model: Dict[str, Any]):
    """The HF model (meta device) of the record: from its ModelConfig, or its saved HF config when
    the pretrained folder it came from is gone."""
    import torch

    from partrain.models.build import build_meta_model

    cfg = ModelConfig(
        arch=model["arch"],
        config=dict(model.get("config") or {}),
        pretrained=model.get("pretrained"),
        trust_remote_code=bool(model.get("trust_remote_code")),
        name=model.get("name", ""),
    )
    if cfg.pretrained and not Path(cfg.pretrained).is_dir() and model.get("hf_config"):
        from transformers import CONFIG_MAPPING, AutoModelForCausalLM

        config = CONFIG_MAPPING[cfg.arch].from_dict(model["hf_config"])
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return build_meta_model(cfg)


def write_configs(model, out_dir: Path, dtype, pretrained_folder: Path | None = None) -> None:
    """config.json (and generation_config.json for a generating model) as save_pretrained writes
    them; a generation_config.json of the pretrained folder the run started from is kept as it was."""
    config = model.config
    config.use_cache = True  # partrain turns the KV cache off for training only
    config.architectures = [type(model).__name__]
    config.dtype = dtype
    config.save_pretrained(out_dir)
    given = pretrained_folder / "generation_config.json" if pretrained_folder else None
    if given is not None and given.is_file():
        shutil.copy2(given, out_dir / "generation_config.json")
    elif model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
