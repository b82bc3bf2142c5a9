"""`partrain.json`: what a checkpoint holds, written last, read first.

Written by rank 0 once every rank has finished writing; its presence (with DCP's `.metadata`) is
what makes a folder a checkpoint. Keys:

    format, format_version     "partrain-checkpoint", 1
    step                       optimizer steps done when it was saved
    time                       UTC ISO-8601 time of the commit
    partrain_version, torch_version
    world_size                 processes that saved it
    layout                     degrees and sharding of the run that saved it (informational:
                               any layout can load it)
    model                      arch, config, pretrained, trust_remote_code, name (the run's
                               ModelConfig) and hf_config (the resolved HF config as a dict)
    data                       tokenizer, seq_len, global_batch_size of the saving run
    extra                      the trainer's JSON (data position, ...)
    files                      {relative path: size in bytes} of every file of the checkpoint

Before any tensor is read, a load checks that the file parses, that the model is the same (arch
and every size-determining config value) and that no file is missing or truncated.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from partrain.blueprint.config.schema import ModelConfig
from partrain.checkpoint.folders import RECORD_FILE
from partrain.errors import ConfigError, Problem

log = logging.getLogger("partrain")

FORMAT = "partrain-checkpoint"
FORMAT_VERSION = 1

SIZE_KEYS = (
    "vocab_size",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "n_positions",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "num_local_experts",
    "num_experts",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "mlp_only_layers",
    "decoder_sparse_step",
    "num_experts_per_tok",
)
"""HF config keys that (may) decide parameter shapes; reported first when shapes differ."""

_NOT_MODEL_KEYS = (
    "transformers_version",
    "architectures",
    "_name_or_path",
    "dtype",
    "torch_dtype",
    "use_cache",
    "_attn_implementation",
    "_experts_implementation",
    "attn_implementation",
    "experts_implementation",
)


class CorruptCheckpoint(ConfigError):
    """The checkpoint's files are missing, truncated or unreadable (resume=auto falls back)."""


def corrupt(file: Path, rule: str, fix: str = "") -> CorruptCheckpoint:
    return CorruptCheckpoint(
        Problem(
            "checkpoint.resume",
            str(file),
            rule,
            fix
            or "resume from an earlier checkpoint (checkpoint.resume=auto falls back to "
            "one by itself) or start afresh with checkpoint.resume=none",
        )
    )


# ---- what the trainer passes as meta / expect ---------------------------------------------------


def model_record(model_cfg: ModelConfig) -> Dict[str, Any]:
    """The model part of partrain.json: the run's ModelConfig and the resolved HF config."""
    from partrain.models.build import hf_config

    return {
        "arch": model_cfg.arch,
        "config": dict(model_cfg.config or {}),
        "pretrained": model_cfg.pretrained,
        "trust_remote_code": model_cfg.trust_remote_code,
        "name": model_cfg.name,
        "hf_config": json.loads(json.dumps(hf_config(model_cfg).to_dict(), default=str)),
    }


def run_meta(validated: Any) -> Dict[str, Any]:
    """`meta` for save_checkpoint and `expect` for load_checkpoint, from a ValidatedRun."""
    run, layout = validated.run, validated.layout
    p = run.parallel
    return {
        "model": model_record(run.model),
        "layout": {
            "dp": layout.dp,
            "tp": layout.tp,
            "pp": layout.pp,
            "sp": layout.sp,
            "ep": layout.ep,
            "dp_shard": layout.dp_shard,
            "order": list(layout.order),
            "zero_stage": p.zero_stage,
            "pp_schedule": p.pp_schedule,
            "pp_virtual_stages": p.pp_virtual_stages,
        },
        "world_size": layout.world_size,
        "data": {
            "tokenizer": run.data.tokenizer,
            "seq_len": run.train.seq_len,
            "global_batch_size": validated.global_batch_size,
        },
        "recipe": run.recipe,
    }


def make_record(
    meta: Dict[str, Any], step: int, extra: Dict[str, Any], world_size: int, files: Dict[str, int]
) -> Dict[str, Any]:
    import torch

    from partrain import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "partrain_version": __version__,
        "torch_version": torch.__version__,
        **{k: v for k, v in meta.items() if k not in ("step", "extra", "files", "world_size")},
        "world_size": world_size,
        "extra": extra,
        "files": files,
    }


def file_sizes(folder: Path) -> Dict[str, int]:
    """{relative posix path: bytes} of every file under folder except partrain.json."""
    sizes = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(folder).as_posix()
            if rel != RECORD_FILE and not name.endswith(".tmp"):
                sizes[rel] = path.stat().st_size
    return dict(sorted(sizes.items()))


# ---- reading and checking -------------------------------------------------------------------------


def read_record(folder: Path) -> Dict[str, Any]:
    """partrain.json of `folder`; CorruptCheckpoint naming the file if it is missing or not ours."""
    path = Path(folder) / RECORD_FILE
    unknown = "not a partrain checkpoint / unknown layout"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise corrupt(path, f"missing: {unknown}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise corrupt(path, f"cannot be parsed ({exc}): {unknown}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise corrupt(path, f'has no "format": "{FORMAT}": {unknown}')
    if record.get("format_version") != FORMAT_VERSION:
        raise ConfigError(
            Problem(
                "checkpoint.resume",
                str(path),
                f"format_version {record.get('format_version')!r}; this partrain reads {FORMAT_VERSION}",
                "load it with the partrain version that wrote it",
            )
        )
    for key in ("step", "model", "files", "world_size"):
        if key not in record:
            raise corrupt(path, f"lacks the key {key!r}: {unknown}")
    return record


def check_files(folder: Path, record: Dict[str, Any]) -> None:
    """Every file partrain.json lists exists with the recorded size (catches truncation, lost files)."""
    for rel, size in record["files"].items():
        path = Path(folder) / rel
        if not path.is_file():
            raise corrupt(path, "is missing from the checkpoint")
        actual = path.stat().st_size
        if actual != size:
            raise corrupt(path, f"is truncated or changed: {actual} bytes, {size} when it was saved")


def _param_shapes(arch: str, hf: Dict[str, Any]) -> Dict[str, tuple]:
    import torch
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = CONFIG_MAPPING[arch].from_dict(hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _differing_keys(saved: Dict[str, Any], wanted: Dict[str, Any]) -> List[str]:
    keys = (set(saved) | set(wanted)) - set(_NOT_MODEL_KEYS)
    return sorted(k for k in keys if saved.get(k) != wanted.get(k))


def check_model(record: Dict[str, Any], expect: Optional[Dict[str, Any]], record_path: Path) -> None:
    """ConfigError naming the file and the key when the checkpoint holds another model."""
    if not expect or "model" not in expect:
        return
    saved, wanted = record["model"], expect["model"]
    if saved.get("arch") != wanted.get("arch"):
        raise ConfigError(
            Problem(
                "model.arch",
                wanted.get("arch"),
                f"{record_path} is a checkpoint of a {saved.get('arch')} model, not {wanted.get('arch')}",
                f"set model.arch={saved.get('arch')} with the checkpoint's model config, or checkpoint.resume=none",
            )
        )
    saved_hf, wanted_hf = saved.get("hf_config") or {}, wanted.get("hf_config") or {}
    if not saved_hf or not wanted_hf:
        return  # nothing to compare beyond the arch (expect without a model_record)
    differ = _differing_keys(saved_hf, wanted_hf)
    if not differ:
        return
    try:
        same_shapes = _param_shapes(saved["arch"], saved_hf) == _param_shapes(wanted["arch"], wanted_hf)
    except Exception as exc:  # noqa: BLE001 - cannot rebuild one side: judge by the keys alone
        log.warning("cannot compare parameter shapes (%s); judging by config keys", exc)
        same_shapes = not [k for k in differ if k in SIZE_KEYS]
    if same_shapes:
        log.warning(
            "%s was saved with a different model config in %s; the weights fit, continuing",
            record_path,
            ", ".join(f"{k}={saved_hf.get(k)!r} (now {wanted_hf.get(k)!r})" for k in differ),
        )
        return
    named = [k for k in differ if k in SIZE_KEYS] or differ
    k = named[0]
    others = f" (also differs: {', '.join(named[1:])})" if len(named) > 1 else ""
    raise ConfigError(
        Problem(
            f"model.config.{k}",
            wanted_hf.get(k),
            f"{record_path} is a checkpoint of a model with {k}={saved_hf.get(k)!r}{others}: its "
            "weights do not fit this model",
            f"resume with model.config.{k}={saved_hf.get(k)!r}, or start afresh with checkpoint.resume=none",
        )
    )
