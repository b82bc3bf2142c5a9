"""What a `data.streaming` run's batches depend on, without tokenizing or importing torch (the
launcher writes it into the run folder before any worker starts)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict

from partrain.blueprint.config.schema import DataConfig
from partrain.blueprint.validate_data_format import EXAMPLE_FORMATS
from partrain.data.corpus import Corpus
from partrain.data.examples import rendering, resolve_format
from partrain.data.packing import FORMAT_VERSION
from partrain.data.tokenizer import tokenizer_name

STREAM_FORMAT = f"stream-{FORMAT_VERSION}"
"""The `format` of a streaming run's data facts (run folder stream.json)."""

STREAM_SOURCE_COVERS = (
    "data.source's files, data.tokenizer, and for fine-tuning rows data.format, data.chat_template, "
    "data.prompt_template, data.train_on and data.long_examples"
)
"""What the stream identity ("stream_source", a digest) covers, in the words of a resume's refusal."""


def stream_facts(cfg: DataConfig) -> Dict[str, Any]:
    """What a streaming run's batches depend on (the multi-node agreement compares it across nodes,
    a checkpoint's data position records it, so a resume with other values is exit 2): source identity
    and tokenizer, and for fine-tuning rows how each is rendered (`example_rendering`); no token counts."""
    corpus = Corpus.from_config(cfg)
    tokenizer = tokenizer_name(cfg.tokenizer)
    inputs = {"source": corpus.identity(), "tokenizer": tokenizer, **example_rendering(cfg)}
    source = json.dumps(inputs, sort_keys=True)
    digest = hashlib.sha256(source.encode()).hexdigest()
    return {"format": STREAM_FORMAT, "tokenizer": tokenizer, "stream_source": digest}


def example_rendering(cfg: DataConfig) -> Dict[str, Any]:
    """For streamed fine-tuning rows: the format, templates and data.train_on (partrain.data.examples
    .rendering), and data.long_examples (which rows a stream leaves out, so which row a step reads).
    {} for streamed text, whose identity (and its checkpoints' recorded one) stays source and tokenizer."""
    fmt = resolve_format(cfg)
    if fmt not in EXAMPLE_FORMATS:
        return {}
    return {**rendering(cfg, fmt), "long_examples": cfg.long_examples}
