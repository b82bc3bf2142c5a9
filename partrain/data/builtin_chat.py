"""`data.source=builtin-chat`: a small chat set generated on the spot, for fine-tuning offline (and
`data.source=builtin-preference`: the same questions as preference pairs, a right and a wrong answer).

Nothing is downloaded or shipped: the rows are made from a fixed seed, so every run, rank and machine
sees the same conversations. Each row is a ``{"messages": [...]}`` chat (the `chat` format) whose
answer follows from its question by a rule a tiny model can learn in a few dozen steps:

- addition:  "What is 37 + 58?" -> "95"
- reversal:  "Reverse: lamp" -> "pmal"
- upper case: "Upper case: river" -> "RIVER"
- counting:  "How many letters in: stone?" -> "5"

One row in ``SYSTEM_EVERY`` starts with a system turn and one in ``MULTI_TURN_EVERY`` holds two
exchanges, so the set exercises the masking rules (system and user turns are never trained, every
assistant turn is). ``partrain data make-chat OUT.jsonl`` writes the same rows to a file, to look at
or to edit. The set has the surface the examples reader uses for a `datasets` folder (``rows``,
``identity``, ``slug``), and no documents: it is chat data, not text.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

from partrain.errors import ConfigError, Problem

BUILTIN_CHAT = "builtin-chat"
"""The data.source value that selects the generated chat set."""
GENERATOR_VERSION = 1
"""Bumped when the rows change, so examples cached from the old rows are not reused."""
ROWS = 2000
"""Rows in the set: 2 % of them (data.eval_fraction's default) is 40 held-out chats."""
SEED = 20260
SYSTEM_EVERY = 5
MULTI_TURN_EVERY = 7
SYSTEM_PROMPT = "Answer briefly."
WORDS = (
    "lamp river stone cloud apple tiger music paper glass orbit bread field chair smile light north "
    "piano train grape honey sugar ocean plant storm"
).split()


def _exchange(rng: random.Random) -> Tuple[str, str]:
    """One (question, answer) pair of a randomly chosen task."""
    task = rng.randrange(4)
    if task == 0:
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        return f"What is {a} + {b}?", str(a + b)
    word = rng.choice(WORDS)
    if task == 1:
        return f"Reverse: {word}", word[::-1]
    if task == 2:
        return f"Upper case: {word}", word.upper()
    return f"How many letters in: {word}?", str(len(word))


BUILTIN_PREFERENCE = "builtin-preference"
"""The data.source value that selects the generated preference set (for train.objective=dpo / simpo)."""
GENERATED_SOURCES = (BUILTIN_CHAT, BUILTIN_PREFERENCE)
"""The data.source values of the sets generated here (no path)."""


def _wrong_answer(question: str, answer: str, rng: random.Random) -> str:
    """A plausible wrong answer to one of `_exchange`'s questions: a near miss of a sum or a count, the
    word left as it is instead of reversed or upper-cased."""
    if answer.isdigit():
        return str(int(answer) + rng.choice((-3, -2, -1, 1, 2, 3)))
    return question.split(": ", 1)[1].rstrip("?")


def preference_rows(count: int = ROWS, seed: int = SEED) -> Iterator[Dict[str, Any]]:
    """The preference set's rows in order, TRL's conversational layout with an explicit prompt:
    {"prompt": [user turn], "chosen": [the right answer], "rejected": [a wrong one]}."""
    rng = random.Random(seed + 1)
    for _ in range(count):
        question, answer = _exchange(rng)
        wrong = _wrong_answer(question, answer, rng)
        yield {
            "prompt": [{"role": "user", "content": question}],
            "chosen": [{"role": "assistant", "content": answer}],
            "rejected": [{"role": "assistant", "content": wrong}],
        }


def chat_rows(count: int = ROWS, seed: int = SEED) -> Iterator[Dict[str, Any]]:
    """The set's rows in order: {"messages": [{"role", "content"}, ...]}."""
    rng = random.Random(seed)
    for n in range(count):
        messages: List[Dict[str, str]] = []
        multi_turn = n % MULTI_TURN_EVERY == 0
        if n % SYSTEM_EVERY == 0 and not multi_turn:  # both would not fit the recipe's train.seq_len
            messages.append({"role": "system", "content": SYSTEM_PROMPT})
        for _ in range(2 if multi_turn else 1):
            question, answer = _exchange(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        yield {"messages": messages}


@dataclass(frozen=True)
class BuiltinChat:
    """The generated set as a data source (the surface of hf_dataset.DatasetCorpus that examples reads)."""

    rows_count: int = ROWS
    kind: str = BUILTIN_CHAT
    root: Path = Path(BUILTIN_CHAT)
    """Named in row messages ("builtin-chat row 12: ...")."""
    files: Tuple[Path, ...] = field(default=())
    slug: str = BUILTIN_CHAT

    def identity(self) -> Dict[str, Any]:
        return {"kind": self.kind, "version": GENERATOR_VERSION, "rows": self.rows_count, "seed": SEED}

    @classmethod
    def named(cls, source: str) -> "BuiltinChat":
        """The generated set data.source names (one of GENERATED_SOURCES)."""
        return cls(kind=source, root=Path(source), slug=source)

    def rows(self) -> Iterator[Tuple[str, Any]]:
        """("row N", row) of every row, in order."""
        make = preference_rows if self.kind == BUILTIN_PREFERENCE else chat_rows
        for n, row in enumerate(make(self.rows_count), start=1):
            yield f"row {n}", row

    def documents(self) -> Iterator[str]:
        """Text documents: none (a text run or a stream of text cannot read chat rows)."""
        raise ConfigError(
            Problem(
                "data.format",
                "text",
                f"data.source={self.kind} holds chat rows, not text documents",
                "set data.format=auto (or chat) and data.streaming=false, or data.source=builtin for text",
            )
        )
