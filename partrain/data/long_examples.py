"""data.long_examples: what becomes of a fine-tuning example longer than one row, and the row report.

A row of train.seq_len inputs holds an example of up to seq_len + 1 tokens (the inputs are its tokens
but the last, the targets the same shifted by one). A longer example is, by data.long_examples:
error (the default: exit 2 before any process, naming the file, line, length and limit), truncate (cut
to the row, the cut tokens take no loss) or skip (left out). truncate and skip are counted; the batches
(partrain.data.example_batches) apply them. data.skip_bad_rows does not change this: a long example is
not malformed, and silently cutting answers short is a choice the user makes here.

The examples cache does not depend on seq_len, so the check runs on the rendered examples (their
offsets), and an example's file and line are found again by reading the rows up to it (only on the
way to an exit 2). ``row_facts`` is what the preflight's note and the run summary report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np

from partrain.blueprint.config.schema import DataConfig
from partrain.data.examples import KIND, Examples, open_examples, row_source
from partrain.data.row_skips import skipped_ordinal, skipped_text
from partrain.errors import Problem

LONG_FIX = "set data.long_examples=truncate (or skip), or raise train.seq_len"


def row_limit(seq_len: int) -> int:
    """Tokens one padded row holds: seq_len inputs plus the last target."""
    return seq_len + 1


def long_indices(examples: Examples, seq_len: int) -> np.ndarray:
    """Indices of the examples longer than a row."""
    lengths = np.diff(np.asarray(examples.offsets))
    return np.nonzero(lengths > row_limit(seq_len))[0]


def example_where(cfg: DataConfig, examples: Examples, index: int) -> Tuple[str, str]:
    """(file, 'line N') of example ``index``: the rows are read again (not rendered) up to it."""
    ordinal = skipped_ordinal(index, (examples.skipped or {}).get("rows", []))
    for i, (path, where, _) in enumerate(row_source(cfg)):
        if i == ordinal:
            return path, where
    return cfg.source, f"example {index}"  # the source changed since it was rendered


def long_example_problems(cfg: DataConfig, examples: Examples, seq_len: int) -> List[Problem]:
    """data.long_examples=error: one problem naming the first over-long example's file, line and length."""
    if cfg.long_examples != "error":
        return []
    long = long_indices(examples, seq_len)
    if not len(long):
        return []
    first = int(long[0])
    path, where = example_where(cfg, examples, first)
    length = int(examples.offsets[first + 1] - examples.offsets[first])
    more = f"; {len(long) - 1} more examples are too" if len(long) > 1 else ""
    return [
        Problem(
            "data.long_examples",
            cfg.long_examples,
            f"{path} {where}: the example is {length} tokens, longer than the {row_limit(seq_len)} a row holds "
            f"(train.seq_len={seq_len} inputs plus the last target){more}",
            LONG_FIX,
        )
    ]


def row_facts(cfg: DataConfig, examples: Examples, seq_len: int) -> dict:
    """{"skipped_rows": {rule: count}, "long_examples": {"mode", "count"}}, each only when not empty."""
    facts = {}
    if examples.skipped:
        facts["skipped_rows"] = dict(examples.skipped.get("counts") or {})
    long = len(long_indices(examples, seq_len))
    if long and cfg.long_examples != "error":
        facts["long_examples"] = {"mode": cfg.long_examples, "count": long}
    return facts


def row_note(cfg: DataConfig, examples: Examples, seq_len: int) -> Optional[str]:
    """One line for the preflight (launch and dry run) when rows were skipped or examples cut; else None."""
    parts = []
    if examples.skipped:
        parts.append(f"data.skip_bad_rows: {skipped_text(examples.skipped)}")
    long = row_facts(cfg, examples, seq_len).get("long_examples")
    if long:
        done = "truncated to" if long["mode"] == "truncate" else "skipped, longer than"
        parts.append(f"data.long_examples={long['mode']}: {long['count']} examples {done} {row_limit(seq_len)} tokens")
    return "; ".join(parts) or None


def run_row_facts(meta_path, cfg: DataConfig, seq_len: int) -> dict:
    """The run summary's "data_rows" for the examples entry at ``meta_path`` ({} for packed text)."""
    try:
        if json.loads(Path(meta_path).read_text(encoding="utf-8")).get("kind") != KIND:
            return {}
        facts = row_facts(cfg, open_examples(meta_path), seq_len)
    except (OSError, ValueError, KeyError):
        return {}  # the summary goes on without it; the workers already read this entry
    return {"data_rows": facts} if facts else {}
