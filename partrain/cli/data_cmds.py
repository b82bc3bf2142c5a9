"""`partrain data show`: the first training rows exactly as the loader yields them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from partrain.cli.common import JSON, OVERRIDES, RECIPES, compose_run, fail, stdout_console
from partrain.errors import ConfigError

data_app = typer.Typer(help="Inspect the training data as the workers read it.", no_args_is_help=True)

IGNORE_INDEX = -100


def first_rows(v, n: int) -> tuple:
    """(tokenizer, [(inputs, shifted labels)] of the first n training rows, pad id): global batches
    0, 1, ... of the run's loader, rows in order (the cache entry is prepared as the launch does)."""
    from partrain.data.example_batches import ExampleBatches
    from partrain.data.examples import prepare_examples, uses_examples
    from partrain.data.loader import TokenBatches
    from partrain.data.packing import prepare_tokens
    from partrain.data.tokenizer import load_tokenizer

    t, d = v.run.train, v.run.data
    if uses_examples(d):
        examples = prepare_examples(d)
        batches, pad_id = ExampleBatches(examples, t.seq_len, v.global_batch_size, t.seed), examples.pad_id
    else:
        batches, pad_id = TokenBatches.from_packed(prepare_tokens(d), t.seq_len, v.global_batch_size, t.seed), None
    rows: List[tuple] = []
    step = 0
    while len(rows) < n:
        inputs, labels = batches.rank_batch(step)
        rows += [(inputs[i].tolist(), labels[i].tolist()) for i in range(len(inputs))]
        step += 1
    return load_tokenizer(d.tokenizer), rows[:n], pad_id


def hf_sample(inputs: List[int], shifted: List[int]) -> dict:
    """A row in Hugging Face's convention: labels aligned with input_ids (labels[t] = input_ids[t] where
    the loss is taken, -100 elsewhere; the model shifts), position_ids 0..seq_len-1. The loader's last
    target (the token after the row's last input) has no input_ids position to sit at and is left out."""
    return {
        "input_ids": inputs,
        "labels": [IGNORE_INDEX] + shifted[:-1],
        "position_ids": list(range(len(inputs))),
    }


def _segments(tokenizer, sample: dict, pad_id: Optional[int]) -> tuple:
    """([(text, trained)], padding tokens) of a sample: consecutive tokens decoded together."""
    ids, labels = sample["input_ids"], sample["labels"]
    end = len(ids)
    while pad_id is not None and end > 1 and ids[end - 1] == pad_id and labels[end - 1] == IGNORE_INDEX:
        end -= 1
    out, start = [], 0
    for t in range(1, end + 1):
        if t == end or (labels[t] != IGNORE_INDEX) != (labels[start] != IGNORE_INDEX):
            out.append((tokenizer.decode(ids[start:t]), labels[start] != IGNORE_INDEX))
            start = t
    return out, len(ids) - end


@data_app.command("show")
def data_show_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    n: int = typer.Option(3, "--n", min=1, help="How many training rows to show."),
    recipes: Optional[List[Path]] = RECIPES,
    as_json: bool = JSON,
) -> None:
    """The first N training rows as the loader yields them: the text with the trained tokens highlighted,
    or (--json) {"samples": [{"input_ids", "labels", "position_ids"}]} in Hugging Face's convention."""
    from partrain.blueprint.validate import validate
    from partrain.preflight import data_problems

    try:
        v = validate(compose_run(list(overrides or []), recipes))
        if problems := data_problems(v):
            raise ConfigError(problems)
        tokenizer, rows, pad_id = first_rows(v, n)
    except ConfigError as err:
        fail(err, as_json)
    samples = [hf_sample(inputs, labels) for inputs, labels in rows]
    if as_json:
        print(json.dumps({"samples": samples}))
        return
    from rich.text import Text

    console = stdout_console()
    for i, sample in enumerate(samples):
        segments, padding = _segments(tokenizer, sample, pad_id)
        trained = sum(1 for label in sample["labels"] if label != IGNORE_INDEX)
        console.print(Text(f"row {i}: {len(sample['input_ids'])} tokens, {trained} trained", style="bold"))
        text = Text()
        for piece, is_trained in segments:
            text.append(piece, style="bold green" if is_trained else "dim")
        if padding:
            text.append(f" [+{padding} padding]", style="dim italic")
        console.print(text)
    console.print(Text("green: tokens the loss is taken on", style="dim"))
