"""The eval set from a split or a file of its own (data.eval_split, data.eval_source), not the held-out tail.

By default the last data.eval_fraction of the training data is held out for evaluation. A dataset that
ships a validation split, or a user with a separate eval file, names it instead:

- ``data.eval_split=NAME``: split NAME of the `datasets` source (a save_to_disk DatasetDict folder or a
  Hub dataset), read as data.split is; every row of data.split then trains.
- ``data.eval_source=PATH``: a second file, folder or `datasets` folder (its split: data.eval_split if
  set, else data.split), read with data.source's settings (format, fields, tokenizer, max_bytes).

The eval set is read with the same readers as the training set (``eval_config`` is data.source's
config with the source and split replaced), so a bad eval row or a missing eval split is the same exit 2,
naming data.eval_split or data.eval_source. Text runs see the two as one ``SplitCorpus`` (the packed
cache writes its documents to train.bin and eval.bin); example runs render the eval rows after the
training rows (partrain.data.examples).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from partrain.blueprint.config.schema import DataConfig
from partrain.data.builtin_chat import GENERATED_SOURCES
from partrain.data.corpus import Corpus
from partrain.data.hf_dataset import DatasetCorpus
from partrain.errors import ConfigError, Problem


def eval_config(cfg: DataConfig) -> Optional[DataConfig]:
    """The config that reads the eval set, or None when the eval set is the held-out tail.

    A ConfigError when data.eval_split names a split of a source that has none (files, builtin)."""
    if not cfg.eval_split and not cfg.eval_source:
        return None
    if cfg.eval_source and cfg.eval_source not in GENERATED_SOURCES and not Path(cfg.eval_source).expanduser().exists():
        raise ConfigError(  # said here: the file readers would name data.source
            Problem(
                "data.eval_source",
                cfg.eval_source,
                "no such file or folder (a Hub dataset id is not read here: download it, or use data.eval_split)",
                "give an existing .txt/.jsonl/.parquet file or folder, or a datasets folder",
            )
        )
    held = dataclasses.replace(
        cfg,
        source=cfg.eval_source or cfg.source,
        split=cfg.eval_split or cfg.split,
        eval_split="",
        eval_source="",
        eval_fraction=0.0,
    )
    if cfg.eval_split and not isinstance(Corpus.from_config(held), DatasetCorpus):
        source = "data.eval_source" if cfg.eval_source else "data.source"
        raise ConfigError(
            Problem(
                "data.eval_split",
                cfg.eval_split,
                f"{source}={held.source} is not a `datasets` source (a save_to_disk folder or a Hub dataset), "
                "so it has no splits",
                "name the eval file with data.eval_source=PATH and leave data.eval_split unset",
            )
        )
    if not cfg.eval_source and cfg.eval_split == cfg.split:
        raise ConfigError(
            Problem(
                "data.eval_split",
                cfg.eval_split,
                "is data.split too: the model would be evaluated on the rows it trains on",
                "name another split (e.g. validation or test), or unset it for the held-out tail",
            )
        )
    return held


def eval_corpus(cfg: DataConfig):
    """The eval set's corpus (its split's reader names data.eval_split in its errors), or None."""
    held = eval_config(cfg)
    if held is None:
        return None
    corpus = Corpus.from_config(held)
    if isinstance(corpus, DatasetCorpus):
        corpus = dataclasses.replace(corpus, split_key="data.eval_split" if cfg.eval_split else "data.split")
        corpus._dataset()  # a missing split is exit 2 here, naming the key that chose it and the splits there are
    return corpus


@dataclass(frozen=True)
class SplitCorpus:
    """A training corpus and an eval corpus read as one source (the surface of corpus.Corpus)."""

    train: Any
    held: Any

    kind = property(lambda self: self.train.kind)
    root = property(lambda self: self.train.root)
    files = property(lambda self: self.train.files)
    text_field = property(lambda self: self.train.text_field)
    max_bytes = property(lambda self: self.train.max_bytes)

    @property
    def slug(self) -> str:
        return self.train.slug

    def identity(self) -> Dict[str, Any]:
        """Both sources' identities: a change in either rebuilds the cache entry."""
        return {**self.train.identity(), "eval_source": self.held.identity()}

    def documents(self) -> Iterator[str]:
        """The training documents."""
        return self.train.documents()

    def eval_documents(self) -> Iterator[str]:
        return self.held.documents()


def with_eval_source(cfg: DataConfig, corpus):
    """``corpus`` itself, or a SplitCorpus when data.eval_split / data.eval_source names the eval set."""
    held = eval_corpus(cfg)
    return corpus if held is None else SplitCorpus(corpus, held)


def describe(cfg: DataConfig) -> str:
    """The eval set in words (the dry run's fine-tuning line)."""
    if cfg.eval_source:
        name = Path(cfg.eval_source).name
        return f"{name}" + (f" split {cfg.eval_split}" if cfg.eval_split else "")
    if cfg.eval_split:
        return f"split {cfg.eval_split}"
    return f"the last {cfg.eval_fraction * 100:g}% of the rows"
