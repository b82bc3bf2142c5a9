"""A `datasets` source: a save_to_disk folder or a Hub dataset snapshot, read through the datasets package.

`data.source` names such a folder directly, or a Hub dataset id that `partrain.preflight.hub`
resolved to its snapshot in the Hub cache (`datasets--org--name/snapshots/<commit>`, parquet or
jsonl files in the Hub's layout). `data.split` picks the split, `data.text_field` the column,
`data.streaming` reads it as an IterableDataset. The documents feed the same tokenize-once packed
cache as file sources, so batches stay independent of the layout; the cache key covers the
folder's files (names, sizes, modification times), the split, the field and max_bytes.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

from partrain.data.formats import capped
from partrain.errors import ConfigError, Problem

_SNAPSHOT = re.compile(r"/datasets--[^/]+/snapshots/[0-9a-f]{40}(/|$)")


def is_dataset_folder(root: Path) -> bool:
    """A save_to_disk folder (a Dataset's state.json, a DatasetDict's dataset_dict.json) or a Hub
    dataset snapshot."""
    if not root.is_dir():
        return False
    saved = (root / "state.json").is_file() or (root / "dataset_dict.json").is_file()
    return saved or bool(_SNAPSHOT.search(str(root) + "/"))


def _problem(key: str, value: Any, rule: str, fix: str) -> ConfigError:
    return ConfigError(Problem(key=key, value=value, rule=rule, fix=fix))


@dataclass(frozen=True)
class DatasetCorpus:
    """The documents of one split of a `datasets` folder (same surface as corpus.Corpus)."""

    root: Path
    files: Tuple[Path, ...]
    text_field: str
    max_bytes: int
    split: str
    streaming: bool
    kind: str = "dataset"
    split_key: str = "data.split"
    """The key that chose ``split`` (data.eval_split for the eval set), named when the split is missing."""

    @classmethod
    def open(cls, root: Path, text_field: str, max_bytes: int, split: str, streaming: bool) -> "DatasetCorpus":
        files = []
        for folder, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            files.extend(Path(folder, n) for n in names if not n.startswith("."))
        return cls(root, tuple(sorted(files)), text_field, max_bytes, split, streaming)

    @property
    def slug(self) -> str:
        name = self.root.parent.parent.name if _SNAPSHOT.search(str(self.root) + "/") else self.root.name
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:40] or "dataset"

    def identity(self) -> Dict[str, Any]:
        stats = []
        for path in self.files:
            st = path.stat()  # follows the Hub cache's symlinks to the blobs
            stats.append([path.relative_to(self.root).as_posix(), st.st_size, st.st_mtime_ns])
        return {
            "kind": self.kind,
            "root": str(self.root),
            "files": stats,
            "split": self.split,
            "text_field": self.text_field,
            "max_bytes": self.max_bytes,
        }

    def _dataset(self):
        try:
            import datasets
        except ImportError:
            raise _problem(
                "data.source",
                str(self.root),
                "reading a datasets folder needs the datasets package",
                "pip install partrain[data]",
            ) from None
        saved = (self.root / "state.json").is_file() or (self.root / "dataset_dict.json").is_file()
        try:
            if saved:
                ds = datasets.load_from_disk(str(self.root))
                if isinstance(ds, datasets.DatasetDict):
                    if self.split not in ds:
                        raise KeyError(f"the splits are {', '.join(sorted(ds))}")
                    ds = ds[self.split]
                elif self.split_key == "data.eval_split":  # one Dataset: data.split is moot, but no eval split
                    raise KeyError("it is one Dataset (save_to_disk of a Dataset, not a DatasetDict): no splits")
                return ds.to_iterable_dataset() if self.streaming else ds
            return datasets.load_dataset(str(self.root), split=self.split, streaming=self.streaming)
        except (KeyError, ValueError) as exc:
            if "split" in str(exc).lower() or isinstance(exc, KeyError):
                why = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
                raise _problem(
                    self.split_key,
                    self.split,
                    f"{self.root} has no split {self.split!r} ({why})",
                    f"set {self.split_key}",
                ) from None
            raise _problem(
                "data.source", str(self.root), f"datasets cannot read it: {exc}", "check the folder"
            ) from None

    def _texts(self) -> Iterator[str]:
        ds = self._dataset()
        columns = getattr(ds, "column_names", None)
        if columns is not None and self.text_field not in columns:
            raise _problem(
                "data.text_field",
                self.text_field,
                f"{self.root}: the dataset has no column {self.text_field!r} (columns: {columns})",
                "set data.text_field to the column that holds the text",
            )
        rows = ds.select_columns([self.text_field]) if not self.streaming else ds
        for row in rows:
            text = row.get(self.text_field)
            if isinstance(text, str) and text:
                yield text

    def rows(self) -> Iterator[Tuple[str, Any]]:
        """("row N", row) of every row of the split, in order (fine-tuning rows: partrain.data.examples)."""
        for n, row in enumerate(self._dataset(), start=1):
            yield f"row {n}", row

    def documents(self) -> Iterator[str]:
        """The documents in order, empty ones skipped, cut at max_bytes (as corpus.Corpus does)."""
        produced = False
        for text in capped(self._texts(), self.max_bytes):
            produced = True
            yield text
        if not produced:
            raise _problem(
                "data.source", str(self.root), "holds no text in this split", "check data.split and data.text_field"
            )
