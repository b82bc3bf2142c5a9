"""Public data sets' row layouts read as chat messages, by mapping (no file is rewritten).

- Any chat layout (``data.format=chat`` or ``sharegpt``) with its own names: ``data.messages_field``
  (the list of turns), ``data.role_field`` and ``data.content_field`` (a turn's keys) and ``data.roles``
  (the data's role names -> system, user, assistant, tool): `RowMapping`.

- ShareGPT (``data.format=sharegpt``): ``{"conversations": [{"from": "human", "value": ...}, ...]}``,
  roles human/gpt (and user/assistant, system, tool/function/observation), an optional row-level
  ``system`` string and ``tools`` list.
- Alpaca (``data.format=alpaca``): ``{"instruction", "input" (optional), "output"}``, an optional
  ``system``: one user turn (the instruction, then the input after a blank line) and one assistant turn.

Both are then chat rows: rendered with the chat template and labelled as any chat
(partrain.data.chat, partrain.data.chat_labels). data.format=auto detects them from the first row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

from partrain.data.chat import ROLES, ChatRowError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bard": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
    "observation": "tool",
    "function_response": "tool",
}
"""ShareGPT's ``from`` values and the chat role each means."""

LAYOUT_FORMATS = ("sharegpt", "alpaca")
"""data.format values read through this module (as chat rows)."""


@dataclass(frozen=True)
class RowMapping:
    """Where a chat row keeps its turns and what it calls their parts (data.messages_field, role_field,
    content_field, roles); "" = the format's own name."""

    messages_field: str = ""
    role_field: str = ""
    content_field: str = ""
    roles: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, d) -> "RowMapping":
        return cls(d.messages_field, d.role_field, d.content_field, dict(d.roles))

    @property
    def is_default(self) -> bool:
        return not (self.messages_field or self.role_field or self.content_field or self.roles)


def messages_of(row: dict, fmt: str, mapping: RowMapping = RowMapping()) -> List[dict]:
    """The chat messages of a chat, sharegpt or alpaca row; ChatRowError naming the rule broken."""
    if fmt == "sharegpt":
        return _mapped(row, mapping, ("conversations", "from", "value"), {**SHAREGPT_ROLES, **mapping.roles})
    if fmt == "chat":
        return _mapped(row, mapping, ("messages", "role", "content"), mapping.roles)
    if fmt == "alpaca":
        return _alpaca(row)
    raise ValueError(f"not a row layout: {fmt!r}")


def _system(row: dict) -> List[dict]:
    system = row.get("system")
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise ChatRowError(f"field 'system' is a {type(system).__name__}, not a string", "not_a_string")
    return [{"role": "system", "content": system}]


def _mapped(row: dict, mapping: RowMapping, defaults: tuple, roles: Dict[str, str]) -> List[dict]:
    """A chat layout's turns as {role, content, ...}: the mapping's names, else the layout's own; a role
    the mapping does not name is kept as it is (check_messages refuses an unknown one)."""
    field_name = mapping.messages_field or defaults[0]
    role_key, content_key = mapping.role_field or defaults[1], mapping.content_field or defaults[2]
    turns = row.get(field_name)
    if not isinstance(turns, list):
        raise ChatRowError(
            f"the row has no {field_name!r} list (fields: {list(row)}); data.messages_field names the field "
            "that holds the turns",
            "missing_field",
        )
    messages = _system(row) if defaults[0] == "conversations" else []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn:
            keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise ChatRowError(
                f"{field_name}[{i}] has no {role_key!r} (keys: {keys}); data.role_field and data.content_field "
                "name a turn's keys",
                "no_role_or_content",
            )
        role = turn[role_key]
        mapped = roles.get(str(role), roles.get(str(role).lower(), role))
        if mapped not in ROLES:
            raise ChatRowError(
                f"{field_name}[{i}] has role {role!r}; roles are {', '.join(ROLES)} (and {', '.join(roles)} mapped "
                f"to them); map it with data.roles={{{role}:assistant}} (or user, system, tool)"
                if roles
                else f"{field_name}[{i}] has role {role!r}; roles are {', '.join(ROLES)}; map it with "
                f"data.roles={{{role}:assistant}} (or user, system, tool)",
                "unknown_role",
            )
        rest = {k: v for k, v in turn.items() if k not in (role_key, content_key)}
        message = {**rest, "role": mapped}
        if content_key in turn:
            message["content"] = turn[content_key]
        messages.append(message)
    return messages


def _alpaca(row: dict) -> List[dict]:
    fields = {}
    for name in ("instruction", "input", "output"):
        value = row.get(name, "")
        if value is None:
            value = ""
        if not isinstance(value, str):
            raise ChatRowError(f"field {name!r} is a {type(value).__name__}, not a string", "not_a_string")
        fields[name] = value
    if not fields["instruction"] and not fields["input"]:
        raise ChatRowError(f"the row has no 'instruction' (fields: {list(row)})", "missing_field")
    if not fields["output"]:
        raise ChatRowError("field 'output' is empty, so nothing in this row would be trained", "empty_completion")
    prompt = "\n\n".join(part for part in (fields["instruction"], fields["input"]) if part)
    return [*_system(row), {"role": "user", "content": prompt}, {"role": "assistant", "content": fields["output"]}]


def detect_layout(row: Any) -> str:
    """sharegpt or alpaca when the row has that layout's fields, else ""."""
    if isinstance(row, dict):
        if isinstance(row.get("conversations"), list):
            return "sharegpt"
        if "instruction" in row and "output" in row:
            return "alpaca"
    return ""
