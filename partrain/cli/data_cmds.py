"""`partrain data show | prepare | make-chat`: the first training rows exactly as the loader yields them;
the run's data tokenized into the cache before a launch; the generated chat set as a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from partrain.cli.common import JSON, OVERRIDES, RECIPES, compose_run, fail, stdout_console
from partrain.errors import ConfigError

data_app = typer.Typer(help="Inspect the training data as the workers read it.", no_args_is_help=True)

IGNORE_INDEX = -100


def first_rows(v, n: int) -> tuple:
    """(tokenizer, [(inputs, shifted labels, position ids or None)] of the first n training rows, pad id):
    global batches 0, 1, ... of the run's loader, rows in order (the cache entry is prepared as the launch
    does). Position ids come with packed examples (restarting at 0 per example); None = 0..seq_len-1."""
    from partrain.data.example_packing import example_batch_classes
    from partrain.data.examples import prepare_examples, uses_examples
    from partrain.data.loader import TokenBatches
    from partrain.data.packing import prepare_tokens
    from partrain.data.tokenizer import load_tokenizer

    t, d = v.run.train, v.run.data
    if uses_examples(d):
        examples = prepare_examples(d)
        train_cls, _ = example_batch_classes(d.packing, examples.paired)
        batches = train_cls(examples, t.seq_len, v.global_batch_size, t.seed, d.long_examples)
        pad_id = examples.pad_id
    else:
        batches, pad_id = TokenBatches.from_packed(prepare_tokens(d), t.seq_len, v.global_batch_size, t.seed), None
    rows: List[tuple] = []
    step = 0
    while len(rows) < n:
        inputs, labels, *positions = batches.rank_batch(step)
        rows += [
            (inputs[i].tolist(), labels[i].tolist(), positions[0][i].tolist() if positions else None)
            for i in range(len(inputs))
        ]
        step += 1
    return load_tokenizer(d.tokenizer), rows[:n], pad_id


def hf_sample(inputs: List[int], shifted: List[int], positions: Optional[List[int]] = None) -> dict:
    """A row in Hugging Face's convention: labels aligned with input_ids (labels[t] = input_ids[t] where
    the loss is taken, -100 elsewhere; the model shifts), position_ids 0..seq_len-1, or for packed
    examples the loader's own, restarting at 0 at each example (where attention starts afresh). The
    loader's last target of each example (the token after its last input: the row's end, or the end of a
    packed example) has no input_ids position to sit at and is left out: -100 where an example starts."""
    positions = positions if positions is not None else list(range(len(inputs)))
    labels = [IGNORE_INDEX] + shifted[:-1]
    return {
        "input_ids": inputs,
        "labels": [IGNORE_INDEX if p == 0 else label for p, label in zip(positions, labels)],
        "position_ids": positions,
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


TRAINED_MARKS = ("\u27e6", "\u27e7")
"""⟦ and ⟧: around trained text when `data show` prints without colour."""


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
    samples = [hf_sample(*row) for row in rows]
    if as_json:
        print(json.dumps({"samples": samples}))
        return
    from rich.text import Text

    console = stdout_console()
    # Without colour (piped, NO_COLOR) the trained text is bracketed, so the mask survives a copy-paste.
    opened, closed = ("", "") if console.color_system else TRAINED_MARKS
    for i, sample in enumerate(samples):
        segments, padding = _segments(tokenizer, sample, pad_id)
        trained = sum(1 for label in sample["labels"] if label != IGNORE_INDEX)
        console.print(Text(f"row {i}: {len(sample['input_ids'])} tokens, {trained} trained", style="bold"))
        text = Text()
        for piece, is_trained in segments:
            text.append(
                f"{opened}{piece}{closed}" if is_trained else piece, style="bold green" if is_trained else "dim"
            )
        if padding:
            text.append(f" [+{padding} padding]", style="dim italic")
        console.print(text)
    legend = "green" if console.color_system else f"{TRAINED_MARKS[0]}...{TRAINED_MARKS[1]}"
    console.print(Text(f"{legend}: tokens the loss is taken on", style="dim"))


@data_app.command("prepare")
def data_prepare_cmd(
    overrides: Optional[List[str]] = OVERRIDES,
    recipes: Optional[List[Path]] = RECIPES,
    as_json: bool = JSON,
) -> None:
    """Tokenize the run's data into the cache (fine-tuning rows: render, mask and check them) exactly as
    `partrain train` with the same overrides would at launch, which then finds it ready. Run it once per
    cache folder before a multi-node or SLURM launch: no rank then waits on tokenization."""
    import time

    from partrain.blueprint.validate import validate
    from partrain.data.prepare import prepare_data
    from partrain.errors import Problem
    from partrain.multinode import preparing_data
    from partrain.preflight import data_problems

    started = time.monotonic()
    try:
        v = validate(compose_run(list(overrides or []), recipes))
        if v.run.data.streaming:
            raise ConfigError(
                Problem(
                    "data.streaming",
                    True,
                    "a streamed source is tokenized by every rank as it trains: nothing is prepared ahead",
                    "set data.streaming=false to cache the data (then prepare it here)",
                )
            )
        with Console(stderr=True).status(f"preparing {v.run.data.source} (tokenizing, packing, checking)"):
            with preparing_data(v):  # another process preparing the same cache entry: wait, then reuse it
                if problems := data_problems(v):
                    raise ConfigError(problems)
                entry = prepare_data(v.run.data)  # ready now: opened from the cache
    except ConfigError as err:
        fail(err, as_json)
    meta = json.loads(Path(entry.meta_path).read_text(encoding="utf-8"))
    report = {"meta_path": str(entry.meta_path), "seconds": round(time.monotonic() - started, 2), "entry": meta}
    if as_json:
        print(json.dumps(report, default=str))
        return
    stdout_console().print(
        f"prepared in {report['seconds']:.1f} s: {entry.meta_path.parent}; `partrain train` with the same overrides "
        "reuses it (on every node that reads this cache folder)",
        markup=False,
    )


@data_app.command("make-chat")
def data_make_chat_cmd(
    out: Path = typer.Argument(..., help="The .jsonl file to write."),
    rows: int = typer.Option(2000, "--rows", min=1, help="How many chats to write."),
    as_json: bool = JSON,
) -> None:
    """Write the generated chat set of data.source=builtin-chat to a .jsonl file (one {"messages": [...]}
    per line), to read or to edit before training on it with data.source=OUT."""
    from partrain.blueprint.problems import os_error_problem
    from partrain.data.builtin_chat import chat_rows

    try:
        with open(out, "w", encoding="utf-8") as f:
            for row in chat_rows(rows):
                f.write(json.dumps(row) + "\n")
    except OSError as exc:
        fail(ConfigError(os_error_problem("OUT", out, exc, "write the chat set", "give a writable path")), as_json)
    if as_json:
        print(json.dumps({"written": str(out), "rows": rows}))
        return
    stdout_console().print(f"wrote {rows} chats to {out} (train on them with data.source={out})", markup=False)
