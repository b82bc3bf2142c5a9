"""Fine-tuning examples: chat and prompt/completion rows rendered into token ids and labels.

One example becomes ``(input_ids, labels)``, aligned as Hugging Face aligns them: ``labels[t]`` is
``input_ids[t]`` where the loss is taken and IGNORE_INDEX (-100) where it is not; the shift by one
happens in the loss. With ``train_on="completion"`` (the default) the labels are the assistant
turns only: their content and the template's end-of-turn token, every assistant turn of a multi-turn
chat; system and user turns and the template's scaffolding (role headers, BOS) are not trained.
``train_on="all"`` trains every token.

Which tokens are the assistant's: partrain.data.chat_labels renders the conversation once, whole,
finds its trained character spans (generation markers, prefix renderings, or a search of the whole
rendering) and labels the whole text's tokens by their offsets. ``train_on="last_turn"`` trains the
last assistant turn only.

Templates: the tokenizer's own ``chat_template``, or ``data.chat_template`` = a built-in name
(BUILTIN_TEMPLATES) or a file holding a Jinja template. They are rendered here in a sandboxed Jinja
environment with the same conventions as ``transformers``' ``apply_chat_template`` (``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools``, ``raise_exception``, and the
``{% generation %}`` tag), so a template
written for transformers renders the same text, also for partrain's byte tokenizer, which has none.

Rows are checked before anything is rendered (``check_messages``): each problem names the rule, and
the reader that found the row adds its file and line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union

from partrain.blueprint.validate_data_format import MESSAGE_ROLES

IGNORE_INDEX = -100
"""Label of a token that takes no loss (the value torch's cross_entropy and Hugging Face ignore)."""

ROLES = MESSAGE_ROLES
"""The roles a chat row may use; a system turn may only come first. Only assistant turns are trained
(a tool turn is the result a tool call returned, which the model reads)."""

TRAIN_ON = ("completion", "last_turn", "all")
"""data.train_on: every assistant turn (TRL's assistant_only_loss), the last assistant turn only, or
every token."""

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML (Qwen, many fine-tunes): <|im_start|>role, newline, content, <|im_end|>."""

LLAMA3 = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
"""Llama 3's header/eot layout (without its tool-calling and date preamble)."""

ZEPHYR = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""Zephyr's <|role|> layout, each turn closed by the tokenizer's EOS token."""

BUILTIN_TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "zephyr": ZEPHYR}
"""data.chat_template names that need no file."""


class ChatRowError(ValueError):
    """A row that cannot be rendered; the message is the rule it breaks (the reader names file and line).
    ``rule`` is its short name: data.skip_bad_rows counts skipped rows per rule."""

    def __init__(self, message: str, rule: str = "bad_row"):
        super().__init__(message)
        self.rule = rule


@dataclass(frozen=True)
class Example:
    """One tokenized training example: ids and their aligned labels (IGNORE_INDEX = no loss)."""

    input_ids: List[int]
    labels: List[int]
    method: str = ""
    """How a chat's trained text was found (partrain.data.chat_labels.LABELLING_METHODS); "" otherwise."""

    @property
    def trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


Piece = Union[str, List[int]]
"""Text to tokenize, or ids already (an EOS the tokenizer has no text for)."""


def check_messages(messages: Any) -> List[dict]:
    """The conversation as a list of turns; ChatRowError naming the first rule broken. Content is a
    string or a list of parts (``{"type": "text", "text": ...}``); an assistant turn may hold
    ``tool_calls`` (then its content may be empty) and ``reasoning_content``. Every key of a turn is
    passed on to the template, which decides what it renders."""
    if not isinstance(messages, list):
        raise ChatRowError(f"'messages' must be a list of turns, not a {type(messages).__name__}", "not_a_list")
    if not messages:
        raise ChatRowError("the conversation is empty", "empty_conversation")
    for i, turn in enumerate(messages):
        _check_turn(i, turn)
    if not any(turn["role"] == "assistant" for turn in messages):
        raise ChatRowError(
            "the conversation has no assistant turn, so nothing in it would be trained", "no_assistant_turn"
        )
    return [dict(t) for t in messages]


def _check_turn(i: int, turn: Any) -> None:
    if not isinstance(turn, dict):
        raise ChatRowError(
            f"turn {i} is a {type(turn).__name__}, not an object with 'role' and 'content'", "not_an_object"
        )
    calls = turn.get("role") == "assistant" and bool(turn.get("tool_calls"))
    missing = [k for k in ("role", "content") if k not in turn and not (k == "content" and calls)]
    if missing:
        raise ChatRowError(
            f"turn {i} has no {' or '.join(repr(k) for k in missing)} (keys: {sorted(turn)})", "no_role_or_content"
        )
    if turn["role"] not in ROLES:
        raise ChatRowError(f"turn {i} has role {turn['role']!r}; roles are {', '.join(ROLES)}", "unknown_role")
    content = turn.get("content")
    if not (isinstance(content, str) or _is_parts(content) or (calls and content is None)):
        raise ChatRowError(
            f"turn {i}: content is a {type(content).__name__}, not a string or a list of "
            '{"type": "text", "text": ...} parts',
            "not_a_string",
        )
    if turn["role"] == "system" and i > 0:
        raise ChatRowError(
            f"turn {i} is a system turn after the start; a system turn may only come first", "system_not_first"
        )


def _is_parts(content: Any) -> bool:
    return isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in content)


def resolve_template(spec: str, tokenizer_template: Optional[str]) -> str:
    """The Jinja text of ``data.chat_template`` (a built-in name or a file), else the tokenizer's own.
    ChatRowError when there is none; the config layer turns that into an exit 2 with the fix."""
    if spec:
        if spec in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[spec]
        path = Path(spec).expanduser()
        if path.is_file():
            return path.read_text()
        raise ChatRowError(
            f"data.chat_template={spec!r} is neither a built-in ({', '.join(BUILTIN_TEMPLATES)}) nor a file"
        )
    if tokenizer_template:
        return tokenizer_template
    raise ChatRowError(
        "the tokenizer has no chat template; set data.chat_template to one of "
        f"{', '.join(BUILTIN_TEMPLATES)} or to a Jinja file"
    )


def _environment(marks: "_GenerationMarks"):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ChatRowError(f"the chat template refused the conversation: {message}", "template_refused")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", marks.extension()]
    )
    env.globals["raise_exception"] = raise_exception
    return env


class _GenerationMarks:
    """``{% generation %}`` ... ``{% endgeneration %}``: records where each marked block's text lands in the
    output (transformers' AssistantTracker convention), while the renderer counts what it has emitted."""

    def __init__(self):
        self.spans: List[Tuple[int, int]] = []
        self.emitted = 0

    def extension(self):
        from jinja2 import nodes
        from jinja2.ext import Extension

        marks = self

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_marked", []), [], [], body).set_lineno(lineno)

            def _marked(self, caller):
                text = caller()
                marks.spans.append((marks.emitted, marks.emitted + len(text)))
                return text

        return Generation


GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")
"""A template's `{% generation %}` tag (its marks then say what is trained)."""

END_PROBE = "\u2063PARTRAIN-END-PROBE\u2063"
"""Assistant text rendered once to learn what the template writes after an assistant turn."""


class ChatRenderer:
    """Renders conversations with one template and the tokenizer's special-token texts."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = ""):
        from jinja2 import TemplateError

        self._marks = _GenerationMarks()
        try:
            self._template = _environment(self._marks).from_string(template)
        except TemplateError as exc:
            raise ChatRowError(f"the chat template does not parse: {exc}") from None
        self.has_generation_marks = bool(GENERATION_TAG.search(template))
        self.bos_token, self.eos_token = bos_token, eos_token
        self._end_of_turn: Optional[str] = None

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False, tools=None) -> str:
        return self.render_marked(messages, add_generation_prompt, tools)[0]

    def render_marked(
        self, messages: Sequence[dict], add_generation_prompt: bool = False, tools=None
    ) -> Tuple[str, List[Tuple[int, int]]]:
        """The text and the character spans the template marked with {% generation %}."""
        from jinja2 import TemplateError

        self._marks.spans, self._marks.emitted = [], 0
        out: List[str] = []
        variables = dict(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        if tools is not None:
            variables["tools"] = tools
        try:
            for block in self._template.generate(**variables):
                out.append(block)
                self._marks.emitted += len(block)
        except TemplateError as exc:
            raise ChatRowError(f"the chat template failed on this conversation: {exc}", "template_refused") from None
        return "".join(out), list(self._marks.spans)

    def end_of_turn(self) -> str:
        """What the template writes right after an assistant's text ("<|im_end|>", "<|eot_id|>"), learnt
        from one probe rendering; "" when the probe fails or nothing follows."""
        if self._end_of_turn is None:
            probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": END_PROBE}]
            try:
                text = self.render(probe)
            except ChatRowError:
                text = ""
            after = text.split(END_PROBE, 1)[1] if END_PROBE in text else ""
            self._end_of_turn = after.strip().split("\n", 1)[0].strip() if after.strip() else ""
        return self._end_of_turn


def tokenize_pieces(tokenizer, pieces: Sequence[Tuple[Piece, bool]], train_on: str = "completion") -> Example:
    """Ids and labels of (piece, trained) pieces, each piece tokenized on its own without special tokens."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"train_on must be one of {TRAIN_ON}, not {train_on!r}")
    ids: List[int] = []
    labels: List[int] = []
    for piece, trained in pieces:
        piece_ids = [int(i) for i in piece] if isinstance(piece, list) else tokenizer.encode(piece)
        ids += piece_ids
        labels += piece_ids if (trained or train_on == "all") else [IGNORE_INDEX] * len(piece_ids)
    return Example(ids, labels)


def tokenized_example(row: dict, vocab_size: int) -> Example:
    """A pre-tokenized row: ``input_ids`` and optionally ``labels`` (the same length; -100 = no loss)."""
    ids = row.get("input_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ChatRowError("field 'input_ids' must be a non-empty list of integers", "bad_input_ids")
    if any(i < 0 or i >= vocab_size for i in ids):
        raise ChatRowError(f"field 'input_ids' holds ids outside the tokenizer's 0..{vocab_size - 1}", "bad_input_ids")
    labels = row.get("labels", ids)
    if not isinstance(labels, list) or len(labels) != len(ids) or not all(isinstance(i, int) for i in labels):
        raise ChatRowError("field 'labels' must be a list of integers as long as 'input_ids'", "bad_labels")
    return Example(list(ids), list(labels))


FORMATS = ("text", "chat", "sharegpt", "alpaca", "prompt_completion", "tokenized")
"""data.format values besides auto."""


def detect_format(row: Any) -> str:
    """The format a row is written in, from its fields (data.format=auto reads the first row)."""
    if isinstance(row, dict):
        if "messages" in row:
            return "chat"
        if isinstance(row.get("conversations"), list):
            return "sharegpt"
        if "chosen" in row and "rejected" in row:
            return "preference"
        if "instruction" in row and "output" in row:
            return "alpaca"
        if "prompt" in row and "completion" in row:
            return "prompt_completion"
        if "input_ids" in row:
            return "tokenized"
    return "text"
