"""Inspect a checkpoint (`partrain checkpoint info PATH`) and load its model into one process.

Both run without a process group (DCP then reads as a single process, whatever layout wrote the
checkpoint). `load_model_weights` gathers the whole model: tests compare a sharded HF export
(`hf_export`) against it; the export itself never does this.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict

from partrain.checkpoint import folders
from partrain.checkpoint.dist_util import quiet_single_process, warn_user
from partrain.checkpoint.export_model import hf_model_from_record
from partrain.checkpoint.failures import causes, first_line, is_failure
from partrain.checkpoint.hf_plan import tied_aliases
from partrain.checkpoint.record import check_files, corrupt, has_checksums, no_checksums_warning, read_record
from partrain.checkpoint.state import MODEL
from partrain.errors import ConfigError, Problem

log = logging.getLogger("partrain")

PATH_KEY = "PATH"
"""How errors of `partrain checkpoint info/export/verify` name the checkpoint argument."""


def require_checkpoint(path: Path, key: str = PATH_KEY) -> None:
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
    require_checkpoint(path)
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


def _fill_buffers(model, record_model: Dict[str, Any]) -> None:
    """Buffers (rotary inv_freq) are not in the checkpoint and to_empty left them as garbage:
    compute them as the model's own init does."""
    import torch

    from partrain.models.random_init import InitOracle

    oracle = InitOracle(hf_model_from_record(record_model), 0)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            buffer.copy_(oracle.value(name))


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
    require_checkpoint(path)
    record = read_record(path, key=PATH_KEY)
    if not has_checksums(record):
        warn_user(no_checksums_warning(path))
    check_files(path, record, key=PATH_KEY)  # sizes and SHA-256: never export changed weights
    try:
        saved_keys = read_metadata(path).state_dict_metadata
    except Exception as exc:  # noqa: BLE001
        raise corrupt(path / folders.METADATA_FILE, f"cannot be read: {first_line(exc)}", key=PATH_KEY) from exc
    model = hf_model_from_record(record["model"])
    alias = tied_aliases(model)
    model.to_empty(device=torch.device("cpu"))
    model.tie_weights()  # to_empty gives every slot its own tensor: share the tied ones again
    _fill_buffers(model, record["model"])
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
