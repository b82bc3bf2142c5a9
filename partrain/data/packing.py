"""Tokenize a corpus once and cache it as flat token files that every worker can memory-map.

Layout of one cache entry (a folder under the cache root)::

    <cache root>/<source>-<key>/
        train.bin   raw token ids, little-endian, dtype uint16 (vocab <= 65536) or uint32
        eval.bin    the same for the held-out split
        meta.json   dtype, token counts, tokenizer, eos id, each file's size and SHA-256; written LAST

The token stream is ``doc1 eos doc2 eos ...`` (every document ends with the separator). The
eval split is the last ``eval_fraction`` of that stream, the train split everything before it; with
data.eval_split / data.eval_source (partrain.data.eval_source) the eval split is that set's own stream
and every training document trains.

``key`` hashes everything the tokens depend on: the source identity (paths, sizes, mtimes of
its files), the tokenizer identity, ``text_field``, ``max_bytes`` and ``eval_fraction``. A
different input gets a different folder; the same input finds its folder and skips the work.

Crash safety: an entry is built in a private temporary folder beside it (``.<name>.XXXX.tmp``)
and renamed into place whole, so the entry folder, when there, holds a finished entry. It is
trusted only when whole: ``open_packed`` checks the file sizes against meta.json always and their
SHA-256 when asked (``prepare_tokens`` asks: once per run, in the launcher); a damaged, truncated
or pre-checksum entry is rebuilt, with a warning saying so. Several processes may build the same
entry at once: the first rename wins and a builder that loses the race uses the winner's entry
(identical bytes). A launcher should still prepare once before starting workers, and workers
should only ``open_packed`` (sizes only: cheap).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, TypeVar, Union

import numpy as np

from partrain.blueprint.config.schema import DataConfig
from partrain.blueprint.problems import os_error_problem
from partrain.data.atomic import commit, fsync_dir, temp_path, write_json
from partrain.data.corpus import Corpus
from partrain.data.eval_source import SplitCorpus, with_eval_source
from partrain.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_name
from partrain.errors import ConfigError, Problem

log = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT_VERSION = 1
"""Bumped whenever the file layout or the tokenization rules change, so old entries are not reused."""
META_NAME = "meta.json"
TRAIN_NAME = "train.bin"
EVAL_NAME = "eval.bin"

# Documents handed to the tokenizer per call: large enough for fast batch encoding, small
# enough that memory stays bounded on huge corpora.
_BATCH_DOCS = 256
_BATCH_BYTES = 4 << 20
# A temporary file untouched for this long belongs to a build that died.
_STALE_TEMP_S = 3600


@dataclass(frozen=True)
class PackedData:
    """A ready cache entry: where the token files are and how to read them."""

    train_path: Path
    """Flat token file of the training split."""
    eval_path: Path
    """Flat token file of the held-out split (may be empty when eval_fraction is 0)."""
    dtype: str
    """numpy dtype name of the token files: uint16 or uint32."""
    vocab_size: int
    """Tokenizer vocabulary size (every id is below it)."""
    eos_id: int
    """End-of-document id written after every document."""
    n_train_tokens: int
    """Tokens in train_path."""
    n_eval_tokens: int
    """Tokens in eval_path."""
    tokenizer: str
    """Identity of the tokenizer that produced the ids."""
    meta_path: Path
    """The entry's meta.json; ``open_packed(meta_path)`` reopens the entry."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every id below ``vocab_size``."""
    # Little-endian always, so a cache folder is portable between machines.
    return np.dtype("<u2" if vocab_size <= 1 << 16 else "<u4")


def default_cache_root() -> Path:
    """Where packed token files go when data.cache_dir is not set."""
    return Path.home() / ".cache" / "partrain" / "data"


def cache_root_for(cfg: DataConfig, cache_root: Optional[Path] = None) -> Path:
    """The cache root: the explicit argument, else data.cache_dir, else the default."""
    if cache_root is not None:
        return Path(cache_root).expanduser()
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    return default_cache_root()


def cache_key(corpus: Corpus, tokenizer: str, eval_fraction: float) -> str:
    """A hash of everything the cached tokens depend on."""
    inputs = {
        "format": FORMAT_VERSION,
        "source": corpus.identity(),
        "tokenizer": tokenizer,
        "eval_fraction": float(eval_fraction),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def prepare_tokens(cfg: DataConfig, cache_root: Optional[Path] = None) -> PackedData:
    """Tokenize and pack ``cfg``'s corpus into the cache, or reuse the entry if it is already there.

    A cache hit only stats the source files and hashes the tokenizer files; the tokenizer itself
    is loaded only on a miss.
    """
    corpus, key, folder = _entry(cfg, cache_root)
    packed = reopen_entry(folder, open_packed, "data cache")
    if packed is not None:
        return packed
    tokenizer = load_tokenizer(cfg.tokenizer)
    return build_entry(folder, lambda: _build(corpus, tokenizer, cfg.eval_fraction, folder, key), "token cache")


def reopen_entry(folder: Path, open_entry: Callable[..., T], what: str) -> Optional[T]:
    """The cache entry in ``folder`` (``open_entry(meta_path, verify=True)``), or None when there is
    none or it is damaged: meta.json present but the files do not match it (cut short, changed,
    deleted) is rebuilt with a warning rather than a failure, the inputs are all still here."""
    meta_path = folder / META_NAME
    if not meta_path.exists():
        return None
    try:
        return open_entry(meta_path, verify=True)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("rebuilding the damaged %s entry %s: %s", what, folder, exc)
        return None


def build_entry(folder: Path, build: Callable[[], T], what: str) -> T:
    """``build()`` the entry in ``folder``. The folders it creates are removed again if it fails, so a
    refused run leaves no empty cache; an OSError is the cache side (no permission, no space: reading
    the source reports its own errors as ConfigErrors), data.cache_dir's exit 2."""
    fresh = [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        return build()
    except OSError as exc:
        raise ConfigError(
            os_error_problem(
                "data.cache_dir",
                folder.parent,
                exc,
                f"write the {what}",
                "set data.cache_dir to a writable folder with enough free space",
            )
        ) from exc
    finally:
        _remove_empty(fresh)


def _entry(cfg: DataConfig, cache_root: Optional[Path]) -> tuple:
    """(corpus, cache key, entry folder) of ``cfg``: the same for prepare_tokens and probe_tokens."""
    _check_numbers(cfg)
    corpus = with_eval_source(cfg, Corpus.from_config(cfg))  # data.eval_split / eval_source: its own eval set
    key = cache_key(corpus, tokenizer_name(cfg.tokenizer), cfg.eval_fraction)
    return corpus, key, cache_root_for(cfg, cache_root) / f"{corpus.slug}-{key[:16]}"


def probe_tokens(
    cfg: DataConfig, enough: Callable[[PackedData], bool], cache_root: Optional[Path] = None
) -> PackedData:
    """What ``prepare_tokens`` would return, found without writing anything (the dry run's data check).

    A valid cache entry is reused as it is. Otherwise the corpus is read and tokenized in memory,
    with the readers and tokenizer ``prepare_tokens`` uses (so a bad source fails with the same
    ConfigError), until ``enough`` says the counts so far settle the verdict, or the corpus ends.
    The result names the entry's files where ``prepare_tokens`` would write them (they need not
    exist) and holds token counts of the stream read so far: exact when the corpus ended, else a
    lower bound. Stopping early is sound for any ``enough`` that is monotone in the counts: the
    train and eval counts of a longer stream are never smaller (the eval split is
    round(n x eval_fraction) of n tokens, which grows by at most one token per token).
    A record after the point where reading stopped is not looked at (``prepare_tokens`` reads it).
    """
    corpus, _, folder = _entry(cfg, cache_root)
    meta_path = folder / META_NAME
    if meta_path.exists():
        try:
            return open_packed(meta_path)
        except (OSError, ValueError, KeyError):
            pass  # damaged: prepare_tokens rebuilds it; count as if it were not there
    tokenizer = load_tokenizer(cfg.tokenizer)
    dtype = token_dtype(tokenizer.vocab_size)

    held_out = _count_eval(corpus, tokenizer)

    def counted(n_total: int) -> PackedData:
        n_eval = int(round(n_total * cfg.eval_fraction)) if held_out is None else held_out
        n_total += 0 if held_out is None else held_out
        return PackedData(
            train_path=folder / TRAIN_NAME,
            eval_path=folder / EVAL_NAME,
            dtype=dtype.name,
            vocab_size=tokenizer.vocab_size,
            eos_id=tokenizer.eos_id,
            n_train_tokens=n_total - n_eval,
            n_eval_tokens=n_eval,
            tokenizer=tokenizer.name,
            meta_path=meta_path,
        )

    n_total = 0
    for doc in corpus.documents():  # one document at a time: reading stops as soon as the verdict is known
        (ids,) = tokenizer.encode_batch([doc])
        check_ids(ids, tokenizer)
        n_total += len(ids) + 1  # the document and its end-of-document separator, as _write_stream writes them
        if enough(counted(n_total)):
            break
    return counted(n_total)


def open_packed(entry: Union[PackedData, Path, str], verify: bool = False) -> PackedData:
    """Reopen a cache entry from its meta.json (or its folder, or a PackedData), checking it.

    For workers that only read: it never builds anything. Raises FileNotFoundError if the entry
    does not exist and ValueError if its files do not match its meta.json: their sizes always, their
    SHA-256 too with ``verify`` (one read of the files).
    """
    if isinstance(entry, PackedData):
        meta_path = entry.meta_path
    else:
        meta_path = Path(entry).expanduser()
        if meta_path.is_dir():
            meta_path = meta_path / META_NAME
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{meta_path} has format {meta.get('format')}, this partrain reads format {FORMAT_VERSION}")
    folder = meta_path.parent
    packed = PackedData(
        train_path=folder / meta["train_file"],
        eval_path=folder / meta["eval_file"],
        dtype=meta["dtype"],
        vocab_size=int(meta["vocab_size"]),
        eos_id=int(meta["eos_id"]),
        n_train_tokens=int(meta["n_train_tokens"]),
        n_eval_tokens=int(meta["n_eval_tokens"]),
        tokenizer=meta["tokenizer"],
        meta_path=meta_path,
    )
    itemsize = np.dtype(packed.dtype).itemsize
    for path, n in ((packed.train_path, packed.n_train_tokens), (packed.eval_path, packed.n_eval_tokens)):
        size = path.stat().st_size
        if size != n * itemsize:
            raise ValueError(f"{path} holds {size} bytes, {meta_path} says {n} tokens of {itemsize} bytes")
    sums = meta.get("files")
    if not isinstance(sums, dict):
        raise ValueError(f"{meta_path} has no checksums (written by an older partrain)")
    for path in (packed.train_path, packed.eval_path):
        expected = sums.get(path.name, {})
        if expected.get("size") != path.stat().st_size:
            raise ValueError(f"{path} holds {path.stat().st_size} bytes, {meta_path} says {expected.get('size')}")
        if verify and file_sha256(path) != expected.get("sha256"):
            raise ValueError(f"{path} does not match the SHA-256 in {meta_path} (changed since it was written)")
    return packed


def file_sha256(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def _check_numbers(cfg: DataConfig) -> None:
    if cfg.max_bytes < -1:
        raise ConfigError(
            Problem(
                key="data.max_bytes",
                value=cfg.max_bytes,
                rule="must be >= -1 (-1 = the default, 0 = read everything)",
                fix="data.max_bytes=0 or a positive byte count",
            )
        )
    if not 0.0 <= cfg.eval_fraction < 1.0:
        raise ConfigError(
            Problem(
                key="data.eval_fraction",
                value=cfg.eval_fraction,
                rule="must be in [0, 1)",
                fix="data.eval_fraction=0.02 (or 0 for no held-out split)",
            )
        )


def _build(corpus: Corpus, tokenizer: Tokenizer, eval_fraction: float, entry: Path, key: str) -> PackedData:
    """Build the entry in a private temporary folder beside it, then rename that into place whole."""
    created = [p for p in (entry.parent, *entry.parent.parents) if not p.exists()]
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(entry.parent)
    building = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.", suffix=".tmp"))
    try:
        _fill(corpus, tokenizer, eval_fraction, building, key)
        _publish(building, entry)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        for folder in created:  # a failed build leaves no folder it made (nearest first; kept if not empty)
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return open_packed(entry / META_NAME)


def _publish(building: Path, entry: Path) -> None:
    """Rename the finished `building` folder to `entry` (atomic). When `entry` is already there:
    a whole entry (another build won the race) is used and `building` dropped; a damaged one is
    moved aside and deleted first."""
    for _ in range(3):
        try:
            os.rename(building, entry)  # replaces an empty folder, fails on a non-empty one
            fsync_dir(entry.parent)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
        try:
            open_packed(entry / META_NAME, verify=True)
            log.info("another build finished %s first: using its entry", entry)
            shutil.rmtree(building, ignore_errors=True)
            return
        except (OSError, ValueError, KeyError):
            aside = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.damaged.", suffix=".tmp"))
            try:
                os.rename(entry, aside / entry.name)
            except FileNotFoundError:
                pass  # moved by another builder meanwhile
            shutil.rmtree(aside, ignore_errors=True)
    raise OSError(errno.EEXIST, f"could not put the new cache entry in place of {entry}")


def _fill(corpus: Corpus, tokenizer: Tokenizer, eval_fraction: float, folder: Path, key: str) -> None:
    """Tokenize the corpus into `folder`: train.bin, eval.bin, then meta.json (with their checksums)."""
    started = time.perf_counter()
    dtype = token_dtype(tokenizer.vocab_size)
    all_tmp = temp_path(folder / TRAIN_NAME)
    eval_tmp = temp_path(folder / EVAL_NAME)
    try:
        # One pass writes the whole stream; the eval tail is then copied out and cut off, so
        # the corpus is read once and never held in memory.
        with open(all_tmp, "wb") as out:
            n_total, n_docs = _write_stream(corpus.documents(), tokenizer, dtype, out)
        if isinstance(corpus, SplitCorpus):  # data.eval_split / eval_source: the eval set is a stream of its own
            with open(eval_tmp, "wb") as out:
                n_eval, _ = _write_stream(corpus.eval_documents(), tokenizer, dtype, out)
            n_train = n_total
        else:
            n_eval = int(round(n_total * eval_fraction))
            n_train = n_total - n_eval
            with open(all_tmp, "rb") as src, open(eval_tmp, "wb") as dst:
                src.seek(n_train * dtype.itemsize)
                shutil.copyfileobj(src, dst)
            with open(all_tmp, "r+b") as f:
                f.truncate(n_train * dtype.itemsize)
        commit(all_tmp, folder / TRAIN_NAME)
        commit(eval_tmp, folder / EVAL_NAME)
    except BaseException:
        all_tmp.unlink(missing_ok=True)
        eval_tmp.unlink(missing_ok=True)
        raise
    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "train_file": TRAIN_NAME,
        "eval_file": EVAL_NAME,
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "n_train_tokens": n_train,
        "n_eval_tokens": n_eval,
        "n_documents": n_docs,
        "tokenizer": tokenizer.name,
        "source": {
            "kind": corpus.kind,
            "root": str(corpus.root),
            "files": len(corpus.files),
            "text_field": corpus.text_field,
            "max_bytes": corpus.max_bytes,
        },
        "eval_fraction": eval_fraction,
        "files": {
            name: {"size": (folder / name).stat().st_size, "sha256": file_sha256(folder / name)}
            for name in (TRAIN_NAME, EVAL_NAME)
        },
    }
    fsync_dir(folder)  # the token files' renames must be durable before meta.json vouches for them
    write_json(folder / META_NAME, meta)
    fsync_dir(folder)
    log.info(
        "packed %d documents into %d train + %d eval tokens in %.1f s (%s)",
        n_docs,
        n_train,
        n_eval,
        time.perf_counter() - started,
        folder,
    )


def _remove_empty(folders: List[Path]) -> None:
    """Remove those of `folders` (deepest first) that are empty; stop at the first that is not."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return  # holds the finished entry (or another build's files), or is gone: keep the rest


def _remove_stale_temps(root: Path) -> None:
    """Delete the temporary folders (and files) killed builds left in the cache root (never trusted,
    but they take space). Only old ones: a recent one may belong to a build running right now."""
    cutoff = time.time() - _STALE_TEMP_S
    for path in root.glob(".*.tmp"):
        try:
            if path.stat().st_mtime < cutoff:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        except OSError:
            pass  # removed by another process meanwhile: fine


def _count_eval(corpus, tokenizer: Tokenizer) -> Optional[int]:
    """Tokens of a SplitCorpus's eval documents (read whole: eval sets are small), else None."""
    if not isinstance(corpus, SplitCorpus):
        return None
    n_eval = 0
    for batch in document_batches(corpus.eval_documents()):
        for ids in tokenizer.encode_batch(batch):
            check_ids(ids, tokenizer)
            n_eval += len(ids) + 1
    return n_eval


def _write_stream(documents: Iterable[str], tokenizer: Tokenizer, dtype: np.dtype, out) -> tuple:
    """Write ``doc eos doc eos ...`` to ``out``; returns (tokens written, documents)."""
    n_tokens = n_docs = 0
    for batch in document_batches(documents):
        for ids in tokenizer.encode_batch(batch):
            check_ids(ids, tokenizer)
            row = np.empty(len(ids) + 1, dtype=dtype)
            row[:-1] = ids
            row[-1] = tokenizer.eos_id
            out.write(row.tobytes())
            n_tokens += len(row)
            n_docs += 1
    return n_tokens, n_docs


def check_ids(ids: np.ndarray, tokenizer: Tokenizer) -> None:
    """Every id below the tokenizer's vocabulary: out-of-range ids would wrap silently in a narrow
    dtype (or index past the embedding) and train on garbage."""
    if len(ids) and (int(ids.max()) >= tokenizer.vocab_size or int(ids.min()) < 0):
        raise ValueError(f"tokenizer {tokenizer.name} produced an id outside [0, {tokenizer.vocab_size})")


def document_batches(documents: Iterable[str]) -> Iterator[List[str]]:
    """Documents grouped for batch encoding: up to _BATCH_DOCS documents or _BATCH_BYTES characters each."""
    batch: List[str] = []
    size = 0
    for doc in documents:
        batch.append(doc)
        size += len(doc)
        if len(batch) >= _BATCH_DOCS or size >= _BATCH_BYTES:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
