"""`partrain.json`: what a checkpoint holds, written last, read first.

Written by rank 0 once every rank has finished writing; its presence (with DCP's `.metadata`) is
what makes a folder a checkpoint. Keys:

    format, format_version     "partrain-checkpoint", 2 (1: the same without sha256; still read)
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
    sha256                     {relative path: hex SHA-256} of the same files (format_version 2)

Before any tensor is read, a load checks that the file parses, that the model is the same (arch
and every size-determining config value) and that no file is missing, truncated or changed
(size, then SHA-256). A format_version 1 checkpoint has sizes only: it is read with a warning.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from partrain.blueprint.config.schema import ModelConfig
from partrain.checkpoint.checksums import mismatch
from partrain.checkpoint.folders import RECORD_FILE
from partrain.errors import ConfigError, Problem

log = logging.getLogger("partrain")

FORMAT = "partrain-checkpoint"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
"""format_version 1 (before checksums) is still read; its files are checked by size only."""
RESUME_KEY = "checkpoint.resume"

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


def corrupt(file: Path, rule: str, fix: str = "", key: str = RESUME_KEY) -> CorruptCheckpoint:
    """CorruptCheckpoint naming `file`, under `key`: checkpoint.resume in a run, the command's
    argument (PATH) for `partrain checkpoint info/export/verify`."""
    if not fix and key == RESUME_KEY:
        fix = (
            "resume from an earlier checkpoint (checkpoint.resume=auto falls back to "
            "one by itself) or start afresh with checkpoint.resume=none"
        )
    elif not fix:
        fix = "use an earlier checkpoint (`partrain checkpoint verify RUN_DIR/checkpoints` lists the intact ones)"
    return CorruptCheckpoint(Problem(key, str(file), rule, fix))


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
        "peft": dataclasses.asdict(run.peft),  # LoRA's r, alpha, targets: what `export --peft` writes
    }


def make_record(
    meta: Dict[str, Any],
    step: int,
    extra: Dict[str, Any],
    world_size: int,
    files: Dict[str, int],
    sha256: Optional[Dict[str, str]] = None,
) -> Dict[str, Any]:
    import torch

    from partrain import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION if sha256 is not None else 1,
        "step": step,
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "partrain_version": __version__,
        "torch_version": torch.__version__,
        **{k: v for k, v in meta.items() if k not in ("step", "extra", "files", "sha256", "world_size")},
        "world_size": world_size,
        "extra": extra,
        "files": files,
        **({"sha256": sha256} if sha256 is not None else {}),
    }


# ---- reading and checking -------------------------------------------------------------------------


def read_record(folder: Path, key: str = RESUME_KEY) -> Dict[str, Any]:
    """partrain.json of `folder`; CorruptCheckpoint naming the file (under `key`) if it is missing or not ours."""
    path = Path(folder) / RECORD_FILE
    unknown = "not a partrain checkpoint / unknown layout"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise corrupt(path, f"missing: {unknown}", key=key) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise corrupt(path, f"cannot be parsed ({exc}): {unknown}", key=key) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise corrupt(path, f'has no "format": "{FORMAT}": {unknown}', key=key)
    if record.get("format_version") not in READ_VERSIONS:
        raise ConfigError(
            Problem(
                key,
                str(path),
                f"format_version {record.get('format_version')!r}; this partrain reads "
                f"{', '.join(map(str, READ_VERSIONS))}",
                "load it with the partrain version that wrote it",
            )
        )
    for name in ("step", "model", "files", "world_size"):
        if name not in record:
            raise corrupt(path, f"lacks the key {name!r}: {unknown}", key=key)
    if not isinstance(record["files"], dict) or not isinstance(record.get("sha256", {}), dict):
        raise corrupt(path, f'its "files" or "sha256" is not a mapping: {unknown}', key=key)
    return record


def has_checksums(record: Dict[str, Any]) -> bool:
    """False for a format_version 1 checkpoint (sizes only)."""
    return "sha256" in record


def no_checksums_warning(folder: Path) -> str:
    return (
        f"{folder} was saved by an older partrain (format_version 1) and carries no checksums: "
        "only file presence and sizes are checked"
    )


def file_problems(folder: Path, record: Dict[str, Any], files: Optional[List[str]] = None) -> List[Tuple[Path, str]]:
    """(file, why) for each of the given files (default: all in partrain.json) that does not match
    the record; `why` is a sentence naming the file.

    Presence and size always; SHA-256 when the checkpoint has checksums (one streamed read a file)."""
    sums = record.get("sha256")
    problems = []
    for rel in record["files"] if files is None else files:
        expected = None if sums is None else sums.get(rel, "")
        if expected == "":
            problems.append((Path(folder) / rel, f"{Path(folder) / rel} has no SHA-256 in partrain.json (edited?)"))
            continue
        why = mismatch(folder, rel, int(record["files"][rel]), expected)
        if why:
            problems.append((Path(folder) / rel, why))
    return problems


def check_files(folder: Path, record: Dict[str, Any], key: str = RESUME_KEY, files: Optional[List[str]] = None) -> None:
    """Every file partrain.json lists (or the given ones) exists with the recorded size and SHA-256
    (catches truncation, lost files and same-size changes); CorruptCheckpoint naming each bad file."""
    problems = file_problems(folder, record, files)
    if problems:
        raise CorruptCheckpoint([corrupt(path, why, key=key).problems[0] for path, why in problems])


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
