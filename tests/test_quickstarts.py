"""Every command of docs/quickstarts.md runs as written (issue 45), in a folder holding what the page
assumes the user has: `my-model/` (a tiny Llama saved by transformers, with a BPE tokenizer and its
chat template), `chats.jsonl` (chats from `partrain data make-chat`), `corpus/` (text files).
`partrain train` runs in its `--dry-run` form (the GPU recipes need GPUs, and the CPU main job is the
README's to run); every other command runs for real. A command that exits non-zero fails here."""

from __future__ import annotations

import json
import shlex
import sysconfig
from pathlib import Path
from typing import List

import pytest
from conftest import refuse_process_starts

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = DOCS / "quickstarts.md"


def shell_commands(page: Path) -> List[List[str]]:
    """The `partrain` commands of a page's ```bash blocks, `\\` continuations joined, comments dropped."""
    commands, inside, pending = [], False, ""
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = line.strip() == "```bash"
            continue
        if not inside:
            continue
        text = pending + line.split(" #", 1)[0].strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        if text.startswith("partrain "):
            commands.append(shlex.split(text))
    return commands


def as_run_here(args: List[str]) -> List[str]:
    """The command as the suite runs it: `train` always as a dry run."""
    args = args[1:]
    if args[0] == "train" and "--dry-run" not in args:
        args.append("--dry-run")
    return args


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from partrain.data.builtin_chat import chat_rows

    folder = tmp_path_factory.mktemp("user")
    chats = list(chat_rows(6000, seed=3))
    (folder / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    text = [m["content"] for c in chats for m in c["messages"]]
    # A pretraining corpus must fill one global batch of 512 x 8,193 tokens: 8 MB of this Python's sources.
    (folder / "corpus").mkdir()
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    written, part = 0, 0
    while written < 8_000_000 and part * 50 < len(sources):
        chunk = "".join(p.read_text(errors="replace") for p in sources[part * 50 : part * 50 + 50])
        (folder / "corpus" / f"part-{part}.txt").write_text(chunk)
        written, part = written + len(chunk.encode()), part + 1

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    special = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(text, trainer)
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=template
    )
    model = folder / "my-model"
    tokenizer.save_pretrained(model)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
    )
    LlamaForCausalLM(config).save_pretrained(model)
    return folder


def test_the_page_has_the_commands_it_promises():
    names = [" ".join(c[:2]) for c in shell_commands(PAGE)]
    assert names.count("partrain train") >= 6 and "partrain launch" in names, names


@pytest.mark.parametrize("command", shell_commands(PAGE), ids=lambda c: " ".join(c[1:3]))
def test_a_quickstart_command_works_as_written(command, user_folder, monkeypatch):
    from typer.testing import CliRunner

    from partrain.cli import app

    spawned, _ = refuse_process_starts(monkeypatch)
    monkeypatch.chdir(user_folder)
    monkeypatch.setenv("HOME", str(user_folder / "home"))
    monkeypatch.setenv("COLUMNS", "250")
    result = CliRunner().invoke(app, as_run_here(command), catch_exceptions=False)
    assert result.exit_code == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    assert spawned == []
