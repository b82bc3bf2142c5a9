"""The launch's one data step: a packed token cache for text, an examples cache for fine-tuning rows.

Both entries are found through their meta.json, which the run folder's data.json names; meta.json's
"kind" tells a worker which of the two to open (``open_run_data``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from partrain.blueprint.config.schema import DataConfig
from partrain.data.examples import KIND, open_examples, prepare_examples, uses_examples
from partrain.data.packing import prepare_tokens


def prepare_data(cfg: DataConfig, cache_root: Optional[Path] = None):
    """``prepare_examples`` for chat / prompt_completion / tokenized rows, else ``prepare_tokens``;
    either result has ``meta_path``."""
    if uses_examples(cfg):
        return prepare_examples(cfg, cache_root)
    return prepare_tokens(cfg, cache_root)


def is_examples_entry(meta_path) -> bool:
    """Whether the cache entry of ``meta_path`` holds fine-tuning examples."""
    return json.loads(Path(meta_path).read_text(encoding="utf-8")).get("kind") == KIND


def open_example_batches(
    meta_path,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    with_eval: bool,
    long_examples: str = "truncate",
    packing: bool = False,
):
    """(training batches, eval batches or None) of an examples entry (for a worker). long_examples:
    data.long_examples (error reaches here only when the preflight found no long example); packing:
    data.packing (windows of whole examples, partrain.data.example_packing) or one padded example per row."""
    from partrain.data.example_packing import example_batch_classes

    examples = open_examples(meta_path)
    train_cls, eval_cls = example_batch_classes(packing, examples.paired)
    evals = eval_cls(examples, seq_len, global_batch_size, long_examples) if with_eval else None
    return train_cls(examples, seq_len, global_batch_size, seed, long_examples), evals
