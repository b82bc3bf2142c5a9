"""The nearest valid name to a mistyped one, for the "did you mean" of config errors."""

from __future__ import annotations

import difflib
from typing import Iterable, Optional


def nearest_name(value, names: Iterable) -> Optional[str]:
    """The same letters in another case first (`1F1B` -> 1f1b, `GPT-DP` -> gpt-dp), then the closest
    spelling of the lower-cased value; None when nothing is close."""
    names = [str(n) for n in names]
    text = str(value)
    same = [n for n in names if n.lower() == text.lower()]
    if same:
        return same[0]
    close = difflib.get_close_matches(text.lower(), names, n=1) or difflib.get_close_matches(text, names, n=1)
    return close[0] if close else None


KEY_ALIASES = {
    "tp": ("tensor_parallel", "tensor_parallel_size", "tp_size", "tensor_model_parallel_size", "tp_degree"),
    "pp": ("pipeline_parallel", "pipeline_parallel_size", "pp_size", "pipeline_model_parallel_size", "pp_degree"),
    "dp": ("data_parallel", "data_parallel_size", "dp_size", "dp_degree"),
    "sp": ("sequence_parallel", "context_parallel", "context_parallel_size", "cp", "cp_size", "sp_size"),
    "ep": ("expert_parallel", "expert_parallel_size", "expert_model_parallel_size", "ep_size"),
    "nodes": ("num_nodes", "nnodes", "n_nodes", "node_count"),
    "devices_per_node": ("gpus_per_node", "nproc_per_node", "num_gpus", "n_gpus", "gpus", "devices"),
    "steps": ("max_steps", "num_steps", "train_steps", "total_steps", "iterations", "train_iters"),
    "lr": ("learning_rate",),
    "seq_len": ("max_seq_len", "seq_length", "sequence_length", "max_length", "block_size", "context_length"),
    "global_batch_size": ("batch_size", "train_batch_size"),
    "micro_batch_size": ("micro_batch", "per_device_train_batch_size", "train_micro_batch_size_per_gpu"),
}
"""What other tools (Megatron-LM, DeepSpeed, torchrun, HF Trainer) call a partrain key; a key typed under
such a name is pointed at partrain's."""


def nearest_key(typed: str, keys: Iterable) -> Optional[str]:
    """The key a mistyped one most likely meant, among its siblings `keys`: another tool's name for it
    (KEY_ALIASES), then a key equal to one of its words (`num_nodes` -> nodes), then the shortest key
    containing one of its longer words, then the closest spelling. None when nothing is close."""
    keys = [str(k) for k in keys]
    text = str(typed).lower()
    for key, aliases in KEY_ALIASES.items():
        if key in keys and text in aliases:
            return key
    words = [w for w in text.replace("-", "_").split("_") if w]
    equal = [k for k in keys if k in words]
    if equal:
        return equal[0]
    containing = sorted((k for k in keys if any(len(w) >= 4 and w in k.split("_") for w in words)), key=len)
    if containing:
        return containing[0]
    close = difflib.get_close_matches(text, keys, n=1)
    return close[0] if close else None
