"""Exports of a LoRA checkpoint (a run with peft=lora): the adapters alone in PEFT's format
(`partrain checkpoint export CK --peft OUT`), or the merged model as an HF folder (`--hf OUT`,
written by hf_export).

PEFT's format: `adapter_config.json` (LoraConfig's fields) and `adapter_model.safetensors` whose keys
are `base_model.model.<module path>.lora_A.weight` / `.lora_B.weight`; partrain's adapter FQNs are
exactly those module paths, so the export only adds the prefix. `peft.PeftModel.from_pretrained(base,
OUT)` loads it onto the base model; peft itself is not needed to write it. One process reads the
adapters (a few MB) and, for the merged export, the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from partrain.checkpoint.dist_util import quiet_single_process
from partrain.checkpoint.export import PATH_KEY, load_model_weights, require_checkpoint
from partrain.checkpoint.record import check_files, read_record
from partrain.checkpoint.state import MODEL
from partrain.errors import ConfigError, Problem

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def lora_settings(record: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The run's peft group as its checkpoint recorded it, when the run trained LoRA adapters."""
    peft = record.get("peft") or {}
    return peft if peft.get("method") == "lora" else None


def _require_lora(path: Path, record: Dict[str, Any]) -> Dict[str, Any]:
    peft = lora_settings(record)
    if peft is None:
        raise ConfigError(
            Problem(PATH_KEY, str(path), "was not trained with peft=lora: it holds no adapters", "export it with --hf")
        )
    return peft


def load_adapters(path: Path) -> Dict[str, Any]:
    """{adapter FQN: full fp32 tensor} of a LoRA checkpoint (one process, no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from partrain.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner, read_metadata
    from partrain.models.lora_init import is_lora_weight

    request = {}
    for key, meta in read_metadata(path).state_dict_metadata.items():
        fqn = key[len(MODEL) + 1 :]
        if key.startswith(MODEL + ".") and isinstance(meta, TensorStorageMetadata) and is_lora_weight(fqn):
            request[fqn] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    with quiet_single_process():
        dcp.load({MODEL: request}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True)
    return request


def export_peft(path: Path, out_dir: Path) -> Dict[str, Any]:
    """Write the checkpoint's adapters in PEFT's format to out_dir; returns {exported, tensors, r, targets}."""
    from safetensors.torch import save_file

    path, out_dir = Path(path), Path(out_dir)
    require_checkpoint(path)
    record = read_record(path, key=PATH_KEY)
    peft = _require_lora(path, record)
    check_files(path, record, key=PATH_KEY)  # never export changed weights
    adapters = load_adapters(path)
    targets = sorted({fqn.split(".")[-3] for fqn in adapters})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(peft["r"]),
        "lora_alpha": float(peft["alpha"]),
        "lora_dropout": float(peft["dropout"]),
        "target_modules": targets,
        "bias": "none",
        # GPT-2's Conv1D stores W [in, out]: peft must transpose B A when merging (the adapters'
        # own shapes, A [r, in] and B [out, r], are the same for every family).
        "fan_in_fan_out": record["model"].get("arch") == "gpt2",
        "inference_mode": True,
        "base_model_name_or_path": record["model"].get("pretrained"),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({PEFT_PREFIX + k: v.contiguous() for k, v in adapters.items()}, str(out_dir / ADAPTER_WEIGHTS))
    (out_dir / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return {"exported": str(out_dir), "tensors": len(adapters), "r": config["r"], "target_modules": targets}


def merged_model(path: Path):
    """The plain HF model (CPU, fp32) of a LoRA checkpoint with each adapter merged into its base
    weight: W + (alpha / r) B A, what the adapted projection computes without dropout."""
    import torch

    model, record = load_model_weights(path)
    peft = _require_lora(Path(path), record)
    scaling = float(peft["alpha"]) / int(peft["r"])
    adapters = load_adapters(Path(path))
    with torch.no_grad():
        for fqn, a in adapters.items():
            if fqn.split(".")[-2] != "lora_A":
                continue
            projection = fqn.rsplit(".", 2)[0]
            b = adapters[f"{projection}.lora_B.weight"]
            base = model.get_submodule(projection)
            delta = b @ a  # [out, in]
            conv1d = hasattr(base, "nf")  # GPT-2's Conv1D stores W [in, out]
            base.weight.add_(delta.t() if conv1d else delta, alpha=scaling)
    return model, record
