"""Export a checkpoint as a Hugging Face `save_pretrained` folder, shard by shard, in parallel.

`partrain checkpoint export PATH --hf OUT --nproc N --dtype bf16` plans the export from DCP's index
alone (`hf_plan`), starts N processes that each verify their share of the checkpoint's files and,
once all agree it is intact, each read only their own tensors and write them through torch DCP's
`HuggingFaceStorageWriter` to `model-0000k-of-0000N.safetensors` (`hf_shards`); the parent then
writes `model.safetensors.index.json`, `config.json`, `generation_config.json` and copies the
tokenizer. No process ever holds the whole model. `export_hf_collective` does the same from the
ranks of a training run (`checkpoint.export_hf=true`). A LoRA checkpoint's `--hf` export is its
merged model, written by one process through the same writer.

What stays ours around DCP's writer: the verify-before-write of every checkpoint file's SHA-256
(DCP checks nothing), the staging folder OUT/.partial moved up only when complete (DCP writes in
place), the shard plan that bounds each process's memory, and HF's file names (one
`model.safetensors` without an index, as `save_pretrained` writes a small model).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from partrain.checkpoint import folders
from partrain.checkpoint.checksums import share
from partrain.checkpoint.dist_util import barrier, rank_world, warn_user
from partrain.checkpoint.export import PATH_KEY, require_checkpoint
from partrain.checkpoint.failures import first_line
from partrain.checkpoint.hf_plan import (
    EXPORT_DTYPES,
    INDEX_FILE,
    SINGLE_FILE,
    ShardJob,
    check_conversion_is_per_tensor,
    check_dtypes,
    deal,
    index_json,
    nbytes,
    plan_sources,
    shard_file_names,
)
from partrain.checkpoint.record import (
    CorruptCheckpoint,
    corrupt,
    file_problems,
    has_checksums,
    no_checksums_warning,
    read_record,
)
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

SHARD_TARGET_BYTES = 2 << 30
"""A training run's own export (checkpoint.export_hf) writes shards of about this size, one per
rank at most: a tiny model gets one file, a 70B model on 64 ranks one shard per rank."""


# ---- checks before anything is read --------------------------------------------------------------


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


def export_dtype(dtype: str, key: str = "--dtype"):
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(
            Problem(key, dtype, f"must be one of {', '.join(EXPORT_DTYPES)}", "bf16 halves the folder; fp32 is exact")
        )
    return EXPORT_DTYPES[dtype]


def _tokenizer_source(record: Optional[Dict[str, Any]], tokenizer_folder: Optional[str]) -> Optional[Path]:
    """The folder to copy tokenizer files from: the given one, else the run's data.tokenizer when it
    is a local HF tokenizer folder that still exists."""
    folder = tokenizer_folder
    if folder is None and record is not None:
        used = (record.get("data") or {}).get("tokenizer")
        folder = used if used and used != "byte" else None
    src = Path(folder).expanduser() if folder is not None else None
    if src is not None and tokenizer_folder is None and not src.is_dir():
        log.warning("the run's tokenizer folder %s is gone: exporting the model without tokenizer files", src)
        return None
    if src is not None and not any((src / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            Problem(
                "--tokenizer" if tokenizer_folder is not None else "data.tokenizer",
                str(folder),
                "not a local HF tokenizer folder (no tokenizer.json, vocab.json, tokenizer.model, ...)",
                "pass the local tokenizer folder the run used",
            )
        )
    return src


# ---- the plan -------------------------------------------------------------------------------------


def _saved_model_tensors(path: Path) -> Dict[str, Tuple[Tuple[int, ...], Any]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from partrain.checkpoint.safe_io import read_metadata
    from partrain.checkpoint.state import MODEL

    try:
        metadata = read_metadata(path)
    except Exception as exc:  # noqa: BLE001 - any failure to read the index means the same to the user
        raise corrupt(path / folders.METADATA_FILE, f"cannot be read: {first_line(exc)}", key=PATH_KEY) from exc
    prefix = MODEL + "."
    return {
        k[len(prefix) :]: (tuple(v.size), v.properties.dtype)
        for k, v in metadata.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata) and k.startswith(prefix)
    }


def plan_export(
    path: Path, record: Dict[str, Any], out_dir: Path, n: int, wanted, target_bytes: int = 0
) -> Tuple[Any, List[ShardJob]]:
    """(the meta model, one ShardJob per shard: at most n, fewer when the model has fewer tensors,
    or fewer than n when target_bytes > 0 and the model fills fewer shards of that size)."""
    from partrain.checkpoint.export_model import hf_model_from_record

    saved = _saved_model_tensors(path)
    model = hf_model_from_record(record["model"])
    try:
        sources = plan_sources(model, saved, wanted)
    except KeyError as missing:
        raise ConfigError(
            Problem(
                PATH_KEY,
                str(path),
                f"the checkpoint has no tensor {missing.args[0]}",
                "export a checkpoint saved from this model",
            )
        ) from None
    check_conversion_is_per_tensor(model, sources)
    check_dtypes(sources)
    if target_bytes > 0:
        model_bytes = sum(nbytes(o.shape, o.dtype) for s in sources for o in s.outputs)
        n = min(n, max(1, math.ceil(model_bytes / target_bytes)))
    groups = deal(sources, n)
    names = shard_file_names(len(groups))
    sizes = {rel: int(size) for rel, size in record["files"].items()}
    return model, [
        ShardJob(
            str(path), str(out_dir / names[k]), k, len(groups), group, record["model"], share(sizes, k, len(groups))
        )
        for k, group in enumerate(groups)
    ]


# ---- writing --------------------------------------------------------------------------------------


def staging_dir(out_dir: Path) -> Path:
    """Where an export is written before its files are moved up into out_dir: a crash, a full disk
    or a failed shard leaves out_dir's files as they were (an earlier export stays whole). Inside
    out_dir, so the renames stay on one file system and only out_dir needs to be writable."""
    return out_dir / ".partial"


def _clear_old_weights(out_dir: Path) -> None:
    """Weights of an earlier export into the same folder would mix with these: remove them."""
    for old in list(out_dir.glob("model*.safetensors")) + [out_dir / INDEX_FILE]:
        if old.is_file():
            old.unlink()


def _prepare(path: Path, out_dir: Path, problems) -> None:
    """Check the checkpoint's files, then create an empty staging folder (an old one is a dead export's)."""
    if problems:
        raise CorruptCheckpoint([corrupt(p, why, key=PATH_KEY).problems[0] for p, why in problems])
    staging = staging_dir(out_dir)
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)  # out_dir too, when it is new
    except OSError as exc:
        raise _out_problem(out_dir, f"cannot be created: {exc.strerror or exc}") from None


def _finish(
    out_dir: Path, model, jobs: List[ShardJob], wanted, record: Dict[str, Any], tokenizer: Optional[Path]
) -> None:
    """What one process writes once every shard is on disk (index, configs, tokenizer files), then
    the move of the whole export from the staging folder into out_dir. jobs=[]: one file, no index."""
    from partrain.checkpoint.export_model import write_configs

    staging = staging_dir(out_dir)
    if len(jobs) > 1:
        (staging / INDEX_FILE).write_text(json.dumps(index_json(jobs), indent=2) + "\n")
    pretrained = record["model"].get("pretrained")
    write_configs(model, staging, wanted, Path(pretrained) if pretrained and Path(pretrained).is_dir() else None)
    if tokenizer is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, staging / name)
    elif (record.get("data") or {}).get("tokenizer") == "byte":
        log.info("the run used the byte tokenizer (ids = UTF-8 bytes): no tokenizer files to export")
    _publish(staging, out_dir)


def _publish(staging: Path, out_dir: Path) -> None:
    """Move every file of a complete export into out_dir (renames within one file system), the
    index and config last, so a reader never finds an index naming shards that are not there yet."""
    _clear_old_weights(out_dir)
    last = {INDEX_FILE, "config.json"}
    files = sorted(staging.iterdir(), key=lambda f: (f.name in last, f.name == INDEX_FILE, f.name))
    for file in files:
        os.replace(file, out_dir / file.name)
    staging.rmdir()


def _final_paths(reports: List[Optional[Dict[str, Any]]], out_dir: Path) -> None:
    for report in reports:
        if report is not None:
            report["file"] = str(out_dir / Path(report["file"]).name)


def export_hf_report(
    path: Path, out_dir: Path, tokenizer_folder: Optional[str] = None, nproc: int = 1, dtype: str = "fp32"
) -> Dict[str, Any]:
    """Export with `nproc` processes (1: in this process); returns {exported, dtype, shards: [each
    process's report: index, file, bytes, tensors, rss_before_bytes, peak_rss_bytes, seconds]}."""
    from partrain.checkpoint.hf_procs import run_shard_processes
    from partrain.checkpoint.hf_shards import write_shard

    path, out_dir = Path(path), Path(out_dir)
    wanted = export_dtype(dtype)
    if nproc < 1:
        raise ConfigError(Problem("--nproc", nproc, "must be at least 1", "pass --nproc 1 or more"))
    _check_out_dir(out_dir)
    require_checkpoint(path)
    record = read_record(path, key=PATH_KEY)
    tokenizer = _tokenizer_source(record, tokenizer_folder)
    from partrain.checkpoint.export_peft import lora_settings

    if lora_settings(record) is not None:  # adapters merged into their base weights (export_peft)
        return _export_merged(path, out_dir, record, nproc, dtype, tokenizer)
    if not has_checksums(record):
        warn_user(no_checksums_warning(path))
    model, jobs = plan_export(path, record, staging_dir(out_dir), nproc, wanted)
    existed = out_dir.exists()
    try:
        if len(jobs) == 1:
            _prepare(path, out_dir, file_problems(path, record))
            jobs[0].verify_files = []
            reports = [write_shard(jobs[0])]
        else:
            reports = run_shard_processes(jobs, lambda problems: _prepare(path, out_dir, problems))
        _finish(out_dir, model, jobs, wanted, record, tokenizer)
    finally:  # after a failure: no partial files, and no folder the export created
        shutil.rmtree(staging_dir(out_dir), ignore_errors=True)
        if not existed and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
    _final_paths(reports, out_dir)
    return {"exported": str(out_dir), "dtype": dtype, "shards": reports}


def export_hf(
    path: Path, out_dir: Path, tokenizer_folder: Optional[str] = None, nproc: int = 1, dtype: str = "fp32"
) -> Path:
    """Write the checkpoint's model as an HF folder (safetensors + config.json) loadable offline by
    `AutoModelForCausalLM.from_pretrained(out_dir)`; copy the tokenizer files of `tokenizer_folder`
    (default: the run's data.tokenizer when it was a local HF tokenizer folder). Returns out_dir."""
    return Path(export_hf_report(path, out_dir, tokenizer_folder, nproc, dtype)["exported"])


def export_hf_collective(path: Path, out_dir: Path, dtype: str = "fp32") -> Optional[Dict[str, Any]]:
    """Every rank of a training run calls this after its last checkpoint: ranks 0..n-1 each write
    one shard (n = ranks, fewer for a small model: about SHARD_TARGET_BYTES a shard), rank 0 the
    rest. The checkpoint was just written and hashed by this run, so it is not re-verified.
    Returns this rank's shard report (None for a rank without a shard)."""
    from partrain.checkpoint.hf_shards import write_shard

    path, out_dir = Path(path), Path(out_dir)
    rank, world = rank_world()
    wanted = export_dtype(dtype, "checkpoint.export_dtype")
    record = read_record(path, key=PATH_KEY)
    tokenizer = _tokenizer_source(record, None)
    from partrain.checkpoint.export_peft import lora_settings

    if lora_settings(record) is not None:  # peft=lora: rank 0 merges the adapters into their base weights
        report = _export_merged(path, out_dir, record, 1, dtype, tokenizer) if rank == 0 else None
        barrier()
        return report
    model, jobs = plan_export(path, record, staging_dir(out_dir), world, wanted, SHARD_TARGET_BYTES)
    if rank == 0:
        _prepare(path, out_dir, [])
    barrier()
    report = None
    if rank < len(jobs):
        jobs[rank].verify_files = []
        report = write_shard(jobs[rank])
    barrier()
    if rank == 0:
        _finish(out_dir, model, jobs, wanted, record, tokenizer)
    barrier()
    _final_paths([report], out_dir)
    return report


def _export_merged(
    path: Path, out_dir: Path, record: Dict[str, Any], nproc: int, dtype: str, tokenizer: Optional[Path]
) -> Dict[str, Any]:
    """`--hf OUT` of a LoRA checkpoint: the merged model (export_peft.merged_model, which verifies
    the checkpoint's files first) through the same writer, staging and config files as a plain
    export, in one process (the parallel shard writer reads base tensors only and would drop the
    adapters)."""
    from partrain.checkpoint.export_peft import merged_model
    from partrain.checkpoint.hf_shards import write_file

    if nproc != 1:
        raise ConfigError(
            Problem("--nproc", nproc, "a LoRA checkpoint's merged export is written by one process", "pass --nproc 1")
        )
    wanted = export_dtype(dtype)
    model, _ = merged_model(path)
    existed = out_dir.exists()
    try:
        _prepare(path, out_dir, [])
        file = staging_dir(out_dir) / SINGLE_FILE
        tensors = write_file(file, merged_batches(model, wanted))
        size = file.stat().st_size
        _finish(out_dir, model, [], wanted, record, tokenizer)
    finally:  # after a failure: no partial files, and no folder the export created
        shutil.rmtree(staging_dir(out_dir), ignore_errors=True)
        if not existed and out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
    shard = {"index": 0, "file": str(out_dir / SINGLE_FILE), "bytes": size, "tensors": tensors}
    return {"exported": str(out_dir), "dtype": dtype, "merged_lora": True, "shards": [shard]}


def merged_batches(model, wanted, limit: int = 32 << 20):
    """The state-dict adapter for a model in memory: its HF tensors as `save_pretrained` writes
    them (tied aliases left out, transformers' reverse conversion, floating tensors cast to
    `wanted`), in groups of about `limit` bytes for the writer."""
    from partrain.checkpoint.hf_plan import reverse_conversion, tied_aliases
    from partrain.checkpoint.hf_shards import own_storage

    alias = tied_aliases(model)
    state = {k: v.detach() for k, v in model.state_dict().items() if k not in alias}
    batch, size = {}, 0
    for name, value in reverse_conversion(model, state).items():
        batch[name] = own_storage(value.to(wanted) if value.is_floating_point() else value)
        size += batch[name].numel() * batch[name].element_size()
        if size >= limit:
            yield batch
            batch, size = {}, 0
    if batch:
        yield batch
