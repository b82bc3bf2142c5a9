"""A pretrained folder taken as it is: with `model.pretrained=DIR`, DIR's `config.json` is the model.

Without this rule the model group's YAML (gpt2-tiny by default) would lay its size keys over DIR's
config and every fine-tune would have to restate them; and the byte tokenizer would silently train a
model on tokens it has never seen. So, at composition:

- the model group's `config` keys do not apply: `model.config` keeps only the keys given on the
  command line or in the recipe (the user's deliberate overrides, which the report names);
- `model.arch` is DIR's `model_type` unless given on the command line or in the recipe (a mismatch
  is then refused by partrain.blueprint.model_facts, naming both);
- `model.name` is DIR's folder name (or the Hub id) unless given;
- `data.tokenizer=auto` (the default) becomes DIR when DIR holds a tokenizer, else `byte`.

Built from config instead (no model.pretrained) with a Hugging Face tokenizer folder, the model's
`vocab_size` follows the tokenizer (its largest id + 1, rounded up to a multiple of
VOCAB_MULTIPLE as Megatron pads it, so that tensor parallelism divides it) unless given on the command
line or in the recipe: the model group's 256 was written for the byte tokenizer. Likewise its
maximum positions (n_positions / max_position_embeddings, where the model group sets them) grow to
train.seq_len unless given, as Megatron-LM's --max-position-embeddings defaults to --seq-length: a
model group's 512 is a size for its CPU recipes, not a limit the user chose.

A Hub id is only a folder after `partrain.preflight.hub.resolve_hub_ids`: composition leaves its arch
empty and its tokenizer `auto`, and that step calls `adopt_pretrained` again once the folder exists.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Collection, Optional

from partrain.blueprint.config.paths import is_there
from partrain.errors import ConfigError, Problem

AUTO_TOKENIZER = "auto"
"""The `data.tokenizer` value that means "the model's own": model.pretrained's tokenizer, else byte."""

BYTE_TOKENIZER = "byte"

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
"""Any of these in a pretrained folder means it ships its tokenizer (fast, sentencepiece, BPE, tiktoken)."""


VOCAB_MULTIPLE = 128
"""A vocabulary that follows its tokenizer is padded to a multiple of this (Megatron's
make-vocab-size-divisible-by): every tp up to 128 divides it, and matmuls keep aligned shapes."""


def has_tokenizer(folder: str) -> bool:
    """Whether a local folder ships tokenizer files."""
    path = Path(folder).expanduser()
    return is_there(path, "dir") and any(is_there(path / name, "file") for name in TOKENIZER_FILES)


def _stored_model_type(folder: str) -> Optional[str]:
    """DIR's config.json model_type, or None when the folder or file cannot be read (the model facts
    report that with the file's name; this step only fills in what it can)."""
    try:
        stored = json.loads((Path(folder).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = stored.get("model_type") if isinstance(stored, dict) else None
    return str(value) if value else None


def pretrained_name(spec: str) -> str:
    """A display name for a pretrained folder or Hub id: its last path part, revision dropped."""
    return Path(spec.split("@", 1)[0].rstrip("/")).name or spec


def tokenizer_vocab_size(folder: str) -> Optional[int]:
    """The largest token id + 1 of a local tokenizer folder, read from tokenizer.json (or vocab.json)
    without loading the tokenizer; None when neither reads (a sentencepiece-only folder: the launch's
    preflight then compares the loaded tokenizer with the model)."""
    path = Path(folder).expanduser()
    ids: list = []
    try:
        if (path / "tokenizer.json").is_file():
            spec = json.loads((path / "tokenizer.json").read_text())
            vocab = (spec.get("model") or {}).get("vocab") or {}
            ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))  # Unigram: a list
            ids += [t.get("id", 0) for t in spec.get("added_tokens") or []]
        elif (path / "vocab.json").is_file():
            ids = list(json.loads((path / "vocab.json").read_text()).values())
    except (OSError, ValueError, AttributeError):
        return None
    ints = [i for i in ids if isinstance(i, int)]
    return max(ints) + 1 if ints else None


def _vocab_following_tokenizer(run, explicit_model_keys: Collection[str]):
    """Built from config with an HF tokenizer folder: model.config.vocab_size from the tokenizer (see the
    module docstring), unless the command line or the recipe gave it."""
    tokenizer = run.data.tokenizer
    given = {"model.config.vocab_size", "model.config"} & set(explicit_model_keys)
    if run.model.pretrained or given:
        return run
    if tokenizer in (AUTO_TOKENIZER, BYTE_TOKENIZER) or not is_there(tokenizer, "dir"):
        return run
    size = tokenizer_vocab_size(tokenizer)
    if size is None:
        return run
    padded = -(-size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    model = dataclasses.replace(run.model, config={**run.model.config, "vocab_size": padded})
    return dataclasses.replace(run, model=model)


POSITION_KEYS = ("n_positions", "max_position_embeddings", "n_ctx")
"""HF config keys that size the position table or rotary range (GPT-2 and the Llama family)."""


def _positions_following_seq_len(run, explicit_model_keys: Collection[str]):
    """Built from config: the model group's maximum positions below train.seq_len grow to it (see the
    module docstring); keys given on the command line or in the recipe stay the user's."""
    if run.model.pretrained or "model.config" in explicit_model_keys:
        return run
    config = dict(run.model.config)
    for key in POSITION_KEYS:
        value = config.get(key)
        given = f"model.config.{key}" in explicit_model_keys
        if isinstance(value, int) and not given and value < run.train.seq_len:
            config[key] = run.train.seq_len
    return dataclasses.replace(run, model=dataclasses.replace(run.model, config=config))


def take_pretrained_as_is(run, explicit_model_keys: Collection[str]):
    """The composed run with the model group's defaults replaced by model.pretrained's own config (see
    the module docstring). `explicit_model_keys`: dotted keys under `model.` that the command line or
    the recipe set (model.arch, model.name, model.config.<key>, or model.config for a whole dict)."""
    model = run.model
    if not model.pretrained:
        run = _vocab_following_tokenizer(adopt_pretrained(run), explicit_model_keys)
        return _positions_following_seq_len(run, explicit_model_keys)
    if "model.config" in explicit_model_keys:
        config = dict(model.config)
    else:
        config = {k: v for k, v in model.config.items() if f"model.config.{k}" in explicit_model_keys}
    arch = model.arch if "model.arch" in explicit_model_keys else ""
    name = model.name if "model.name" in explicit_model_keys else pretrained_name(model.pretrained)
    model = dataclasses.replace(model, config=config, arch=arch, name=name)
    return adopt_pretrained(dataclasses.replace(run, model=model))


def adopt_pretrained(run):
    """Fill in what only the pretrained folder can say, once it is a local folder: an empty model.arch
    from its model_type, data.tokenizer=auto from its tokenizer files. Without a pretrained model,
    `auto` is the byte tokenizer. Idempotent; a Hub id not yet resolved is left as it is."""
    model, data = run.model, run.data
    folder = model.pretrained if model.pretrained and is_there(model.pretrained, "dir") else None
    if folder is None and model.pretrained:
        return run  # a Hub id: resolve_hub_ids calls again with its snapshot folder
    if folder is not None and not model.arch:
        model = dataclasses.replace(model, arch=_stored_model_type(folder) or "")
    if data.tokenizer == AUTO_TOKENIZER:
        own = folder is not None and has_tokenizer(folder)
        if folder is not None and not own:
            _refuse_bytes_for_a_foreign_vocabulary(folder)
        data = dataclasses.replace(data, tokenizer=folder if own else BYTE_TOKENIZER)
    return dataclasses.replace(run, model=model, data=data)


BYTE_VOCAB = 256
"""Ids the byte tokenizer produces (0..255): a model whose vocabulary is larger was made for another
tokenizer."""


def _stored_vocab_size(folder: str) -> Optional[int]:
    try:
        stored = json.loads((Path(folder).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict):
        return None
    text = stored.get("text_config") if isinstance(stored.get("text_config"), dict) else {}
    value = stored.get("vocab_size", text.get("vocab_size"))
    return value if isinstance(value, int) else None


def _refuse_bytes_for_a_foreign_vocabulary(folder: str) -> None:
    """A pretrained folder without tokenizer files whose vocabulary is not the byte tokenizer's: the
    byte fallback would train byte ids into embeddings learned for other tokens, silently. Exit 2
    naming the fix instead; `data.tokenizer=byte` given by name still trains bytes."""
    size = _stored_vocab_size(folder)
    if size is None or size <= BYTE_VOCAB:
        return
    raise ConfigError(
        Problem(
            "model.pretrained",
            folder,
            f"holds no tokenizer files ({', '.join(TOKENIZER_FILES)}) and its config.json has vocab_size={size}: "
            f"the byte tokenizer (ids 0-{BYTE_VOCAB - 1}) would train byte ids into a model made for another "
            "tokenizer",
            "give the model's tokenizer, data.tokenizer=FOLDER_OR_HUB_ID (or copy its tokenizer files into the "
            "folder); data.tokenizer=byte trains on bytes anyway",
        )
    )
