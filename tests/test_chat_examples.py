"""Fine-tuning examples (partrain/data/chat.py): labels exactly on the assistant's tokens, for every
assistant turn, with system turns, under several templates and two tokenizers."""

from __future__ import annotations

import pytest

from partrain.data.chat import (
    BUILTIN_TEMPLATES,
    IGNORE_INDEX,
    ChatRenderer,
    ChatRowError,
    check_messages,
    detect_format,
    resolve_template,
    tokenized_example,
)
from partrain.data.chat_labels import chat_example, prompt_completion_example
from partrain.data.tokenizer import ByteTokenizer

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome."},
]

END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "zephyr": ""}


def _trained_runs(example) -> list:
    """The trained token ids, one list per contiguous run."""
    runs, current = [], []
    for token, label in zip(example.input_ids, example.labels):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == token, "labels are aligned with input_ids (the shift happens in the loss)"
            current.append(token)
    return runs + ([current] if current else [])


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_every_assistant_turn_and_its_end_of_turn_is_trained_nothing_else(name):
    tok = ByteTokenizer()
    example = chat_example(ChatRenderer(BUILTIN_TEMPLATES[name]), tok, CHAT)
    runs = [tok.decode(run) for run in _trained_runs(example)]
    assert runs == [f"Paris.{END_OF_TURN[name]}", f"Rome.{END_OF_TURN[name]}"]
    whole = ChatRenderer(BUILTIN_TEMPLATES[name]).render(CHAT)
    assert tok.decode(example.input_ids) == whole, "the pieces put together are the whole rendered conversation"
    everything = chat_example(ChatRenderer(BUILTIN_TEMPLATES[name]), tok, CHAT, train_on="all")
    assert everything.labels == everything.input_ids


@pytest.fixture(scope="module")
def hf_chat_tokenizer(tmp_path_factory):
    """A BPE tokenizer with special turn tokens, a BOS it adds itself and its own (Llama-3-like) template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from partrain.data.tokenizer import HFTokenizer

    specials = ["<unk>", "<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    text = [m["content"] for m in CHAT] * 20 + ["system user assistant header"] * 20
    core.train_from_iterator(text, trainers.BpeTrainer(vocab_size=400, special_tokens=specials))
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = BUILTIN_TEMPLATES["llama3"]
    folder = tmp_path_factory.mktemp("chat-tok")
    fast.save_pretrained(folder)
    return HFTokenizer(folder)


def test_an_hf_tokenizer_with_its_own_template_and_bos(hf_chat_tokenizer):
    tok = hf_chat_tokenizer
    assert tok.bos_id == 1 and tok.chat_template
    renderer = ChatRenderer(resolve_template("", tok.chat_template), tok.bos_token, tok.eos_token)
    example = chat_example(renderer, tok, CHAT)
    eot = tok.encode("<|eot_id|>")
    assert len(eot) == 1, "turn markers are single special tokens"
    assert example.input_ids[0] == tok.bos_id and example.labels[0] == IGNORE_INDEX
    runs = _trained_runs(example)
    assert [run[-1:] for run in runs] == [eot, eot]
    assert [tok.decode(run[:-1]) for run in runs] == ["Paris.", "Rome."]
    # Piecewise tokenization gives the ids of the whole text: no merge crosses a turn boundary.
    assert example.input_ids == tok.encode(renderer.render(CHAT))


def test_prompt_completion_through_the_template_or_plain(hf_chat_tokenizer):
    tok = hf_chat_tokenizer
    renderer = ChatRenderer(tok.chat_template, tok.bos_token, tok.eos_token)
    templated = prompt_completion_example(tok, "Capital of France?", "Paris.", renderer=renderer)
    assert [tok.decode(run) for run in _trained_runs(templated)] == ["Paris.<|eot_id|>"]
    plain = prompt_completion_example(tok, "Capital of France?", " Paris.", prompt_template="Q: {prompt}\nA:")
    assert plain.input_ids[0] == tok.bos_id and plain.input_ids[-1] == tok.eos_id
    (run,) = _trained_runs(plain)
    assert run[-1] == tok.eos_id and tok.decode(run[:-1]) == " Paris."
    byte = prompt_completion_example(ByteTokenizer(), "2+2=", "4")
    assert byte.input_ids == list(b"2+2=4") + [0] and byte.labels == [IGNORE_INDEX] * 4 + [ord("4"), 0]


@pytest.mark.parametrize(
    "messages, words",
    [
        ([], "empty"),
        ("hello", "must be a list"),
        ([{"role": "user"}], "has no 'content'"),
        ([{"content": "x"}], "has no 'role'"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": "user", "content": ["x"]}], "content is a list"),
        ([{"role": "user", "content": "x"}], "no assistant turn"),
        ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "system turn after the start"),
    ],
)
def test_malformed_conversations_name_the_rule(messages, words):
    with pytest.raises(ChatRowError, match=words):
        check_messages(messages)


def test_templates_that_cannot_be_split_or_found_are_refused(tmp_path):
    # A template that drops earlier assistant turns once a later one follows (as reasoning templates do).
    forgetful = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}{{ m.content }}|{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatRowError, match="turn 2: .* does not hold this assistant turn's content"):
        chat_example(ChatRenderer(forgetful), ByteTokenizer(), CHAT)
    with pytest.raises(ChatRowError, match="no chat template"):
        resolve_template("", None)
    with pytest.raises(ChatRowError, match="neither a built-in"):
        resolve_template("nope", None)
    file = tmp_path / "t.jinja"
    file.write_text(BUILTIN_TEMPLATES["chatml"])
    assert resolve_template(str(file), None) == BUILTIN_TEMPLATES["chatml"]


def test_formats_and_tokenized_rows():
    assert detect_format({"messages": []}) == "chat"
    assert detect_format({"prompt": "a", "completion": "b"}) == "prompt_completion"
    assert detect_format({"input_ids": [1]}) == "tokenized"
    assert detect_format({"text": "x"}) == "text"
    row = tokenized_example({"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, vocab_size=10)
    assert row.trained_tokens == 2
    with pytest.raises(ChatRowError, match="outside"):
        tokenized_example({"input_ids": [5, 60]}, vocab_size=10)
    with pytest.raises(ChatRowError, match="as long as"):
        tokenized_example({"input_ids": [5, 6], "labels": [5]}, vocab_size=10)
