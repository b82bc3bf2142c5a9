"""Rules for the fine-tuning keys of the `data` group (format, train_on, templates, packing).

The values themselves are checked with the other choices (schema.CHOICES); here are the combinations
this version does not do. Fine-tuning rows are packed into windows with document masks
(data.packing=true, partrain.data.example_packing) or read one example per row, padded
(data.packing=false), under every layout (sp included); streamed (data.streaming=true) they are rendered
on the fly, one padded example per row (partrain.data.example_stream), and what a stream cannot do is
refused plainly rather than half-working. data.format=auto is resolved when the first row is read
(partrain.data.examples.resolve_format and the preflight apply the same rules then).
"""

from __future__ import annotations

from typing import Optional

from partrain.blueprint.config.schema import RunConfig

EXAMPLE_FORMATS = ("chat", "sharegpt", "alpaca", "prompt_completion", "tokenized", "preference")
"""data.format values read one example per row (everything but text)."""

MESSAGE_ROLES = ("system", "user", "assistant", "tool")
"""The roles of a chat message (partrain.data.chat.ROLES); data.roles maps a data set's names onto them."""

CHAT_FORMATS = ("chat", "sharegpt", "alpaca")
"""data.format values rendered as chat messages with the chat template (sharegpt and alpaca mapped to
messages by partrain.data.row_layouts)."""


def uses_template(fmt: str, chat_template: str) -> bool:
    """Whether rows of this format are rendered with a chat template."""
    return fmt in CHAT_FORMATS or (fmt == "prompt_completion" and bool(chat_template))


PAIRED_FORMATS = ("preference",)
"""data.format values whose row is a pair of examples (chosen, rejected) for the preference objectives."""


def packing_problem(fmt: str, packing: bool) -> Optional[tuple]:
    """(rule, fix) when data.packing does not fit the (resolved) format, else None."""
    if fmt == "text" and not packing:
        return (
            "text without packing (one padded document per row) is not built yet",
            "set data.packing=true, or give chat, prompt_completion or tokenized rows",
        )
    return None


def stream_example_problems(fmt: str, d) -> list:
    """(key, value, rule, fix) of each data key a stream of fine-tuning rows cannot honour: rows are
    rendered on the fly one padded example per row (partrain.data.example_stream), so nothing is packed
    and no row is seen ahead. data.format=auto: applied again once the first row names the format."""
    if not d.streaming or fmt not in EXAMPLE_FORMATS:
        return []
    out = []
    if d.packing:
        out.append(
            (
                "data.packing",
                True,
                f"streamed {fmt} rows are read one padded example per row; packing them on the fly is not built yet",
                "set data.packing=false (or data.streaming=false: the examples cache packs them)",
            )
        )
    if d.long_examples == "error":
        out.append(
            (
                "data.long_examples",
                "error",
                "a stream is not read ahead, so an over-long example cannot be refused before the run starts",
                "set data.long_examples=truncate or skip (or data.streaming=false)",
            )
        )
    return out


def data_format_problems(c, run: RunConfig, degrees: Optional[dict]) -> None:
    """Append the fine-tuning data problems of `run` to the collector `c` (`check(ok, key, value, rule, fix)`)."""
    d = run.data
    fmt = "text" if d.format == "auto" and d.source == "builtin" else d.format
    problem = packing_problem(fmt, d.packing)
    if problem is not None:
        c.add("data.packing", d.packing, *problem)
    for key, value in (("data.eval_split", d.eval_split), ("data.eval_source", d.eval_source)):
        c.check(  # the stream holds out its first windows (partrain.data.streaming); a second stream is not built
            not (d.streaming and value),
            key,
            value,
            "a streamed run evaluates on the first train.eval_batches global batches of its own stream; an eval "
            "split or source of its own is not built for streaming yet",
            f"unset {key}, or set data.streaming=false",
        )
    if fmt not in EXAMPLE_FORMATS:
        return
    for problem in stream_example_problems(fmt, d):
        c.add(*problem)
    c.check(
        not d.prompt_template or "{prompt}" in d.prompt_template,
        "data.prompt_template",
        d.prompt_template,
        "has no {prompt} placeholder, so the row's prompt would be dropped",
        'e.g. data.prompt_template="### Question\\n{prompt}\\n### Answer\\n"',
    )
    for name, role in dict(d.roles).items():
        c.check(
            role in MESSAGE_ROLES,
            f"data.roles.{name}",
            role,
            f"maps the data's role {name!r} to a role chat templates do not know",
            f"map it to one of {', '.join(MESSAGE_ROLES)}, e.g. data.roles={{{name}:user}}",
        )
