"""Public data sets' row layouts read as chat messages, by mapping (no file is rewritten).

- ShareGPT (``data.format=sharegpt``): ``{"conversations": [{"from": "human", "value": ...}, ...]}``,
  roles human/gpt (and user/assistant, system, tool/function/observation), an optional row-level
  ``system`` string and ``tools`` list.
- Alpaca (``data.format=alpaca``): ``{"instruction", "input" (optional), "output"}``, an optional
  ``system``: one user turn (the instruction, then the input after a blank line) and one assistant turn.

Both are then chat rows: rendered with the chat template and labelled as any chat
(partrain.data.chat, partrain.data.chat_labels). data.format=auto detects them from the first row.
"""

from __future__ import annotations

from typing import Any, List

from partrain.data.chat import ChatRowError

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


def messages_of(row: dict, fmt: str) -> List[dict]:
    """The chat messages of a row in one of LAYOUT_FORMATS; ChatRowError naming the rule broken."""
    if fmt == "sharegpt":
        return _sharegpt(row)
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


def _sharegpt(row: dict) -> List[dict]:
    turns = row.get("conversations")
    if not isinstance(turns, list):
        raise ChatRowError(f"the row has no 'conversations' list (fields: {list(row)})", "missing_field")
    messages = _system(row)
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            keys = sorted(turn) if isinstance(turn, dict) else type(turn).__name__
            raise ChatRowError(f"conversations[{i}] has no 'from' or 'value' (keys: {keys})", "no_role_or_content")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise ChatRowError(
                f"conversations[{i}] is from {turn['from']!r}; ShareGPT roles are {', '.join(SHAREGPT_ROLES)}",
                "unknown_role",
            )
        messages.append({"role": role, "content": turn["value"]})
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
