"""partrain's data pipeline: corpus -> tokens -> packed cache files -> deterministic batches.

Typical use::

    packed = prepare_tokens(cfg.data)                    # once, before workers start
    packed = open_packed(meta_path)                      # in each worker
    train = TokenBatches.from_packed(packed, seq_len, global_batch_size, seed)
    inputs, labels = train.next_batch(dp_rank, dp_size)
    evals = EvalBatches.from_packed(packed, seq_len, global_batch_size)
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "BUILTIN": "corpus",
    "Corpus": "corpus",
    "Batch": "loader",
    "EvalBatches": "loader",
    "TokenBatches": "loader",
    "batch_problems": "batch_check",
    "open_tokens": "loader",
    "PackedData": "packing",
    "cache_root_for": "packing",
    "default_cache_root": "packing",
    "open_packed": "packing",
    "prepare_tokens": "packing",
    "probe_tokens": "packing",
    "token_dtype": "packing",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "Tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "tokenizer_name": "tokenizer",
}
"""Public name -> the submodule of partrain.data that defines it."""

__all__ = [
    "BUILTIN",
    "Corpus",
    "Batch",
    "EvalBatches",
    "TokenBatches",
    "batch_problems",
    "open_tokens",
    "PackedData",
    "cache_root_for",
    "default_cache_root",
    "open_packed",
    "prepare_tokens",
    "probe_tokens",
    "token_dtype",
    "ByteTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "tokenizer_name",
]


def __getattr__(name: str):
    # Lazy (PEP 562): the CLI reads checkpoint folders and config before any worker starts, and
    # importing torch for that would add seconds to every launch.
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
