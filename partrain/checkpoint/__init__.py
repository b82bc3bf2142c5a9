"""Distributed checkpoints: DCP save/load under any layout, resume lookup, inspection, HF export.

Trainer-facing API (every function that touches tensors is collective when a process group exists):

    meta = run_meta(validated)                                   # once per run: meta / expect
    path = find_resume(root, cfg.checkpoint.resume)             # None, newest complete, or the given one
    record = load_checkpoint(path, parts, optimizer, meta)       # record["extra"] is the trainer's JSON
    path, extra = load_with_fallback(root, parts, optimizer, meta)   # resume=auto, skips damaged ones
    step_of(path)                                                # the step in a checkpoint folder's name
    save_checkpoint(root, step, parts, optimizer, extra, meta, keep_last, async_save)
    wait_pending_save()                                          # before exit when async_save is on
    checkpoint_info(path)                                        # one process, no process group
    export_hf(path, out_dir, tokenizer_folder, nproc, dtype)     # nproc processes, one shard each
    export_hf_collective(path, out_dir, dtype)                   # the ranks of a run, at its end
    verify_path(path) -> [Verdict]                               # `partrain checkpoint verify`, one process

Every file's size and SHA-256 is recorded in partrain.json at save time (each rank hashes what it
wrote) and checked before a load or export reads it; any failure to read a checkpoint is a
CorruptCheckpoint (resume=auto falls back past it); a failed save raises SaveFailed naming the cause.

Modules: folders (names, completeness, lookup, pruning), record (partrain.json), state (FQN-keyed
state of model parts and optimizers), zero1 (ShardedOptimizer adapter), rng (per-rank generators),
safe_io (no unpickling of untrusted data), checksums (SHA-256 of files), failures (one-line causes),
dist_util, save, load, export (info, one-process load), hf_export / hf_plan / hf_shards / hf_procs /
safetensors_stream / export_model (sharded HF export), verify.
"""

from partrain.checkpoint.export import checkpoint_info, load_model_weights
from partrain.checkpoint.failures import SaveFailed
from partrain.checkpoint.folders import (
    complete_checkpoints,
    find_resume,
    is_complete,
    step_dir,
    step_of,
)
from partrain.checkpoint.hf_export import export_hf, export_hf_collective, export_hf_report
from partrain.checkpoint.load import load_checkpoint, load_with_fallback
from partrain.checkpoint.record import CorruptCheckpoint, model_record, run_meta
from partrain.checkpoint.save import save_checkpoint, wait_pending_save
from partrain.checkpoint.verify import Verdict, verify_checkpoint, verify_path

__all__ = [
    "checkpoint_info",
    "export_hf",
    "export_hf_collective",
    "export_hf_report",
    "load_model_weights",
    "complete_checkpoints",
    "find_resume",
    "is_complete",
    "step_dir",
    "step_of",
    "load_checkpoint",
    "load_with_fallback",
    "CorruptCheckpoint",
    "model_record",
    "run_meta",
    "save_checkpoint",
    "wait_pending_save",
    "SaveFailed",
    "Verdict",
    "verify_checkpoint",
    "verify_path",
]
