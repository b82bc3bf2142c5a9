"""How a Hugging Face Hub id reads (`gpt2`, `org/name`, `org/name@revision`), by its spelling alone.

Validation needs this without the Hub: a dry run or `plan` leaves a data.source that is a Hub
dataset missing from the local Hub cache unresolved (nothing is downloaded to plan a run), and such
a value is not a missing local path. `partrain.preflight.hub` resolves ids; this only reads them.
"""

from __future__ import annotations

import re

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?(@[A-Za-z0-9_./-]+)?$")
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
"""A value ending so names a local data file, never a Hub repo."""


def reads_as_hub_id(spec: str) -> bool:
    """Whether `spec` is spelled as a Hub id (whether or not a local path of that name exists)."""
    return bool(_ID.match(spec)) and ".." not in spec and not spec.endswith(LOCAL_SUFFIXES)
