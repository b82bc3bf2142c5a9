"""Collect every problem of a config before reporting (one ConfigError lists them all)."""

from __future__ import annotations

from typing import List

from partrain.errors import Problem


class ProblemCollector:
    def __init__(self) -> None:
        self.problems: List[Problem] = []

    def add(self, key: str, value, rule: str, fix: str = "") -> None:
        self.problems.append(Problem(key, value, rule, fix))

    def check(self, ok: bool, key: str, value, rule: str, fix: str = "") -> bool:
        if not ok:
            self.add(key, value, rule, fix)
        return ok
