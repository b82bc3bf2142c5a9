"""Rules for the fine-tuning keys of the `data` group (format, train_on, templates, packing).

The values themselves are checked with the other choices (schema.CHOICES); here are the combinations
this version does not do. Fine-tuning rows are read one example per row, padded (partrain.data.examples):
packing them, streaming them and sharding their sequences (sp) are not built yet, and are refused
plainly rather than half-working. data.format=auto is resolved when the first row is read
(partrain.data.examples.resolve_format applies the same packing rule then).
"""

from __future__ import annotations

from typing import Optional

from partrain.blueprint.config.schema import RunConfig

EXAMPLE_FORMATS = ("chat", "prompt_completion", "tokenized")
"""data.format values read one example per row (everything but text)."""


def packing_problem(fmt: str, packing: bool) -> Optional[tuple]:
    """(rule, fix) when data.packing does not fit the (resolved) format, else None."""
    if fmt in EXAMPLE_FORMATS and packing:
        return (
            f"packing {fmt} examples into shared windows is not built yet (data.format={fmt})",
            "set data.packing=false: one example per row, padded to train.seq_len",
        )
    if fmt == "text" and not packing:
        return (
            "text without packing (one padded document per row) is not built yet",
            "set data.packing=true, or give chat, prompt_completion or tokenized rows",
        )
    return None


def data_format_problems(c, run: RunConfig, degrees: Optional[dict]) -> None:
    """Append the fine-tuning data problems of `run` to the collector `c` (`check(ok, key, value, rule, fix)`)."""
    d = run.data
    fmt = "text" if d.format == "auto" and d.source == "builtin" else d.format
    problem = packing_problem(fmt, d.packing)
    if problem is not None:
        c.add("data.packing", d.packing, *problem)
    if fmt not in EXAMPLE_FORMATS:
        return
    c.check(
        not d.streaming,
        "data.streaming",
        d.streaming,
        f"streaming {fmt} rows is not built yet (they are rendered once into the examples cache)",
        "set data.streaming=false",
    )
    sp = degrees["sp"] if degrees else run.parallel.sp
    c.check(
        sp == 1,
        "parallel.sp",
        sp,
        f"sequence sharding of padded {fmt} examples is not built yet (the loss is normalised over the "
        "global batch's labelled tokens, which sequence shards do not count yet)",
        "set parallel.sp=1",
    )
    c.check(
        not d.prompt_template or "{prompt}" in d.prompt_template,
        "data.prompt_template",
        d.prompt_template,
        "has no {prompt} placeholder, so the row's prompt would be dropped",
        'e.g. data.prompt_template="### Question\\n{prompt}\\n### Answer\\n"',
    )
