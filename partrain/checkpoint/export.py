"""Inspect a checkpoint and export it as a Hugging Face `save_pretrained` folder.

Both run in one process without a process group (DCP then reads as a single process, whatever
layout wrote the checkpoint): `partrain checkpoint info PATH` and
`partrain checkpoint export PATH --hf OUT`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

from partrain.blueprint.config.schema import ModelConfig
from partrain.checkpoint import folders
from partrain.checkpoint.dist_util import quiet_single_process, warn_user
from partrain.checkpoint.failures import causes, first_line, is_failure
from partrain.checkpoint.record import check_files, corrupt, has_checksums, no_checksums_warning, read_record
from partrain.checkpoint.state import MODEL
from partrain.errors import ConfigError, Problem

log = logging.getLogger("partrain")

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "chat_template.jinja",
    "chat_template.json",
)
"""Files of an HF tokenizer folder that export copies (weights and config.json are not among them)."""


PATH_KEY = "PATH"
"""How errors of `partrain checkpoint info/export/verify` name the checkpoint argument."""


def _require_checkpoint(path: Path, key: str = PATH_KEY) -> None:
    if not folders.is_complete(path):
        what = (
            "an unfinished save" if path.name.endswith(folders.PARTIAL_SUFFIX) else "not a complete partrain checkpoint"
        )
        raise ConfigError(
            Problem(
                key,
                str(path),
                f"{what} (a checkpoint folder is step-NNNNNNNN with partrain.json and .metadata)",
                "pass a folder such as <run>/checkpoints/step-00000100",
            )
        )


def checkpoint_info(path: Path) -> Dict[str, Any]:
    """What `partrain checkpoint info PATH` prints (JSON-able).

    Keys: path, step, time, world_size, layout, model (arch, name, config), size_bytes (all files),
    n_tensors (all saved tensors, model and optimizer), n_model_tensors, n_parameters (elements of
    the model's parameters, a tied head counted once), partrain_version, extra, format_version,
    checksums (whether partrain.json records SHA-256s; `partrain checkpoint verify` checks them).
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from partrain.checkpoint.safe_io import read_metadata

    path = Path(path)
    _require_checkpoint(path)
    record = read_record(path, key=PATH_KEY)
    try:
        metadata = read_metadata(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read the index means the same to the user
        raise corrupt(path / folders.METADATA_FILE, f"cannot be read: {first_line(exc)}", key=PATH_KEY) from exc
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    model = {k: v for k, v in tensors.items() if k.startswith(MODEL + ".")}
    tied = bool((record["model"].get("hf_config") or {}).get("tie_word_embeddings"))
    n_params = 0
    for k, v in model.items():
        if tied and k == f"{MODEL}.lm_head.weight":
            continue  # the tied head is the embedding: count it once
        count = 1
        for d in v.size:
            count *= d
        n_params += count
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    m = record["model"]
    return {
        "path": str(path),
        "step": record["step"],
        "time": record.get("time"),
        "world_size": record["world_size"],
        "layout": record.get("layout", {}),
        "model": {"arch": m.get("arch"), "name": m.get("name"), "config": m.get("config")},
        "size_bytes": size,
        "n_tensors": len(tensors),
        "n_model_tensors": len(model),
        "n_parameters": n_params,
        "partrain_version": record.get("partrain_version"),
        "extra": record.get("extra", {}),
        "format_version": record.get("format_version"),
        "checksums": has_checksums(record),
    }


def _hf_model_from_record(model: Dict[str, Any]):
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


def _tied_groups(model) -> Dict[str, str]:
    """alias FQN -> first FQN for parameters registered under several names (tied weights)."""
    first: Dict[int, str] = {}
    alias: Dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias[name] = first[id(p)]
        else:
            first[id(p)] = name
    return alias


def load_model_weights(path: Path):
    """The plain HF model (CPU, fp32) with the checkpoint's weights; one process, no process group."""
    import torch
    import torch.distributed.checkpoint as dcp

    from partrain.checkpoint.safe_io import (
        SafeFileSystemReader,
        SafeLoadPlanner,
        UnreadableFile,
        read_metadata,
    )

    path = Path(path)
    _require_checkpoint(path)
    record = read_record(path, key=PATH_KEY)
    if not has_checksums(record):
        warn_user(no_checksums_warning(path))
    check_files(path, record, key=PATH_KEY)  # sizes and SHA-256: never export changed weights
    try:
        saved_keys = read_metadata(path).state_dict_metadata
    except Exception as exc:  # noqa: BLE001
        raise corrupt(path / folders.METADATA_FILE, f"cannot be read: {first_line(exc)}", key=PATH_KEY) from exc
    model = _hf_model_from_record(record["model"])
    alias = _tied_groups(model)
    model.to_empty(device=torch.device("cpu"))
    model.tie_weights()  # to_empty gives every slot its own tensor: share the tied ones again
    state = model.state_dict()
    saved = {k[len(MODEL) + 1 :] for k in saved_keys if k.startswith(MODEL + ".")}
    request = {}
    for key, value in state.items():
        if key in saved:
            request[key] = value
        elif alias.get(key) in saved:
            continue  # a tied alias the checkpoint does not hold separately: filled through its twin
        else:
            raise ConfigError(
                Problem(
                    PATH_KEY,
                    str(path),
                    f"the checkpoint has no tensor {key}",
                    "export a checkpoint saved from this model",
                )
            )
    try:
        with quiet_single_process():
            dcp.load(
                {MODEL: request}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=True
            )
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if not is_failure(exc):
            raise
        unreadable = next((e for e in causes(exc) if isinstance(e, UnreadableFile)), None)
        if unreadable is not None:
            raise corrupt(
                path / unreadable.relative_path, f"cannot be read: {unreadable.reason}", key=PATH_KEY
            ) from exc
        raise corrupt(path, f"cannot be loaded: {first_line(exc)}", key=PATH_KEY) from exc
    for key, source in alias.items():
        if key in state and state[key].data_ptr() != model.get_parameter(source).data_ptr():
            raise RuntimeError(f"tied weight {key} is not shared with {source} after loading")
    return model, record


def _copy_tokenizer(folder: Path, out_dir: Path) -> int:
    copied = 0
    for name in TOKENIZER_FILES:
        src = folder / name
        if src.is_file():
            shutil.copy2(src, out_dir / name)
            copied += 1
    return copied


def _out_problem(out_dir: Path, rule: str) -> ConfigError:
    return ConfigError(Problem("--hf", str(out_dir), rule, "pass a new or empty folder in a writable place"))


def _check_out_dir(out_dir: Path) -> None:
    """--hf names a folder that is, or can be, created and written: checked before any weight is read."""
    if out_dir.exists() and not out_dir.is_dir():
        raise _out_problem(out_dir, "is a file; export writes a folder")
    parent = out_dir
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise _out_problem(out_dir, f"{parent} is a file, so the folder cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise _out_problem(out_dir, f"{parent} is not writable")


def export_hf(path: Path, out_dir: Path, tokenizer_folder: Optional[str] = None) -> Path:
    """Write the checkpoint's model as an HF folder (safetensors + config.json) loadable offline by
    `AutoModelForCausalLM.from_pretrained(out_dir)`; copy the tokenizer files of `tokenizer_folder`
    (default: the run's data.tokenizer when it was a local HF tokenizer folder). Returns out_dir."""
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    record = read_record(Path(path), key=PATH_KEY) if folders.is_complete(Path(path)) else None
    folder = tokenizer_folder
    if folder is None and record is not None:
        used = (record.get("data") or {}).get("tokenizer")
        folder = used if used and used != "byte" else None
    src = Path(folder).expanduser() if folder is not None else None
    if src is not None and tokenizer_folder is None and not src.is_dir():
        log.warning("the run's tokenizer folder %s is gone: exporting the model without tokenizer files", src)
        src = None
    if src is not None and not any((src / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            Problem(
                "--tokenizer" if tokenizer_folder is not None else "data.tokenizer",
                str(folder),
                "not a local HF tokenizer folder (no tokenizer.json, vocab.json, tokenizer.model, ...)",
                "pass the local tokenizer folder the run used",
            )
        )
    model, record = load_model_weights(path)
    model.config.use_cache = True  # partrain turns the KV cache off for training only
    model.config.architectures = [type(model).__name__]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _out_problem(out_dir, f"cannot be created: {exc.strerror or exc}") from None
    model.save_pretrained(out_dir, safe_serialization=True)
    if src is not None:
        _copy_tokenizer(src, out_dir)
    elif (record.get("data") or {}).get("tokenizer") == "byte":
        log.info("the run used the byte tokenizer (ids = UTF-8 bytes): no tokenizer files to export")
    return out_dir
