"""The commands a docs page gives a user, and the folder a user running them would have (shared by
test_quickstarts.py and test_doc_commands.py)."""

from __future__ import annotations

import json
import shlex
import sysconfig
from pathlib import Path
from typing import List


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
        text = text.rsplit("&& ", 1)[-1]  # `pip install ... && partrain train ...`: the partrain part
        if text.startswith("partrain "):
            commands.append(shlex.split(text))
    return commands


def as_run_here(args: List[str]) -> List[str]:
    """The command as the suite runs it: `train` always as a dry run."""
    args = args[1:]
    if args[0] == "train" and "--dry-run" not in args:
        args.append("--dry-run")
    return args


def make_user_folder(folder: Path, corpus: bool = True) -> Path:
    """`folder` filled with what the docs assume a user has: `my-model/` (a tiny Llama saved by transformers,
    with a BPE tokenizer and its chat template), `chats.jsonl`, and with `corpus`, `corpus/` (8 MB of text
    files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from partrain.data.builtin_chat import chat_rows

    chats = list(chat_rows(6000, seed=3))
    (folder / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    text = [m["content"] for c in chats for m in c["messages"]]
    # A pretraining corpus must fill one global batch of 512 x 8,193 tokens: 8 MB of this Python's sources.
    (folder / "corpus").mkdir()
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")) if corpus else []
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
