"""The training corpus: which files a ``data.source`` names, their identity, and their documents.

``data.source`` is either ``builtin`` or a local path:

- ``builtin``: the ``.py`` files of this Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), read at run time so nothing ships with partrain and
  nothing is downloaded. Test folders, ``site-packages`` and caches are skipped; each file is one
  document. Files are taken in sorted order of their relative path, so the corpus is the same
  on every run of the same Python.
- a ``.txt``, ``.jsonl`` or ``.parquet`` file (see ``formats`` for each), or a folder: every
  file with one of those suffixes below it, recursively, in sorted order of relative path
  (hidden files and folders skipped).

``max_bytes`` caps the UTF-8 bytes of document text read (not file bytes: JSON syntax does not
count). The document that crosses the cap is cut at a character boundary and reading stops.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

from partrain.blueprint.config.schema import DataConfig
from partrain.data.builtin_chat import GENERATED_SOURCES, BuiltinChat
from partrain.data.formats import SUFFIXES, capped, read_documents, source_error
from partrain.data.hf_dataset import DatasetCorpus, is_dataset_folder
from partrain.errors import ConfigError

BUILTIN = "builtin"
"""The ``data.source`` value that selects the standard-library corpus."""

# Folders of the standard library that are not library source: tests (partly deliberately
# broken or odd-encoded files), third-party packages (differ per machine) and bytecode caches.
_BUILTIN_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


BUILTIN_BYTES = 8_000_000
"""What data.max_bytes=-1 (the default) reads of the builtin corpus (the standard library's sources run
to tens of MB; 8 MB is plenty for the CPU recipes)."""


def source_byte_cap(source: str, max_bytes: int) -> int:
    """data.max_bytes resolved (0 = no cap): the default -1 caps the builtin corpus only, never a
    user's own source."""
    if max_bytes >= 0:
        return max_bytes
    return BUILTIN_BYTES if source == BUILTIN else 0


def cut_note(cfg: DataConfig) -> Optional[str]:
    """The note of a data.max_bytes that leaves part of a user's files unread (None when it reads them
    all, or for the builtin corpus and dataset folders): said by the dry run and the launch."""
    cap = source_byte_cap(cfg.source, cfg.max_bytes)
    if cap <= 0 or cfg.source in (BUILTIN, *GENERATED_SOURCES):
        return None
    try:
        corpus = Corpus.from_config(cfg)
    except ConfigError:
        return None  # the data check reports it
    if not isinstance(corpus, Corpus):
        return None
    total = sum(p.stat().st_size for p in corpus.files)
    if total <= cap:
        return None
    return (
        f"data.max_bytes={cap} reads the first {cap:,} bytes of text of {cfg.source} ({total:,} bytes of files): "
        "the rest is not trained on; data.max_bytes=0 reads all of it"
    )


@dataclass(frozen=True)
class Corpus:
    """An ordered list of source files plus how to read documents from them."""

    kind: str
    """``builtin`` or ``files``."""
    root: Path
    """The standard-library folder, the given file, or the given folder."""
    files: Tuple[Path, ...]
    """Files to read, in reading order."""
    text_field: str
    """Field holding the text in jsonl/parquet records."""
    max_bytes: int
    """Cap on UTF-8 bytes of document text (0 = no cap)."""

    @classmethod
    def from_config(cls, cfg: DataConfig) -> "Corpus | DatasetCorpus | BuiltinChat":
        """Resolve ``cfg.source`` to its files; a ConfigError if it names nothing readable."""
        if cfg.source in GENERATED_SOURCES:  # generated rows (partrain.data.builtin_chat), no files
            return BuiltinChat.named(cfg.source)
        cap = source_byte_cap(cfg.source, cfg.max_bytes)
        if cfg.source == BUILTIN:
            root = Path(sysconfig.get_paths()["stdlib"]).resolve()
            return cls(BUILTIN, root, _builtin_files(root), cfg.text_field, cap)
        given = Path(cfg.source).expanduser()
        if is_dataset_folder(given):  # not resolved: the Hub cache's snapshot path names the commit
            return DatasetCorpus.open(given, cfg.text_field, cap, cfg.split, cfg.streaming)
        root = given.resolve()
        return cls("files", root, _user_files(root, cfg.source), cfg.text_field, cap)

    @property
    def slug(self) -> str:
        """A short readable name for cache folders (``builtin``, or the file/folder stem)."""
        if self.kind == BUILTIN:
            return BUILTIN
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.root.stem)[:40] or "data"

    def identity(self) -> Dict[str, Any]:
        """Everything the documents depend on: paths, sizes and modification times of the files.

        A changed, added or removed file changes the identity, so a cache keyed by it is rebuilt.
        """
        stats = []
        for path in self.files:
            try:
                st = path.stat()
            except OSError as exc:
                raise source_error(path, f"cannot read the file: {exc}", "check the path and its permissions") from exc
            stats.append(
                [path.relative_to(self.root).as_posix() if path != self.root else path.name, st.st_size, st.st_mtime_ns]
            )
        ident: Dict[str, Any] = {
            "kind": self.kind,
            "root": str(self.root),
            "files": stats,
            "text_field": self.text_field,
            "max_bytes": self.max_bytes,
        }
        if self.kind == BUILTIN:
            ident["python"] = sys.version
        return ident

    def documents(self) -> Iterator[str]:
        """The documents in order, empty ones skipped, stopping at ``max_bytes``.

        Raises a ConfigError at the end if the source held no text at all.
        """
        remaining: Optional[int] = self.max_bytes or None
        # The standard library has a few files that are not UTF-8; replacing their odd bytes is
        # harmless there. A user's file with bad bytes is more likely the wrong file: say so.
        errors = "replace" if self.kind == BUILTIN else "strict"
        produced = False
        for text in capped(self._texts(errors, remaining), remaining):
            produced = True
            yield text
        if not produced:
            raise source_error(
                self.root, "holds no text (every document is empty)", "check the file contents and data.text_field"
            )

    def _texts(self, errors: str, limit: Optional[int]) -> Iterator[str]:
        # `limit` is only a read-ahead hint for the txt reader; exact clipping is done above.
        for path in self.files:
            yield from (text for text in read_documents(path, self.text_field, limit, errors) if text)


def _builtin_files(root: Path) -> Tuple[Path, ...]:
    files = []
    for folder, dirs, names in os.walk(root):
        # Pruning in place stops os.walk from descending into skipped folders at all.
        dirs[:] = [d for d in dirs if d not in _BUILTIN_SKIP_DIRS and not d.startswith((".", "config-"))]
        files.extend(Path(folder, n) for n in names if n.endswith(".py"))
    if not files:
        raise source_error(
            root,
            "data.source=builtin found no standard-library .py files in this Python",
            "give a local .txt/.jsonl/.parquet file or folder as data.source",
        )
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))


def _user_files(root: Path, given: str) -> Tuple[Path, ...]:
    if not root.exists():
        raise source_error(
            Path(given),
            "no such file or folder",
            "give an existing .txt/.jsonl/.parquet file or folder, or data.source=builtin",
        )
    if root.is_file():
        if root.suffix.lower() not in SUFFIXES:
            raise source_error(
                root,
                f"unsupported file type {root.suffix or '(none)'}; supported: {', '.join(SUFFIXES)}",
                "convert the data to .txt, .jsonl or .parquet",
            )
        if root.stat().st_size == 0:
            raise source_error(root, "the file is empty", "give a file with text in it")
        return (root,)
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files.extend(Path(folder, n) for n in names if not n.startswith(".") and Path(n).suffix.lower() in SUFFIXES)
    if not files:
        raise source_error(
            root,
            f"the folder holds no {', '.join(SUFFIXES)} files",
            "put the data files in the folder, or point data.source at a file",
        )
    return tuple(sorted(files, key=lambda p: p.relative_to(root).as_posix()))
