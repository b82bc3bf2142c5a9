"""Field documentation of the schema, read from the attribute docstrings in schema.py."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from typing import Dict, List


def field_docs(cls) -> Dict[str, str]:
    """{field name: docstring} from the string literal that follows each annotated field."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: Dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def explain_rows(run, prefix: str = "") -> List[dict]:
    """One row per config key (dataclasses are walked, so every leaf of the schema appears)."""
    rows = []
    docs = field_docs(type(run))
    for f in dataclasses.fields(run):
        value = getattr(run, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(explain_rows(value, f"{prefix}{f.name}."))
        else:
            rows.append({"key": f"{prefix}{f.name}", "type": str(f.type), "value": value, "doc": docs.get(f.name, "")})
    return rows


def flat_values(run, prefix: str = "") -> Dict[str, object]:
    """{dotted key: value} of every leaf, free-form dicts (model.config) included key by key."""

    def walk(node, at: str, out: Dict[str, object]) -> None:
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name), f"{at}{f.name}.", out)
        elif isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, f"{at}{k}.", out)
        else:
            out[at[:-1]] = node

    out: Dict[str, object] = {}
    walk(run, prefix, out)
    return out


def config_diff(run, base) -> List[dict]:
    """The keys whose value differs from `base` (a key only one side has counts, as None on the other)."""
    mine, theirs = flat_values(run), flat_values(base)
    keys = list(mine) + [k for k in theirs if k not in mine]
    return [
        {"key": k, "value": mine.get(k), "base": theirs.get(k)}
        for k in keys
        if mine.get(k) != theirs.get(k) and k != "recipe"
    ]
