"""The one error type a user sees for a bad config: key, value, rule broken and a fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List


@dataclass(frozen=True)
class Problem:
    key: str
    """Dotted config key at fault (e.g. parallel.tp)."""
    value: Any
    """The offending value as the user gave it."""
    rule: str
    """The rule it breaks, in plain words."""
    fix: str = ""
    """What to do instead (often the nearest valid values)."""

    @property
    def message(self) -> str:
        text = f"{self.key}={self.value!r}: {self.rule}"
        return f"{text}. Fix: {self.fix}" if self.fix else text

    def to_json(self) -> dict:
        value = (
            self.value if isinstance(self.value, (int, float, str, bool, type(None), list, dict)) else repr(self.value)
        )
        return {"key": self.key, "value": value, "rule": self.rule, "fix": self.fix, "message": self.message}


class ConfigError(Exception):
    """A config that cannot work. Carries every problem found; the CLI exits with code 2."""

    def __init__(self, problems: List[Problem] | Problem):
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        super().__init__("; ".join(p.message for p in self.problems))
