"""Fine-tuning rows rendered once into an examples cache that every worker can memory-map.

Rows (chat, prompt_completion or tokenized; ``data.format``, auto = the first row's fields) are read
with the readers of ``formats`` (.jsonl lines, .parquet rows) or ``hf_dataset`` (a `datasets` folder),
rendered by ``chat`` into (input_ids, labels) and written as one entry::

    <cache root>/<source>-examples-<key>/
        ids.bin      every example's ids, one after the other (uint16 or uint32, little-endian)
        labels.bin   their aligned labels (int32; -100 = no loss), unshifted as Hugging Face aligns them
        offsets.bin  int64 [examples + 1]: example i is ids[offsets[i]:offsets[i+1]]
        meta.json    counts, tokenizer, pad id, each file's size and SHA-256; written last

The last ``data.eval_fraction`` of the examples (row order) are held out for evaluation, unless
data.eval_split / data.eval_source name an eval set of its own: its rows are rendered after the training
rows (``_split_examples``, partrain.data.eval_source). The key hashes
the source identity, the tokenizer, format, templates and train_on, so any change renders again. The
entry is built in a temporary folder and renamed into place whole, and trusted only when its files match
meta.json, as ``packing`` does for token caches.

A bad row is a ConfigError naming the file, the line (or row) and the rule it breaks: the launch's
preflight renders every row here (``prepare_examples``) and the dry run with the same code in memory
(``probe_examples``), so both refuse the same rows before any process starts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Tuple

import numpy as np

from partrain.blueprint.config.schema import DataConfig
from partrain.blueprint.validate_data_format import CHAT_FORMATS, EXAMPLE_FORMATS, packing_problem, uses_template
from partrain.blueprint.validate_data_format import PAIRED_FORMATS as PAIRED
from partrain.data.atomic import fsync_dir, write_json
from partrain.data.builtin_chat import BuiltinChat
from partrain.data.chat import (
    IGNORE_INDEX,
    ChatRenderer,
    ChatRowError,
    Example,
    detect_format,
    resolve_template,
    tokenized_example,
)
from partrain.data.chat_labels import chat_example, prompt_completion_example
from partrain.data.corpus import BUILTIN, Corpus
from partrain.data.eval_source import eval_config, with_eval_source
from partrain.data.formats import InvalidJsonLine, read_rows
from partrain.data.hf_dataset import DatasetCorpus
from partrain.data.packing import (
    _publish,
    _remove_stale_temps,
    build_entry,
    cache_root_for,
    file_sha256,
    reopen_entry,
    token_dtype,
)
from partrain.data.preference_rows import has_template, preference_pair
from partrain.data.row_layouts import RowMapping, messages_of
from partrain.data.row_skips import SKIP_FIX, SkippedRows, every_row_bad
from partrain.data.tokenizer import load_tokenizer, tokenizer_name
from partrain.errors import ConfigError, Problem

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""Bumped whenever the entry's layout or the rendering rules change, so old entries are not reused
(2: ids from the whole rendering, labels from its trained spans: partrain.data.chat_labels)."""
KIND = "examples"
"""meta.json's "kind": tells a worker this entry holds examples, not a packed token stream."""
META_NAME = "meta.json"
FILES = ("ids.bin", "labels.bin", "offsets.bin")
LABEL_DTYPE = np.dtype("<i4")
OFFSET_DTYPE = np.dtype("<i8")


@dataclass(frozen=True)
class Examples:
    """Rendered examples: flat ids and labels and each example's offsets (memory-mapped or in memory)."""

    ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    """int64 [n_examples + 1]."""
    n_train: int
    """Examples 0..n_train-1 train; the rest are the eval split."""
    vocab_size: int
    pad_id: int
    """Fills the rows after an example's end (never trained: its labels are -100)."""
    tokenizer: str
    meta_path: Path
    """Where the entry's meta.json is (or would be, for a dry run's examples)."""
    skipped: dict = field(default_factory=dict)
    """data.skip_bad_rows: the rows left out (partrain.data.row_skips.SkippedRows.to_json; {} = none)."""
    rendering: dict = field(default_factory=dict)
    """Config key -> digest of the value the rows were rendered with (``rendering_identity``); {} for an
    entry written before it was recorded, which a resume then cannot check."""
    labelling: dict = field(default_factory=dict)
    """Chat rows per labelling method (partrain.data.chat_labels.LABELLING_METHODS): how the template's
    assistant text was found; {} for rows that are not chats."""
    paired: bool = False
    """Preference rows: examples 2k and 2k+1 are one row's chosen and rejected answers (data.format=preference)."""

    @property
    def n_examples(self) -> int:
        return len(self.offsets) - 1


def row_source(cfg: DataConfig) -> Iterator[Tuple[str, str, Any]]:
    """(file, where, row) of every row of data.source, in order."""
    corpus = Corpus.from_config(cfg)
    if isinstance(corpus, (DatasetCorpus, BuiltinChat)):
        for where, row in corpus.rows():
            yield str(corpus.root), where, row
        return
    for path in corpus.files:
        for where, row in read_rows(path, keep_invalid_json=cfg.skip_bad_rows):
            yield str(path), where, row


def resolve_format(cfg: DataConfig) -> str:
    """data.format, with auto resolved from the first row's fields; a ConfigError naming data.packing
    when the resolved format and data.packing do not go together."""
    fmt = cfg.format
    if fmt == "auto":
        if cfg.source == BUILTIN:
            return "text"
        first = next(iter(_first_row(cfg)), None)
        fmt = detect_format(first[2]) if first is not None else "text"
        if first is not None and cfg.messages_field and isinstance(first[2], dict) and cfg.messages_field in first[2]:
            fmt = "chat"  # the field data.messages_field names holds the turns
    problem = packing_problem(fmt, cfg.packing)
    if problem is not None:
        raise ConfigError(Problem("data.packing", cfg.packing, f"{problem[0]} (data.format=auto read it)", problem[1]))
    return fmt


def _first_row(cfg: DataConfig):
    try:
        rows = (r for r in row_source(cfg) if not isinstance(r[2], InvalidJsonLine))
        return [next(rows)]
    except StopIteration:
        return []
    except ConfigError:
        return []  # not rows (e.g. .txt files): text, whose own readers report problems


def uses_examples(cfg: DataConfig) -> bool:
    """Whether data.source is read as fine-tuning examples rather than packed text."""
    return not cfg.streaming and resolve_format(cfg) in EXAMPLE_FORMATS


def _renderer(cfg: DataConfig, fmt: str, tokenizer) -> Callable[[Any], Example]:
    """row -> Example for this format; ChatRowError for a row that breaks a rule."""
    template = None
    # Preference rows may be text or conversations: only a conversation needs a template (preference_pair).
    if uses_template(fmt, cfg.chat_template) or (fmt == "preference" and has_template(cfg, tokenizer)):
        try:
            text = resolve_template(cfg.chat_template, getattr(tokenizer, "chat_template", None))
            template = ChatRenderer(text, tokenizer.bos_token, tokenizer.eos_token)
        except ChatRowError as exc:
            raise ConfigError(
                Problem(
                    "data.chat_template",
                    cfg.chat_template,
                    str(exc),
                    "data.chat_template=chatml (or llama3, zephyr, or a Jinja file)",
                )
            ) from None

    mapping = RowMapping.from_config(cfg)

    def render(row: Any) -> Example:
        if isinstance(row, InvalidJsonLine):
            raise ChatRowError(row.message, "invalid_json")
        if not isinstance(row, dict):
            raise ChatRowError(f"the row is a {type(row).__name__}, not an object", "not_an_object")
        if fmt == "chat" and mapping.is_default:
            if "messages" not in row:
                raise ChatRowError(
                    f"the row has no 'messages' field (fields: {list(row)}){_layout_hint(row, fmt)}", "missing_field"
                )
            messages = row["messages"]
        elif fmt in CHAT_FORMATS:
            messages = messages_of(row, fmt, mapping)
        if fmt in CHAT_FORMATS:
            return chat_example(template, tokenizer, messages, cfg.train_on, row.get("tools"), cfg.train_on_eos)
        if fmt == "preference":
            return preference_pair(row, tokenizer, template, cfg)
        if fmt == "prompt_completion":
            missing = [k for k in ("prompt", "completion") if k not in row]
            if missing:
                raise ChatRowError(
                    f"the row has no {' or '.join(repr(k) for k in missing)} (fields: {list(row)})"
                    + _layout_hint(row, fmt),
                    "missing_field",
                )
            return prompt_completion_example(
                tokenizer,
                row["prompt"],
                row["completion"],
                template,
                cfg.prompt_template,
                cfg.train_on,
                cfg.train_on_eos,
            )
        return tokenized_example(row, tokenizer.vocab_size)

    return render


def _layout_hint(row: dict, fmt: str) -> str:
    """ "; it reads as sharegpt rows: set data.format=sharegpt (or auto)" when the row's fields are another
    layout's, else ""."""
    other = detect_format(row)
    return f"; it reads as {other} rows: set data.format={other} (or auto)" if other not in ("text", fmt) else ""


def _examples(cfg: DataConfig, fmt: str, tokenizer, skipped: SkippedRows) -> Iterator[Example]:
    """Every row's example; a bad row is a ConfigError naming file, line and rule, or with
    data.skip_bad_rows left out and recorded in ``skipped`` (every row bad is still an error)."""
    render = _renderer(cfg, fmt, tokenizer)
    made = 0
    for ordinal, (path, where, row) in enumerate(row_source(cfg)):
        try:
            rendered = render(row)
            pair = rendered if isinstance(rendered, tuple) else (rendered,)  # a preference row: two examples
            if any(example.trained_tokens == 0 for example in pair):
                raise ChatRowError("no token of this row is trained", "no_trained_token")
        except ChatRowError as exc:
            message = f"{path} {where}: {exc} (rule {exc.rule})"
            if not cfg.skip_bad_rows:
                fix = f"fix or remove {where} of {Path(path).name} (data.format={fmt}), {SKIP_FIX}"
                raise ConfigError(Problem("data.source", path, message, fix)) from None
            skipped.add(ordinal, exc.rule, message)
            continue
        made += 1
        yield from pair
    if made == 0 and skipped.total:
        raise every_row_bad(cfg.source, skipped)


def rendering(cfg: DataConfig, fmt: str) -> dict:
    """What turns a row into an example's tokens and labels besides the tokenizer: the format, the
    templates (a template file by its text, not just its name) and data.train_on. The examples cache
    key and a streamed run's data identity (partrain.data.stream_facts) both cover it."""
    template = cfg.chat_template
    if template and Path(template).expanduser().is_file():
        template = Path(template).expanduser().read_text()
    return {
        "data_format": fmt,
        "chat_template": template,
        "prompt_template": cfg.prompt_template,
        "train_on": cfg.train_on,
        "train_on_eos": cfg.train_on_eos,
        "messages_field": cfg.messages_field,
        "role_field": cfg.role_field,
        "content_field": cfg.content_field,
        "roles": dict(cfg.roles),
    }


RENDERING_COVERS = (
    "data.format, data.chat_template (a file by its text), data.prompt_template, data.train_on, "
    "data.tokenizer and data.long_examples"
)
"""What a cached run's recorded rendering identity covers, in the words of a resume's refusal."""


def identity_digest(value: Any) -> str:
    """A short digest of one setting's value: the identity records digests, so a template's text is not
    copied into every checkpoint."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def rendering_identity(cfg: DataConfig, fmt: str, tokenizer: str) -> dict:
    """Config key -> digest of its value, for everything that labels an example's tokens (``rendering``
    and the tokenizer's identity). Per key, so a resume's refusal names the setting that changed; not the
    source files' paths or times, so an entry copied to another machine still resumes."""
    keys = {"data_format": "data.format"}  # rendering's own names for keys that differ from the config's
    values = {keys.get(name, f"data.{name}"): value for name, value in rendering(cfg, fmt).items()}
    values["data.tokenizer"] = tokenizer
    return {key: identity_digest(value) for key, value in values.items()}


def batch_identity(examples: Examples, long_examples: str, n_long: int) -> dict:
    """What a data position of these examples records and checks on resume: the entry's rendering
    identity and data.long_examples as it acts (skip only changes the rows when some example is longer
    than a row; error and truncate cut the same rows). {} when the entry did not record its rendering."""
    if not examples.rendering:
        return {}
    mode = "skip" if long_examples == "skip" and n_long else "truncate"
    return {**examples.rendering, "data.long_examples": identity_digest(mode)}


def cache_key(cfg: DataConfig, fmt: str) -> str:
    """A hash of everything the rendered examples depend on."""
    corpus = with_eval_source(cfg, Corpus.from_config(cfg))  # the eval set's rows too, when it has its own
    inputs = {
        "format": FORMAT_VERSION,
        "source": corpus.identity(),
        "tokenizer": tokenizer_name(cfg.tokenizer),
        **rendering(cfg, fmt),
        "eval_fraction": float(cfg.eval_fraction),
    }
    if cfg.skip_bad_rows:  # only when set, so the entries of clean runs keep their keys
        inputs["skip_bad_rows"] = True
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def _entry(cfg: DataConfig, cache_root: Optional[Path]) -> Tuple[str, Path]:
    fmt = resolve_format(cfg)
    corpus = Corpus.from_config(cfg)
    return fmt, cache_root_for(cfg, cache_root) / f"{corpus.slug}-examples-{cache_key(cfg, fmt)[:16]}"


def prepare_examples(cfg: DataConfig, cache_root: Optional[Path] = None) -> Examples:
    """Render data.source's rows into the cache, or reuse the entry there (checked against its SHA-256)."""
    fmt, folder = _entry(cfg, cache_root)
    examples = reopen_entry(folder, open_examples, "examples cache")
    if examples is not None:
        return examples
    tokenizer = load_tokenizer(cfg.tokenizer)
    return build_entry(folder, lambda: _build(cfg, fmt, tokenizer, folder), "examples cache")


def probe_examples(cfg: DataConfig, cache_root: Optional[Path] = None) -> Examples:
    """What ``prepare_examples`` would return, rendered in memory and written nowhere (the dry run):
    every row is rendered, so the dry run refuses exactly the rows the launch refuses."""
    fmt, folder = _entry(cfg, cache_root)
    meta_path = folder / META_NAME
    if meta_path.exists():
        try:
            return open_examples(meta_path)
        except (OSError, ValueError, KeyError):
            pass  # damaged: prepare_examples rebuilds it; render as if it were not there
    tokenizer = load_tokenizer(cfg.tokenizer)
    ids, labels, lengths = [], [], [0]
    skipped = SkippedRows()
    split = {}
    for example in _split_examples(cfg, fmt, tokenizer, skipped, split):
        ids += example.input_ids
        labels += example.labels
        lengths.append(len(example.input_ids))
    offsets = np.cumsum(np.asarray(lengths, dtype=np.int64))
    return Examples(
        ids=np.asarray(ids, dtype=token_dtype(tokenizer.vocab_size)),
        labels=np.asarray(labels, dtype=LABEL_DTYPE),
        offsets=offsets,
        n_train=split["n_train"],
        vocab_size=tokenizer.vocab_size,
        pad_id=tokenizer.eos_id,
        tokenizer=tokenizer.name,
        meta_path=meta_path,
        skipped=skipped.to_json(),
        rendering=rendering_identity(cfg, fmt, tokenizer.name),
        labelling=dict(split.get("labelling", {})),
        paired=fmt in PAIRED,
    )


def _split_examples(cfg: DataConfig, fmt: str, tokenizer, skipped: SkippedRows, split: dict) -> Iterator[Example]:
    """The training rows' examples, then those of the eval set when data.eval_split / data.eval_source
    names one (partrain.data.eval_source); at the end split["n_train"] is the training examples' count
    (without an eval set of its own, all but the held-out last data.eval_fraction)."""
    n = 0
    methods = split.setdefault("labelling", Counter())  # chat rows per labelling method (the dry run says)
    for example in _examples(cfg, fmt, tokenizer, skipped):
        n += 1
        methods.update([example.method] if example.method else [])
        yield example
    held = eval_config(cfg)
    if held is None:
        split["n_train"] = _n_train(n, cfg.eval_fraction, 2 if fmt in PAIRED else 1)
        return
    split["n_train"] = n
    for example in _examples(held, fmt, tokenizer, skipped):
        methods.update([example.method] if example.method else [])
        yield example


def _n_train(n_examples: int, eval_fraction: float, per_row: int = 1) -> int:
    """Training examples of n_examples: all but the last eval_fraction, held out whole rows at a time
    (per_row examples a row: a preference row's pair is never split between training and eval)."""
    rows = n_examples // per_row
    return (rows - int(round(rows * eval_fraction))) * per_row


def open_examples(meta_path, verify: bool = False) -> Examples:
    """Reopen an entry from its meta.json (memory-mapped); ValueError when its files do not match it
    (sizes always, SHA-256 with ``verify``)."""
    meta_path = Path(meta_path)
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("kind") != KIND or meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{meta_path} is not an examples entry of format {FORMAT_VERSION}")
    folder = meta_path.parent
    for name in FILES:
        expected = meta["files"][name]
        size = (folder / name).stat().st_size
        if size != expected["size"]:
            raise ValueError(f"{folder / name} holds {size} bytes, {meta_path} says {expected['size']}")
        if verify and file_sha256(folder / name) != expected["sha256"]:
            raise ValueError(f"{folder / name} does not match the SHA-256 in {meta_path}")
    return Examples(
        ids=_map(folder / "ids.bin", np.dtype(meta["dtype"])),
        labels=_map(folder / "labels.bin", LABEL_DTYPE),
        offsets=np.array(_map(folder / "offsets.bin", OFFSET_DTYPE)),
        n_train=int(meta["n_train_examples"]),
        vocab_size=int(meta["vocab_size"]),
        pad_id=int(meta["pad_id"]),
        tokenizer=meta["tokenizer"],
        meta_path=meta_path,
        skipped=meta.get("skipped") or {},
        rendering=meta.get("rendering") or {},
        labelling=meta.get("labelling") or {},
        paired=meta.get("data_format") in PAIRED,
    )


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=dtype)  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dtype, mode="r")


def _build(cfg: DataConfig, fmt: str, tokenizer, entry: Path) -> Examples:
    """Render into a private temporary folder beside the entry, then rename that into place whole."""
    started = time.perf_counter()
    entry.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(entry.parent)
    building = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.", suffix=".tmp"))
    try:
        dtype = token_dtype(tokenizer.vocab_size)
        n_tokens, offsets = 0, [0]
        skipped = SkippedRows()
        with open(building / "ids.bin", "wb") as ids, open(building / "labels.bin", "wb") as labels:
            split = {}
            for example in _split_examples(cfg, fmt, tokenizer, skipped, split):
                ids.write(np.asarray(example.input_ids, dtype=dtype).tobytes())
                labels.write(np.asarray(example.labels, dtype=LABEL_DTYPE).tobytes())
                n_tokens += len(example.input_ids)
                offsets.append(n_tokens)
        (building / "offsets.bin").write_bytes(np.asarray(offsets, dtype=OFFSET_DTYPE).tobytes())
        meta = {
            "kind": KIND,
            "format": FORMAT_VERSION,
            "data_format": fmt,
            "dtype": dtype.name,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
            "pad_id": tokenizer.eos_id,
            "tokenizer": tokenizer.name,
            "n_examples": len(offsets) - 1,
            "n_train_examples": split["n_train"],
            "n_tokens": n_tokens,
            "train_on": cfg.train_on,
            "skipped": skipped.to_json(),
            "rendering": rendering_identity(cfg, fmt, tokenizer.name),
            "labelling": dict(split["labelling"]),
            "files": {
                name: {"size": (building / name).stat().st_size, "sha256": file_sha256(building / name)}
                for name in FILES
            },
        }
        fsync_dir(building)
        write_json(building / META_NAME, meta)
        _publish(building, entry)
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
    log.info(
        "rendered %d %s examples (%d tokens) in %.1f s (%s)",
        len(offsets) - 1,
        fmt,
        n_tokens,
        time.perf_counter() - started,
        entry,
    )
    return open_examples(entry / META_NAME)


def example_label_counts(examples: Examples, first: int, stop: int, seq_len: int) -> np.ndarray:
    """Trained tokens of examples first..stop-1 as rows of seq_len see them: the shifted labels
    (labels[1:]) of the first seq_len + 1 tokens, so a truncated example counts only what stays."""
    starts = examples.offsets[first:stop]
    lengths = examples.offsets[first + 1 : stop + 1] - starts
    trained = np.concatenate([[0], np.cumsum(np.asarray(examples.labels) != IGNORE_INDEX, dtype=np.int64)])
    ends = starts + np.minimum(lengths, seq_len + 1)
    return trained[ends] - trained[np.minimum(starts + 1, ends)]
