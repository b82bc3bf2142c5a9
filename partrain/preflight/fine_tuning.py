"""What the dry run reports about fine-tuning data (issue 37 item 7), measured on the examples the
launch's preflight rendered: the format (and whether data.format=auto detected it), the template, the
examples per split and the share of the first global batches' tokens that take no loss.

The batches are the ones the workers open (partrain.data.example_packing.example_batch_classes), so the
share is what the first steps train on, padding and packing included; only label counts are read, no
batch is built. The report renders it (partrain.blueprint.report.fine_tuning).
"""

from __future__ import annotations

from typing import Optional

from partrain.blueprint.validate import ValidatedRun
from partrain.errors import ConfigError

FIRST_STEPS = 4
"""Global batches whose masked share the report gives."""


def template_words(cfg, fmt: str) -> Optional[str]:
    """The template the rows are rendered with, in words (None: tokenized rows, or prompts as they are)."""
    from partrain.blueprint.validate_data_format import uses_template

    if uses_template(fmt, cfg.chat_template):
        return f"{cfg.chat_template} (data.chat_template)" if cfg.chat_template else "the tokenizer's own"
    if fmt == "prompt_completion" and cfg.prompt_template:
        return "data.prompt_template"
    return None


def data_facts(v: ValidatedRun, examples) -> dict:
    """The report's fine_tuning.data of these examples (partrain.data.examples.Examples)."""
    from partrain.data.eval_source import describe
    from partrain.data.example_packing import example_batch_classes
    from partrain.data.examples import resolve_format
    from partrain.data.long_examples import row_facts

    d, t = v.run.data, v.run.train
    fmt = resolve_format(d)
    rows = row_facts(d, examples, t.seq_len)  # what the preflight's stderr note says, for the JSON too
    facts = {
        "format": fmt,
        "detected": d.format == "auto",
        "template": template_words(d, fmt),
        "labelling": dict(examples.labelling),
        "train_on": d.train_on,
        "packing": d.packing,
        "examples_train": int(examples.n_train),
        "examples_eval": int(examples.n_examples - examples.n_train),
        "eval_set": describe(d),
        "skipped_rows": rows.get("skipped_rows", {}),
        "long_examples": rows.get("long_examples"),
        "first_batches": None,
    }
    train_cls, _ = example_batch_classes(d.packing, examples.paired)
    try:
        batches = train_cls(examples, t.seq_len, v.global_batch_size, t.seed, d.long_examples)
    except ConfigError:
        return facts  # too few examples: the preflight's problems say so
    steps = max(1, min(FIRST_STEPS, t.steps))
    tokens = steps * v.global_batch_size * t.seq_len
    trained = sum(int(batches.label_count(step)) for step in range(steps))
    facts["first_batches"] = {
        "steps": steps,
        "tokens": tokens,
        "trained": trained,
        "masked_share": 1 - trained / tokens,
    }
    return facts


def stream_vocab(v: ValidatedRun, facts: Optional[dict] = None) -> Optional[int]:
    """data.streaming with fine-tuning rows: the rules a stream cannot honour (data.format=auto resolved
    here), then the first global batch and the held-out examples rendered as the workers render them
    (bad rows, a missing template, too few rows for them: ConfigError). Returns the tokenizer's
    vocabulary for the caller's check; None for streamed text (checked by the caller)."""
    from partrain.blueprint.validate_data_format import EXAMPLE_FORMATS, stream_example_problems
    from partrain.data.examples import resolve_format
    from partrain.errors import Problem

    d, t = v.run.data, v.run.train
    fmt = resolve_format(d)
    if fmt not in EXAMPLE_FORMATS:
        return None
    # Imported only now: the stream builds torch tensors, and a streamed text run's dry run stays torch-free.
    from partrain.data.example_stream import open_example_stream

    if problems := stream_example_problems(fmt, d):
        raise ConfigError([Problem(*p) for p in problems])
    batches, _ = open_example_stream(d, t.seq_len, v.global_batch_size, t.seed, t.eval_batches)
    batches.global_batch(0)
    if facts is not None:
        trained = batches.label_count(0)
        tokens = v.global_batch_size * t.seq_len
        facts["fine_tuning"] = {
            "format": fmt,
            "detected": d.format == "auto",
            "template": template_words(d, fmt),
            "labelling": {},  # the stream's rows are rendered by the workers
            "train_on": d.train_on,
            "packing": False,
            "examples_train": None,
            "examples_eval": None,
            "eval_set": f"the first {t.eval_batches} global batches of the stream" if t.eval_batches else "none",
            "skipped_rows": None,  # a stream's rows are met by the workers, not counted ahead
            "long_examples": None,
            "first_batches": {"steps": 1, "tokens": tokens, "trained": trained, "masked_share": 1 - trained / tokens},
        }
    return batches.tokenizer.vocab_size
