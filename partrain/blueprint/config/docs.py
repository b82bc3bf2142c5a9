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
