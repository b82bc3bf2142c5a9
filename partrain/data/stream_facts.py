"""What a `data.streaming` run's batches depend on, without tokenizing or importing torch (the
launcher writes it into the run folder before any worker starts)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict

from partrain.blueprint.config.schema import DataConfig
from partrain.data.corpus import Corpus
from partrain.data.packing import FORMAT_VERSION
from partrain.data.tokenizer import tokenizer_name

STREAM_FORMAT = f"stream-{FORMAT_VERSION}"
"""The `format` of a streaming run's data facts (run folder stream.json)."""


def stream_facts(cfg: DataConfig) -> Dict[str, Any]:
    """What a streaming run's batches depend on (the multi-node agreement compares it across nodes,
    a checkpoint's data position records it): source identity and tokenizer, no token counts."""
    corpus = Corpus.from_config(cfg)
    tokenizer = tokenizer_name(cfg.tokenizer)
    source = json.dumps({"source": corpus.identity(), "tokenizer": tokenizer}, sort_keys=True)
    digest = hashlib.sha256(source.encode()).hexdigest()
    return {"format": STREAM_FORMAT, "tokenizer": tokenizer, "stream_source": digest}
