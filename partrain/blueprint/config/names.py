"""The nearest valid name to a mistyped one, for the "did you mean" of config errors."""

from __future__ import annotations

import difflib
from typing import Iterable, Optional


def nearest_name(value, names: Iterable) -> Optional[str]:
    """The same letters in another case first (`1F1B` -> 1f1b, `GPT-DP` -> gpt-dp), then the closest
    spelling of the lower-cased value; None when nothing is close."""
    names = [str(n) for n in names]
    text = str(value)
    same = [n for n in names if n.lower() == text.lower()]
    if same:
        return same[0]
    close = difflib.get_close_matches(text.lower(), names, n=1) or difflib.get_close_matches(text, names, n=1)
    return close[0] if close else None
