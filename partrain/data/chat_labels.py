"""Which characters of a rendered conversation are trained, and which tokens they become.

A conversation is rendered once, whole, with its chat template: that text is what the model sees at
inference, and its tokens are the example's ids. The trained spans of that text come from one of
three methods, tried in this order (`LABELLING_METHODS`):

- ``generation``: the template marks the assistant's text itself with ``{% generation %}`` ...
  ``{% endgeneration %}`` (transformers' convention for ``return_assistant_tokens_mask``, which TRL's
  ``assistant_only_loss`` relies on). The marked spans are trained, exactly as transformers masks them.
- ``prefix``: the first i messages rendered with the generation prompt end where assistant turn i
  starts; the first i+1 rendered without it end where that turn ends. Works for every template that
  renders earlier turns the same once later ones follow.
- ``search``: for templates that rewrite earlier turns (drop past reasoning, add an empty thinking
  block to the last turn, move the system prompt), each assistant message is located in the whole
  rendering: its content (or its reasoning, or its tool call's name) after the previous turn, back to
  the end of the assistant header the template writes, forward through the template's end-of-turn
  marker. A turn whose text the rendering does not hold is refused, named.

Tokens: the whole text is tokenized once with character offsets (fast HF tokenizers and the byte
tokenizer have them); a token is trained when it overlaps a trained span, from the token holding a
span's first character through the one holding its last, as transformers' assistant mask. A tokenizer
without offsets tokenizes span by span (the pieces end at turn markers, where merges do not cross).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from partrain.data.chat import (
    IGNORE_INDEX,
    TRAIN_ON,
    ChatRenderer,
    ChatRowError,
    Example,
    Piece,
    check_messages,
    tokenize_pieces,
)

LABELLING_METHODS = ("generation", "prefix", "search")
"""How a conversation's trained spans were found, in the order they are tried."""

Span = Tuple[int, int]
"""[start, end) character offsets into the rendered text."""


@dataclass(frozen=True)
class Labelled:
    """A rendered conversation and the character spans of it that are trained."""

    text: str
    spans: List[Span]
    method: str
    """One of LABELLING_METHODS."""


class _PrefixMismatch(Exception):
    """The template renders earlier turns differently once later ones follow."""


def assistant_spans(
    renderer: ChatRenderer, messages: Sequence[dict], train_on: str = "completion", tools=None
) -> Labelled:
    """The whole rendering and its trained spans (every assistant turn, or the last with
    train_on=last_turn); ``tools``: the row's tool definitions, passed to the template."""
    whole, marked = renderer.render_marked(messages, tools=tools)
    render = _Render(renderer, tools)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if renderer.has_generation_marks:
        if not marked:
            raise ChatRowError(
                "the chat template marks no text of this conversation with {% generation %}", "template_refused"
            )
        spans, method = [s for s in marked if s[1] > s[0]], "generation"
        if train_on == "last_turn":
            spans = spans[-1:]
        return Labelled(whole, spans, method)
    try:
        spans = [_prefix_span(render, messages, i, whole) for i in assistant]
        method = "prefix"
    except (_PrefixMismatch, ChatRowError):  # a template may also refuse a conversation cut short
        spans = _searched_spans(render, messages, assistant, whole)
        method = "search"
    done = 0
    for i, (start, end) in zip(assistant, spans):
        if start < done or end <= start:
            raise ChatRowError(
                f"turn {i}: the chat template renders no text of its own for this assistant turn", "template_refused"
            )
        done = end
    return Labelled(whole, spans[-1:] if train_on == "last_turn" else spans, method)


@dataclass(frozen=True)
class _Render:
    """One row's renderings: the renderer with the row's tools."""

    renderer: ChatRenderer
    tools: object

    def __call__(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        return self.renderer.render(messages, add_generation_prompt, self.tools)


def _prefix_span(render: _Render, messages: Sequence[dict], i: int, whole: str) -> Span:
    start = _prefix_length(render(messages[:i], add_generation_prompt=True), whole)
    end = _prefix_length(render(messages[: i + 1]), whole)
    return start, start + len(whole[start:end].rstrip())  # the newline after an end-of-turn is scaffolding


def _prefix_length(text: str, whole: str) -> int:
    if not whole.startswith(text):
        raise _PrefixMismatch
    return len(text)


def _searched_spans(render: _Render, messages: Sequence[dict], assistant: List[int], whole: str) -> List[Span]:
    end_of_turn = render.renderer.end_of_turn()
    spans, cursor = [], 0
    for i in assistant:
        anchor, what = _anchor(messages[i])
        at = whole.find(anchor, cursor) if anchor else -1
        if at < 0:
            raise ChatRowError(
                f"turn {i}: the chat template's rendering of the conversation does not hold this assistant turn's "
                f"{what} (the template drops or rewrites it), so its tokens cannot be labelled",
                "template_refused",
            )
        header = _assistant_header(render, messages[:i])
        opened = whole.rfind(header, cursor, at) if header else -1
        start = opened + len(header) if opened >= 0 else at
        end = _end_of_turn(whole, at + len(anchor), end_of_turn, messages[i])
        spans.append((start, end))
        cursor = end
    return spans


def _anchor(message: dict) -> Tuple[str, str]:
    """The text of an assistant message that its rendering must hold, and what it is (for the error)."""
    content = content_text(message.get("content"))
    if content.strip():
        return content.strip(), "content"
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning.strip():
        return reasoning.strip(), "reasoning"
    for call in message.get("tool_calls") or []:
        name = (call.get("function") or {}).get("name") if isinstance(call, dict) else None
        if isinstance(name, str) and name:
            return name, "tool call"
    return "", "content"


def _end_of_turn(whole: str, end: int, end_of_turn: str, message: dict) -> int:
    """Past the message's own text through the template's end-of-turn marker, when only whitespace (or
    the message's tool calls, which templates render after the content) lies between."""
    at = whole.find(end_of_turn, end) if end_of_turn else -1
    if at >= 0 and (not whole[end:at].strip() or message.get("tool_calls")):
        return at + len(end_of_turn)
    return end


def _assistant_header(render: _Render, before: Sequence[dict]) -> str:
    """What the generation prompt adds after these messages ("<|im_start|>assistant\\n"), or ""."""
    if not before:
        return ""
    try:
        prompt = render(before, add_generation_prompt=True)
        plain = render(before)
    except ChatRowError:  # the template refuses the conversation cut here: the turn starts at its text
        return ""
    return prompt[len(plain) :] if prompt.startswith(plain) and len(prompt) > len(plain) else ""


def content_text(content) -> str:
    """A message's content as text: a string, or the text parts of a list of parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def labelled_example(tokenizer, labelled: Labelled, train_on: str = "completion") -> Example:
    """Ids of the whole rendering and their labels: trained where a token overlaps a trained span."""
    encode = getattr(tokenizer, "encode_with_offsets", None)
    got = encode(labelled.text) if encode is not None else None
    if got is None:
        pieces = tokenize_pieces(tokenizer, _pieces(labelled), "all" if train_on == "all" else "completion")
        return Example(pieces.input_ids, pieces.labels, labelled.method)
    ids, offsets = got
    if train_on == "all":
        return Example(list(ids), list(ids), labelled.method)
    trained = [False] * len(ids)
    k = 0  # one pass: spans are in order, and so are the tokens' offsets
    for start, end in labelled.spans:
        while k < len(offsets) and offsets[k][1] <= start:
            k += 1
        first = k
        while k < len(offsets) and offsets[k][0] < end:
            trained[k] = True
            k += 1
        k = max(first, k - 1)  # a token straddling two spans belongs to both
    return Example(list(ids), [t if on else IGNORE_INDEX for t, on in zip(ids, trained)], labelled.method)


def _pieces(labelled: Labelled) -> List[Tuple[str, bool]]:
    out, done = [], 0
    for start, end in labelled.spans:
        out += [(labelled.text[done:start], False), (labelled.text[start:end], True)]
        done = end
    out.append((labelled.text[done:], False))
    return [(text, trained) for text, trained in out if text]


def chat_example(
    renderer: ChatRenderer,
    tokenizer,
    messages: Any,
    train_on: str = "completion",
    tools=None,
    train_on_eos: bool = True,
) -> Example:
    """A chat row's example (``messages`` as read from the row; checked first): the whole rendering's
    tokens, labelled where its trained spans are (without each turn's end-of-turn marker when
    ``train_on_eos`` is false)."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, not {train_on!r}")
    labelled = assistant_spans(renderer, check_messages(messages), train_on, tools)
    if not train_on_eos:
        labelled = without_end_of_turn(labelled, renderer.end_of_turn())
    return labelled_example(tokenizer, labelled, train_on)


def without_end_of_turn(labelled: Labelled, end_of_turn: str) -> Labelled:
    """The spans with the end-of-turn marker each ends with left out (data.train_on_eos=false)."""
    spans = []
    for start, end in labelled.spans:
        text = labelled.text[start:end].rstrip()
        if end_of_turn and text.endswith(end_of_turn):
            text = text[: -len(end_of_turn)].rstrip()
        spans.append((start, start + len(text)))
    return Labelled(labelled.text, [s for s in spans if s[1] > s[0]], labelled.method)


def prompt_completion_example(
    tokenizer,
    prompt: Any,
    completion: Any,
    renderer: Optional[ChatRenderer] = None,
    prompt_template: str = "",
    train_on: str = "completion",
    train_on_eos: bool = True,
) -> Example:
    """A prompt/completion row's example: through the chat template as one user and one assistant
    turn when a renderer is given, else ``prompt_template`` (``{prompt}`` replaced; the prompt alone
    when empty) followed by the completion and the tokenizer's EOS, the completion and EOS trained."""
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, str):
            raise ChatRowError(f"field {name!r} is a {type(value).__name__}, not a string", "not_a_string")
    if not completion:
        raise ChatRowError("field 'completion' is empty, so nothing in this row would be trained", "empty_completion")
    if renderer is not None:
        turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        return chat_example(renderer, tokenizer, turns, train_on, None, train_on_eos)
    if prompt_template and "{prompt}" not in prompt_template:
        raise ChatRowError(f"data.prompt_template={prompt_template!r} has no {{prompt}} placeholder")
    head = prompt_template.replace("{prompt}", prompt) if prompt_template else prompt
    bos = [int(tokenizer.bos_id)] if getattr(tokenizer, "bos_id", None) is not None else []
    eos = [int(tokenizer.eos_id)]
    pieces: List[Tuple[Piece, bool]] = [(bos, False), (head, False), (completion, True), (eos, train_on_eos)]
    return tokenize_pieces(tokenizer, [(p, t) for p, t in pieces if p], train_on)
