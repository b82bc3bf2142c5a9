"""Readers that turn one local file into a stream of documents (strings).

One reader per format, chosen by the file suffix:

- ``.txt`` (and ``.py``, which the builtin corpus reads): the whole file is one document.
  Paragraphs are not split, because blank lines inside prose or code are not document boundaries;
  put documents in separate files (a folder source) or use jsonl when they are.
- ``.jsonl``: one JSON object per line; the document is the string under ``text_field``.
  Blank lines are skipped.
- ``.parquet``: the string column ``text_field``; needs pyarrow, imported only here.

Readers stream (jsonl line by line, parquet batch by batch), so a large file never has to fit
in memory; ``limit`` lets the txt reader stop early when only a prefix is wanted. Every
failure is a ConfigError naming the file, because a bad data file is a bad ``data.source``.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional, Tuple

from partrain.errors import ConfigError, Problem

SUFFIXES = (".txt", ".jsonl", ".parquet")
"""File suffixes a local data source may have (a folder source reads the files with these)."""


def read_documents(path: Path, text_field: str, limit: Optional[int] = None, errors: str = "strict") -> Iterator[str]:
    """Documents of one file, in file order.

    ``limit``: the caller needs at most about this many UTF-8 bytes (a hint; None = all).
    ``errors``: how undecodable bytes are treated; "strict" makes them a ConfigError.
    """
    suffix = path.suffix.lower()
    if suffix in (".txt", ".py"):
        return _read_txt(path, limit, errors)
    if suffix == ".jsonl":
        return _read_jsonl(path, text_field)
    if suffix == ".parquet":
        return _read_parquet(path, text_field)
    raise source_error(
        path,
        f"unsupported file type {suffix or '(none)'}; supported: {', '.join(SUFFIXES)}",
        "convert the data to .txt, .jsonl or .parquet",
    )


def source_error(path: Path, rule: str, fix: str = "") -> ConfigError:
    """The ConfigError for a problem with a data file."""
    return ConfigError(Problem(key="data.source", value=str(path), rule=rule, fix=fix))


def _read_txt(path: Path, limit: Optional[int], errors: str) -> Iterator[str]:
    try:
        with open(path, "rb") as f:
            # A few bytes over the limit, so a character cut by the limit is still whole; the
            # caller clips the text to exactly `limit` bytes.
            data = f.read() if limit is None else f.read(limit + 4)
            complete = limit is None or len(data) <= limit
    except OSError as exc:
        raise source_error(path, f"cannot read the file: {exc}", "check the path and its permissions") from exc
    # utf-8-sig drops a leading byte-order mark; final=complete keeps a character cut at the
    # end of a partial read out of the text instead of failing on it.
    decoder = codecs.getincrementaldecoder("utf-8-sig")(errors=errors)
    try:
        text = decoder.decode(data, final=complete)
    except UnicodeDecodeError as exc:
        raise source_error(path, f"is not valid UTF-8 (byte {exc.start})", "re-encode the file as UTF-8") from exc
    yield text


@dataclass(frozen=True)
class InvalidJsonLine:
    """A .jsonl line that does not parse, passed on as a row when the caller skips bad rows
    (data.skip_bad_rows): the renderer refuses it like any other bad row, counted under its rule."""

    message: str


def read_rows(path: Path, keep_invalid_json: bool = False) -> Iterator[Tuple[str, object]]:
    """(where, record) of every row of a .jsonl or .parquet file, in file order: where is "line N"
    (jsonl, 1-based, blank lines skipped) or "row N" (parquet). For fine-tuning rows, whose fields the
    caller reads (partrain.data.examples). A line that is not JSON is an error, or with
    keep_invalid_json an InvalidJsonLine record."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_records(path, keep_invalid_json)
    if suffix == ".parquet":
        return _parquet_records(path)
    raise source_error(
        path,
        f"fine-tuning rows are read from .jsonl or .parquet files, not {suffix or '(none)'}",
        "convert the data to .jsonl (one JSON object per line) or .parquet",
    )


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    for where, record in _jsonl_records(path):
        yield _text_of(record, path, text_field, where)


def _jsonl_records(path: Path, keep_invalid_json: bool = False) -> Iterator[Tuple[str, object]]:
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise source_error(path, f"cannot read the file: {exc}", "check the path and its permissions") from exc
    with f:
        lineno = 0
        try:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                    if keep_invalid_json:
                        yield f"line {lineno}", InvalidJsonLine(f"not valid JSON: {exc}")
                        continue
                    raise source_error(
                        path,
                        f"line {lineno} is not valid JSON: {exc}",
                        "write one JSON object per line (JSON Lines), or set data.skip_bad_rows=true to skip "
                        "such lines (counted per rule in the run summary)",
                    ) from exc
                yield f"line {lineno}", record
        except OSError as exc:  # e.g. a network filesystem dropping out mid-file
            raise source_error(
                path, f"reading failed after line {lineno}: {exc}", "check the file and its storage"
            ) from exc


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise source_error(
            path,
            "reading a .parquet file needs the pyarrow package, which is not installed",
            "pip install pyarrow",
        ) from exc
    try:
        return pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise source_error(
            path, f"cannot read the parquet file: {exc}", "check that the file is a complete parquet file"
        ) from exc


def _parquet_records(path: Path) -> Iterator[Tuple[str, object]]:
    row = 0
    for batch in _parquet_file(path).iter_batches(batch_size=1024):
        for record in batch.to_pylist():
            row += 1
            yield f"row {row}", record


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    parquet = _parquet_file(path)
    if text_field not in parquet.schema_arrow.names:
        raise _field_error(
            path, text_field, f"the parquet file has no column {text_field!r} (columns: {parquet.schema_arrow.names})"
        )
    row = 0
    for batch in parquet.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            if value is not None:  # null cells are missing documents, not errors
                yield _text_of({text_field: value}, path, text_field, f"row {row}")


def _text_of(record: object, path: Path, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise _field_error(
            path, text_field, f"{where} has no field {text_field!r} (a {type(record).__name__}, not an object)"
        )
    if text_field not in record:  # the fields present: the one meant is usually among them
        raise _field_error(path, text_field, f"{where} has no field {text_field!r} (fields: {list(record)})")
    text = record[text_field]
    if not isinstance(text, str):
        raise _field_error(path, text_field, f"{where}: field {text_field!r} is a {type(text).__name__}, not a string")
    return text


def _field_error(path: Path, text_field: str, rule: str) -> ConfigError:
    return ConfigError(
        Problem(
            key="data.text_field",
            value=text_field,
            rule=f"{path}: {rule}",
            fix="set data.text_field to the field that holds the text; fine-tuning rows are read with data.format="
            "chat ('messages'), sharegpt ('conversations' of from/value), alpaca ('instruction', 'input', "
            "'output'), prompt_completion ('prompt', 'completion') or tokenized ('input_ids'); turns under other "
            "names: data.format=chat with data.messages_field, data.role_field, data.content_field and "
            "data.roles (docs/data-formats.md)",
        )
    )


def capped(texts: Iterable[str], max_bytes: Optional[int]) -> Iterator[str]:
    """The texts in order until `max_bytes` UTF-8 bytes (None or 0 = all of them): the text that
    reaches the cap is cut there and is the last ("ignore" drops only a character split by the cut)."""
    remaining = max_bytes or None
    for text in texts:
        if remaining is not None:
            data = text.encode("utf-8")
            if len(data) >= remaining:
                text = data[:remaining].decode("utf-8", errors="ignore")
                if text:
                    yield text
                return
            remaining -= len(data)
        yield text
