"""Small modules with one job (issue 40): no module of partrain/ over 500 lines, no function over 80.

A failure names each module and function past its limit, with its length, so the split is the fix."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "partrain"
MODULE_LINES = 500
FUNCTION_LINES = 80


def _sources():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_is_over_500_lines():
    long = []
    for path in _sources():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MODULE_LINES:
            long.append(f"{path.relative_to(PACKAGE.parent)}: {lines} lines")
    assert not long, f"modules over {MODULE_LINES} lines (split them by job): " + "; ".join(long)


def test_no_function_is_over_80_lines():
    long = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1  # from `def` to its last line, docstring included
                if lines > FUNCTION_LINES:
                    long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {FUNCTION_LINES} lines (split them): " + "; ".join(long)
