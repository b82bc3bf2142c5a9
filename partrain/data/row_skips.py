"""data.skip_bad_rows: malformed fine-tuning rows skipped and counted per rule instead of exit 2.

The examples reader (``partrain.data.examples``) renders every row; a row that breaks a rule raises
``ChatRowError`` (whose ``rule`` names it). Without skip_bad_rows that is a ConfigError naming the file,
line and rule; with it the row is left out and recorded here: the counts per rule, the first skipped
row's message (so the note says what to look at), and every skipped row's ordinal in data.source, so
an example's index can be mapped back to its file and line (``partrain.data.long_examples``). The
record is stored in the cache entry's meta.json ("skipped") and reported by the preflight's note and
the run summary. A source whose every row is bad is still exit 2: there would be nothing to train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List

from partrain.errors import ConfigError, Problem

SKIP_FIX = "or set data.skip_bad_rows=true to skip such rows (counted per rule in the run summary)"
"""Appended to a bad row's fix: the other way out."""


@dataclass
class SkippedRows:
    """The rows left out so far: counts per rule, their ordinals in data.source, the first one's message."""

    counts: Dict[str, int] = field(default_factory=dict)
    ordinals: List[int] = field(default_factory=list)
    first: str = ""

    def add(self, ordinal: int, rule: str, message: str) -> None:
        self.counts[rule] = self.counts.get(rule, 0) + 1
        self.ordinals.append(ordinal)
        self.first = self.first or message

    @property
    def total(self) -> int:
        return len(self.ordinals)

    def to_json(self) -> dict:
        """meta.json's "skipped" ({} when nothing was skipped, so clean entries stay as they were)."""
        if not self.ordinals:
            return {}
        return {"counts": dict(sorted(self.counts.items())), "rows": list(self.ordinals), "first": self.first}


def skipped_text(skipped: dict) -> str:
    """'3 malformed rows skipped (no_assistant_turn 2, unknown_role 1); the first: <message>'."""
    counts = skipped.get("counts") or {}
    total = sum(counts.values())
    per_rule = ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items()))
    return f"{total} malformed row{'s' if total != 1 else ''} skipped ({per_rule}); the first: {skipped.get('first')}"


def every_row_bad(source: str, skipped: SkippedRows) -> ConfigError:
    """data.skip_bad_rows left no example at all: exit 2 (training on nothing is not a run)."""
    return ConfigError(
        Problem(
            "data.source",
            source,
            f"every row is malformed: {skipped_text(skipped.to_json())}",
            "fix the rows (the first one is named above), or point data.source at the right file",
        )
    )


def skipped_ordinal(example: int, skipped_rows: List[int]) -> int:
    """The ordinal in data.source of example ``example`` (examples are the rows not skipped, in order)."""
    ordinal = example
    for row in sorted(skipped_rows):
        if row > ordinal:
            break
        ordinal += 1
    return ordinal
