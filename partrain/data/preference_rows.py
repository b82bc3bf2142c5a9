"""Preference rows (data.format=preference) rendered into a pair of examples: (prompt + chosen, prompt + rejected).

The rows are TRL's preference layout:

- explicit prompt, plain text: ``{"prompt": str, "chosen": str, "rejected": str}``: rendered as two
  prompt/completion examples (data.prompt_template, or the chat template when data.chat_template is set);
- explicit prompt, conversations: ``{"prompt": [turns], "chosen": [assistant turn], "rejected": [assistant
  turn]}``: each rendered with the chat template as the prompt's turns followed by the answer;
- implicit prompt: ``{"chosen": [turns], "rejected": [turns]}``: two whole conversations; the prompt is the
  turns they share from the start, and each must end in one assistant turn of its own.

Only the answer is labelled (its end-of-turn marker too, with data.train_on_eos), whatever data.train_on
says: the preference objectives compare the log-probabilities of the two answers given the same prompt.
Both examples of a row are kept or refused together (partrain.data.examples writes them one after the
other; partrain.data.preference_batches keeps them in one microbatch).
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from partrain.data.chat import ChatRenderer, ChatRowError, Example, resolve_template
from partrain.data.chat_labels import chat_example, prompt_completion_example

PAIR_FIELDS = ("chosen", "rejected")


def is_preference_row(row: Any) -> bool:
    """Whether a row holds a preference pair (data.format=auto reads the first row)."""
    return isinstance(row, dict) and all(k in row for k in PAIR_FIELDS)


def has_template(cfg, tokenizer) -> bool:
    """Whether data.chat_template or the tokenizer gives a chat template (cfg: the data block)."""
    try:
        resolve_template(cfg.chat_template, getattr(tokenizer, "chat_template", None))
    except ChatRowError:
        return False
    return True


def preference_pair(row: dict, tokenizer, renderer: Optional[ChatRenderer], cfg) -> Tuple[Example, Example]:
    """(chosen example, rejected example) of one preference row (cfg: the data block); ChatRowError naming the
    rule it breaks. Text answers go through the chat template only when data.chat_template names one, as
    prompt_completion rows do; conversations always."""
    if not isinstance(row.get("chosen"), list) and not cfg.chat_template:
        renderer = None
    return _pair(row, tokenizer, renderer, cfg.prompt_template, cfg.train_on_eos)


def _pair(
    row: dict, tokenizer, renderer: Optional[ChatRenderer], prompt_template: str, train_on_eos: bool
) -> Tuple[Example, Example]:
    missing = [k for k in PAIR_FIELDS if k not in row]
    if missing:
        raise ChatRowError(
            f"the row has no {' or '.join(repr(k) for k in missing)} (fields: {list(row)})", "missing_field"
        )
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise ChatRowError(
                "text answers need a text 'prompt' field (an implicit prompt is read only from conversations)",
                "missing_prompt",
            )
        return tuple(  # type: ignore[return-value]
            prompt_completion_example(tokenizer, prompt, answer, renderer, prompt_template, "completion", train_on_eos)
            for answer in (chosen, rejected)
        )
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise ChatRowError(
            f"'chosen' is a {type(chosen).__name__} and 'rejected' a {type(rejected).__name__}: both must be "
            "strings or both lists of turns",
            "mixed_answers",
        )
    if renderer is None:
        raise ChatRowError("conversation rows need a chat template (data.chat_template)", "no_template")
    prompt, answers = _split_prompt(row.get("prompt"), chosen, rejected)
    return tuple(  # type: ignore[return-value]
        chat_example(renderer, tokenizer, prompt + [answer], "last_turn", None, train_on_eos) for answer in answers
    )


def _split_prompt(prompt: Any, chosen: List[Any], rejected: List[Any]) -> Tuple[List[Any], Tuple[Any, Any]]:
    """(the prompt's turns, (chosen's answer turn, rejected's answer turn)): the explicit prompt, or the
    turns both conversations share from the start."""
    if prompt is None:
        shared = 0
        while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
        if not prompt:
            raise ChatRowError("'chosen' and 'rejected' share no first turn, so there is no prompt", "no_prompt")
    elif isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not isinstance(prompt, list):
        raise ChatRowError(f"field 'prompt' is a {type(prompt).__name__}, not text or a list of turns", "bad_prompt")
    for name, turns in (("chosen", chosen), ("rejected", rejected)):
        if len(turns) != 1 or not isinstance(turns[0], dict) or turns[0].get("role") != "assistant":
            raise ChatRowError(
                f"'{name}' holds {len(turns)} turn(s) after the prompt; one assistant turn is expected",
                "answer_turns",
            )
    return list(prompt), (chosen[0], rejected[0])
