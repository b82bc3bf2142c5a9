"""Chat templates as fine-tuners bring them (issue 46), checked against transformers itself:

- templates with `{% generation %}` markers: ids and labels equal `apply_chat_template(...,
  return_assistant_tokens_mask=True)` on a real (byte-level BPE) fast tokenizer;
- templates that rewrite earlier turns (a reasoning template in Qwen3's manner: past thinking dropped,
  an empty thinking block on the last turn): labelled from the one whole rendering, and the labels equal
  transformers' mask for the same template with generation markers around each assistant turn;
- modern messages (reasoning_content, tool calls, tool turns, content as parts, a tools list);
- ShareGPT and Alpaca rows read by mapping; data.train_on=last_turn;
- the ids are the inference ids (the tokenizer on the whole rendering), also where BPE merges cross
  turn edges.
"""

from __future__ import annotations

import pytest

from partrain.data.chat import BUILTIN_TEMPLATES, IGNORE_INDEX, ChatRenderer, ChatRowError, detect_format
from partrain.data.chat_labels import assistant_spans, chat_example
from partrain.data.row_layouts import messages_of
from partrain.data.tokenizer import ByteTokenizer, HFTokenizer

CHATML_MARKED = (
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ m.content + '<|im_end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML with the assistant's text and end-of-turn marked (the convention of TRL's test templates)."""

SYSTEM_DEFAULT_MARKED = (
    "{% if messages[0].role != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ m.content | trim }}{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A default system prompt when the row has none, and the content trimmed inside the marked block (in
the manner of SmolLM3's template)."""

LLAMA_MARKED = (
    "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' }}"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ m.content + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def reasoning_template(marked: bool) -> str:
    """A reasoning template in Qwen3's manner (written for this test): assistant turns after the last user
    turn show their thinking (an empty block when they have none); earlier ones lose it. `marked` wraps each
    assistant turn's rendered text in generation markers: transformers' mask of that is the reference."""
    gen, end = ("{% generation %}", "{% endgeneration %}") if marked else ("", "")
    return (
        "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'user' %}"
        "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
        "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n' }}{% for t in tools %}{{ t.function.name + '\\n' }}"
        "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
        "{% for m in messages %}{% set content = m.content if m.content is string else '' %}"
        "{% if m.role == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
        + gen
        + "{% set r = m.reasoning_content or '' %}"
        "{% if loop.index0 > ns.last %}{{ '<think>\\n' + r + '\\n</think>\\n\\n' }}{% endif %}{{ content }}"
        "{% for c in m.tool_calls or [] %}{{ '<tool_call>\\n{\"name\": \"' + c.function.name + '\"}\\n</tool_call>' }}"
        "{% endfor %}{{ '<|im_end|>' }}" + end + "{{ '\\n' }}"
        "{% elif m.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + content }}"
        "{{ '\\n</tool_response><|im_end|>\\n' }}"
        "{% else %}{{ '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


BUILTIN_CHATML = BUILTIN_TEMPLATES["chatml"]

SINGLE = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]
SYSTEM = [{"role": "system", "content": "You are terse."}, *SINGLE]
MULTI = [
    *SYSTEM,
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, of course.", "reasoning_content": "Italy's capital is Rome."},
]
CHATS = {"single": SINGLE, "system": SYSTEM, "multi": MULTI}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
TOOL_CHAT = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "Sunny and 21 C.", "reasoning_content": "The tool said sunny."},
]


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    """A byte-level BPE fast tokenizer with ChatML and Llama-3 turn markers as special tokens, saved as a
    Hugging Face folder: what a fine-tuner's model folder holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    texts = [str(m.get("content")) for chat in CHATS.values() for m in chat] * 20
    texts += ["<think>\n\n</think>\n\n<tool_call> system user assistant tool_response get_weather"] * 20
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    core.train_from_iterator(
        texts, trainers.BpeTrainer(vocab_size=500, special_tokens=specials, initial_alphabet=alphabet)
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>")
    folder = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(folder)
    return folder


def _transformers(folder, template: str, messages, tools=None):
    """transformers' own ids and assistant mask of a conversation under a template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    tok.chat_template = template
    out = tok.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def _ours(folder, template: str, messages, tools=None, train_on="completion"):
    tok = HFTokenizer(folder)
    renderer = ChatRenderer(template, tok.bos_token, tok.eos_token)
    example = chat_example(renderer, tok, messages, train_on, tools)
    mask = [int(label != IGNORE_INDEX) for label in example.labels]
    return example, mask, assistant_spans(renderer, messages, train_on, tools).method


@pytest.mark.parametrize("chat", list(CHATS))
@pytest.mark.parametrize("template", ["chatml", "system-default", "llama3"])
def test_generation_markers_give_exactly_transformers_assistant_mask(template, chat, tokenizer_folder):
    text = {"chatml": CHATML_MARKED, "system-default": SYSTEM_DEFAULT_MARKED, "llama3": LLAMA_MARKED}[template]
    ids, mask = _transformers(tokenizer_folder, text, CHATS[chat])
    example, ours, method = _ours(tokenizer_folder, text, CHATS[chat])
    assert method == "generation"
    assert example.input_ids == ids and ours == mask
    assert [t for t, m in zip(example.input_ids, ours) if m] == [l for l in example.labels if l != IGNORE_INDEX]


@pytest.mark.parametrize("chat", list(CHATS))
def test_a_template_that_rewrites_earlier_turns_is_labelled_from_the_whole_rendering(chat, tokenizer_folder):
    ids, mask = _transformers(tokenizer_folder, reasoning_template(marked=True), CHATS[chat])
    example, ours, method = _ours(tokenizer_folder, reasoning_template(marked=False), CHATS[chat])
    assert example.input_ids == ids, "the ids are those of the whole rendering (what inference sees)"
    assert ours == mask
    # One assistant turn renders the same as a prefix: today's method; the multi-turn chat drops the first
    # turn's thinking block once the second user turn follows, so it is found in the whole rendering.
    assert method == ("search" if chat == "multi" else "prefix")


def test_reasoning_tool_calls_tool_turns_parts_and_tools(tokenizer_folder):
    ids, mask = _transformers(tokenizer_folder, reasoning_template(marked=True), TOOL_CHAT, TOOLS)
    example, ours, method = _ours(tokenizer_folder, reasoning_template(marked=False), TOOL_CHAT, TOOLS)
    assert (example.input_ids, ours) == (ids, mask)  # one user turn: every turn renders as a prefix does
    tok = HFTokenizer(tokenizer_folder)
    trained = tok.decode([t for t, m in zip(example.input_ids, ours) if m])
    assert "get_weather" in trained and "The tool said sunny." in trained and "Sunny and 21 C." in trained
    assert "sunny, 21 C" not in trained, "a tool turn is read, not trained"
    assert "# Tools" in tok.decode(example.input_ids), "the row's tools reach the template"


def test_last_turn_trains_only_the_last_assistant_turn(tokenizer_folder):
    _, ours, _ = _ours(tokenizer_folder, CHATML_MARKED, MULTI, train_on="last_turn")
    example, every, _ = _ours(tokenizer_folder, CHATML_MARKED, MULTI)
    tok = HFTokenizer(tokenizer_folder)
    assert (
        tok.decode([t for t, m in zip(example.input_ids, every) if m]) == "Paris.<|im_end|>Rome, of course.<|im_end|>"
    )
    assert tok.decode([t for t, m in zip(example.input_ids, ours) if m]) == "Rome, of course.<|im_end|>"


def test_ids_are_the_inference_ids_where_merges_cross_turn_edges(tmp_path):
    """Turn markers that are plain text (no special tokens): BPE merges across the turn edges, so cutting
    the text into turns would give other ids; the whole rendering's ids win and labels follow them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    template = (
        "{% for m in messages %}{{ '### ' + m.role + ':' }}{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content + '###' }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
    )
    chat = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "cd"}]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(
        ["### user:ab### assistant:cd###"] * 50, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"])
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="###", unk_token="<unk>")
    fast.save_pretrained(tmp_path)
    ids, mask = _transformers(tmp_path, template, chat)
    example, ours, _ = _ours(tmp_path, template, chat)
    tok = HFTokenizer(tmp_path)
    pieces = tok.encode("### user:ab### assistant:") + tok.encode("cd###")
    assert pieces != ids, "this tokenizer merges across the turn edge (the case the test is about)"
    assert example.input_ids == ids == tok.encode(ChatRenderer(template).render(chat)) and ours == mask


def test_sharegpt_and_alpaca_rows_are_the_chats_they_map_to():
    sharegpt = {
        "system": "You are terse.",
        "conversations": [{"from": "human", "value": "Capital of France?"}, {"from": "gpt", "value": "Paris."}],
    }
    alpaca = {"instruction": "Capital of France?", "input": "", "output": "Paris.", "system": "You are terse."}
    assert detect_format(sharegpt) == "sharegpt" and detect_format(alpaca) == "alpaca"
    assert messages_of(sharegpt, "sharegpt") == SYSTEM == messages_of(alpaca, "alpaca")
    with_input = messages_of({"instruction": "Translate.", "input": "chat", "output": "cat"}, "alpaca")
    assert with_input[0] == {"role": "user", "content": "Translate.\n\nchat"}
    with pytest.raises(ChatRowError, match="has role 'robot'.*data.roles=\\{robot:assistant\\}"):
        messages_of({"conversations": [{"from": "robot", "value": "x"}]}, "sharegpt")
    with pytest.raises(ChatRowError, match="'output' is empty"):
        messages_of({"instruction": "x", "output": ""}, "alpaca")


def test_a_turn_the_rendering_does_not_hold_is_refused_by_name():
    drops_first_answer = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<{{ m.role }}>{{ m.content }}</s>"
        "{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatRowError, match="turn 2: .* does not hold this assistant turn's content"):
        chat_example(ChatRenderer(drops_first_answer), ByteTokenizer(), MULTI)


def test_the_dry_run_reads_sharegpt_rows_and_says_how_a_rewriting_template_was_labelled(cli, tmp_path):
    """`partrain train --dry-run` on ShareGPT rows (detected) with a reasoning template from a file: the
    report names the format and how many rows each labelling method found."""
    import json

    rows = []
    for i in range(40):
        turns = [("human", f"What is {i} + {i}?"), ("gpt", str(2 * i)), ("human", "Sure?"), ("gpt", "Yes.")]
        rows.append({"conversations": [{"from": f, "value": v} for f, v in turns[: 2 if i % 2 else 4]]})
    source = tmp_path / "sharegpt.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    template = tmp_path / "reasoning.jinja"
    template.write_text(reasoning_template(marked=False))
    args = ["recipe=sft-lora", f"data.source={source}", f"data.chat_template={template}", "data.packing=false"]
    args += ["cluster.devices_per_node=1", "parallel.dp=1", "train.seq_len=256", "train.global_batch_size=8"]
    args += ["train.micro_batch_size=8", "data.eval_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}"]
    refused = cli("train", "--dry-run", *args)  # the recipe says data.format=chat
    assert (
        refused.code == 2 and "it reads as sharegpt rows: set data.format=sharegpt" in refused.stdout + refused.stderr
    )
    args.append("data.format=auto")
    ran = cli("train", "--dry-run", "--json", *args)
    assert ran.code == 0, ran.stdout + ran.stderr
    data = json.loads(ran.stdout)["fine_tuning"]["data"]
    assert (data["format"], data["detected"]) == ("sharegpt", True)
    assert data["labelling"] == {"search": 20, "prefix": 20}, "two-turn chats drop the first turn's thinking"
    text = cli("train", "--dry-run", *args)
    assert "labels by search: 20 rows, prefix: 20 rows" in " ".join(text.stdout.split()), text.stdout


def test_a_template_that_refuses_a_conversation_cut_short_is_labelled_by_search():
    """Templates that demand the conversation end with the assistant refuse the prefix renderings; the
    whole conversation renders, so each turn is found in it."""
    strict = "{% if messages[-1].role != 'assistant' %}{{ raise_exception('end with the assistant') }}{% endif %}"
    strict += BUILTIN_CHATML
    example = chat_example(ChatRenderer(strict), ByteTokenizer(), MULTI)
    plain = chat_example(ChatRenderer(BUILTIN_CHATML), ByteTokenizer(), MULTI)
    assert (example.input_ids, example.labels, example.method) == (plain.input_ids, plain.labels, "search")


def test_a_chat_layout_of_its_own_is_read_by_mapping_fields_and_roles():
    """data.messages_field, role_field, content_field and roles: a layout no format names, read as it is."""
    from partrain.data.row_layouts import RowMapping

    row = {"dialog": [{"speaker": "human", "text": "Capital of France?"}, {"speaker": "bot", "text": "Paris."}]}
    mapping = RowMapping("dialog", "speaker", "text", {"human": "user", "bot": "assistant"})
    assert messages_of(row, "chat", mapping) == SINGLE
    with pytest.raises(ChatRowError, match="has role 'bot'.*data.roles=\\{bot:assistant\\}"):
        messages_of(row, "chat", RowMapping("dialog", "speaker", "text", {"human": "user"}))
    with pytest.raises(ChatRowError, match="no 'messages' list .*data.messages_field"):
        messages_of(row, "chat", RowMapping(role_field="speaker"))


def test_train_on_eos_false_leaves_every_end_of_turn_marker_untrained(tokenizer_folder):
    tok = HFTokenizer(tokenizer_folder)
    for template in (CHATML_MARKED, reasoning_template(marked=False), BUILTIN_CHATML):
        renderer = ChatRenderer(template, tok.bos_token, tok.eos_token)
        example = chat_example(renderer, tok, MULTI, train_on_eos=False)
        trained = tok.decode([label for label in example.labels if label != IGNORE_INDEX])
        assert "Paris." in trained and "Rome, of course." in trained and "<|im_end|>" not in trained, trained


def test_mapped_rows_train_through_the_cache_with_the_mapping_in_its_identity(tmp_path):
    """The data path end to end (prepare_examples, as the launch): a layout of its own under data.format=auto,
    and the mapping keys are part of what a resume checks."""
    import json

    from partrain.blueprint.config.compose import compose
    from partrain.data.examples import prepare_examples, rendering_identity

    rows = [
        {"dialog": [{"speaker": "human", "text": f"{i}+{i}?"}, {"speaker": "bot", "text": str(2 * i)}]}
        for i in range(8)
    ]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    overrides = [f"data.source={source}", "data.format=auto", "data.chat_template=chatml", "data.messages_field=dialog"]
    overrides += ["data.role_field=speaker", "data.content_field=text", "data.roles={human:user,bot:assistant}"]
    cfg = compose(overrides + [f"data.cache_dir={tmp_path / 'cache'}"]).data
    examples = prepare_examples(cfg)
    assert examples.n_examples == 8 and examples.labelling == {"prefix": 8}
    tok = ByteTokenizer()
    first = examples.ids[examples.offsets[0] : examples.offsets[1]].tolist()
    assert tok.decode(first) == "<|im_start|>user\n0+0?<|im_end|>\n<|im_start|>assistant\n0<|im_end|>\n"
    assert {"data.roles", "data.messages_field", "data.train_on_eos"} <= set(rendering_identity(cfg, "chat", "byte"))


def test_the_mapping_command_of_data_formats_md_runs_as_written(cli, tmp_path):
    """docs/data-formats.md's command for a layout of its own, as a dry run on rows of that layout."""
    import json
    import re
    import shlex
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "data-formats.md").read_text()
    block = re.search(r"For rows like.*?```bash\n(.*?)```", page, re.S).group(1)
    args = shlex.split(block.replace("\\\n", " "))
    assert args[:2] == ["partrain", "train"]
    question = "Please add these two numbers and answer with the sum only: {0} plus {0}, thank you kindly."
    turns = [[("human", question.format(i)), ("bot", f"The sum is {2 * i}, as asked.")] for i in range(1000)]
    rows = [{"dialog": [{"speaker": who, "text": text} for who, text in chat]} for chat in turns]
    source = tmp_path / "rows.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [f"data.source={source}" if a == "data.source=rows.jsonl" else a for a in args[2:]]
    ran = cli("train", "--dry-run", "--json", *args)
    assert ran.code == 0, ran.stdout + ran.stderr
    data = json.loads(ran.stdout)["fine_tuning"]["data"]
    assert (
        data["format"] == "chat" and sum(data["labelling"].values()) == data["examples_train"] + data["examples_eval"]
    )
