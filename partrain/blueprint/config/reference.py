"""The configuration reference page (docs/config-reference.md), written from the schema's field docstrings.

Regenerate it after a schema change with the command in REGENERATE; tests/test_docs.py fails when the
committed page differs from what this module writes, or when a key has no docstring.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Iterator, List, Tuple

from partrain.blueprint.config.docs import field_docs
from partrain.blueprint.config.schema import AT_LEAST, CHOICES, RunConfig

REGENERATE = "python -m partrain.blueprint.config.reference > docs/config-reference.md"
"""The one command that rewrites the page (run from the repository root)."""

_INTRO = f"""\
# Configuration reference

<!-- Generated from the field docstrings of partrain/blueprint/config/schema.py; do not edit by hand.
     Regenerate: {REGENERATE} -->

Every key of a run, by group, with its type, its default in the schema and its meaning. A group
option (`conf/<group>/*.yaml`, e.g. `model=llama-tiny`) or a recipe may set other values:
`partrain show OVERRIDES` prints the composed values and `partrain show OVERRIDES --explain` this
table for them. How the groups, recipes and overrides fit together: [Configuration](configuration.md).
"""


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def _yaml(value: object) -> str:
    """A value as a user writes it in an override (YAML), in code font."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = value if value else '""'
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(_yaml(v).strip("`") for v in value) + "]"
    elif isinstance(value, dict):
        text = "{" + ", ".join(f"{k}: {_yaml(v).strip('`')}" for k, v in value.items()) + "}"
    else:
        text = str(value)
    return f"`{text}`"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def sections(run_cls=RunConfig) -> Iterator[Tuple[str, str, List[dict]]]:
    """(group, the group's docstring, one row per key) for each group, then the top-level keys."""
    docs = field_docs(run_cls)
    top: List[dict] = []
    for f in dataclasses.fields(run_cls):
        value = _default(f)
        if dataclasses.is_dataclass(value):
            yield f.name, docs.get(f.name, ""), list(_rows(type(value), f"{f.name}."))
        else:
            top.append(_row(f, f.name, docs.get(f.name, "")))
    if top:
        yield "top level", "Keys outside the groups.", top


def _rows(cls, prefix: str) -> Iterator[dict]:
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        value = _default(f)
        if dataclasses.is_dataclass(value):
            yield from _rows(type(value), f"{prefix}{f.name}.")
        else:
            yield _row(f, f"{prefix}{f.name}", docs.get(f.name, ""))


def _row(f: dataclasses.Field, key: str, doc: str) -> dict:
    return {"key": key, "type": str(f.type), "default": _default(f), "doc": doc}


def undocumented_keys(run_cls=RunConfig) -> List[str]:
    """Every key (and group) without a docstring: the page would have an empty cell for it."""
    missing = [group for group, doc, _ in sections(run_cls) if not doc]
    return missing + [row["key"] for _, _, rows in sections(run_cls) for row in rows if not row["doc"]]


def render(run_cls=RunConfig) -> str:
    """The whole page, markdown."""
    out = [_INTRO]
    for group, doc, rows in sections(run_cls):
        out += [f"## {group}", "", _cell(doc), "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for row in rows:
            meaning = row["doc"]
            if row["key"] in CHOICES:
                meaning += " One of: " + ", ".join(_yaml(v) for v in CHOICES[row["key"]]) + "."
            if row["key"] in AT_LEAST:
                meaning += f" At least {AT_LEAST[row['key']]}."
            cells = (f"`{row['key']}`", f"`{_cell(row['type'])}`", _cell(_yaml(row["default"])), _cell(meaning))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
