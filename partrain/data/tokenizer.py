"""Tokenizers: the built-in byte tokenizer and Hugging Face tokenizers from a local folder.

Both expose the same small surface the data pipeline needs:

- ``name``: a stable identity string; the packing cache is keyed by it, so it must change
  whenever the token ids a text maps to could change, and must not change otherwise.
- ``vocab_size``: one more than the largest id the tokenizer can produce.
- ``eos_id``: the end-of-document id written between documents.
- ``encode(text) -> list[int]`` and ``encode_batch(texts) -> list[np.ndarray]``.

Nothing is ever downloaded: HF tokenizers are read with ``local_files_only=True``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from partrain.errors import ConfigError, Problem

BYTE_SPEC = "byte"
"""The ``data.tokenizer`` value that selects the byte tokenizer."""

# Files that hold model weights, not tokenizer state: hashing them would make the tokenizer
# identity slow to compute (gigabytes) without making it any more precise.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, no vocabulary file, nothing to download.

    Id 0 (the NUL byte) is the end-of-document separator. NUL does not occur in real text, and
    ``encode`` drops any that do, so a 0 in a token stream always means "document boundary".
    """

    name = "byte"
    vocab_size = 256
    eos_id = 0
    bos_id = None
    """No BOS: documents are separated by the EOS id alone."""
    bos_token = ""
    eos_token = ""
    """No text stands for the separator (NUL is dropped from text): a chat template gets ''."""
    chat_template = None

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` (its UTF-8 bytes, NUL bytes removed)."""
        return list(self._bytes(text))

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        """Token ids of each text as a uint8 array (no Python int per byte: this is the hot path)."""
        return [np.frombuffer(self._bytes(text), dtype=np.uint8) for text in texts]

    def encode_with_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        """Token ids of ``text`` and each one's [start, end) character offsets (a character's bytes share it)."""
        ids: List[int] = []
        offsets: List[Tuple[int, int]] = []
        for k, char in enumerate(text):
            for byte in self._bytes(char):
                ids.append(byte)
                offsets.append((k, k + 1))
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; a separator decodes to NUL, a split multi-byte character to U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    @staticmethod
    def _bytes(text: str) -> bytes:
        return text.replace("\x00", "").encode("utf-8")


class HFTokenizer:
    """A Hugging Face tokenizer loaded from a local ``save_pretrained`` folder.

    Documents are encoded without special tokens (no BOS/EOS added per call); the pipeline
    itself writes ``eos_id`` after every document, exactly as for the byte tokenizer.
    """

    def __init__(self, folder: Union[str, Path]):
        self.folder = _tokenizer_folder(str(folder))
        # Imported here: transformers takes seconds to import and the byte tokenizer never needs it.
        from transformers import AutoTokenizer

        try:
            self._tok = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        except Exception as exc:  # transformers raises many types (OSError, ValueError, KeyError...)
            raise ConfigError(
                Problem(
                    key="data.tokenizer",
                    value=str(folder),
                    rule=f"could not load a Hugging Face tokenizer from {self.folder}: {exc}",
                    fix="point data.tokenizer at a folder written by tokenizer.save_pretrained(), or use "
                    "data.tokenizer=byte",
                )
            ) from exc
        eos = self._tok.eos_token_id
        if eos is None:
            raise ConfigError(
                Problem(
                    key="data.tokenizer",
                    value=str(folder),
                    rule="the tokenizer has no end-of-sequence token (eos_token), which separates documents",
                    fix="set eos_token in its tokenizer_config.json, or use data.tokenizer=byte",
                )
            )
        self.eos_id = int(eos)
        # The BOS a fine-tuning example starts with: the one the tokenizer itself adds, if it adds one.
        added = self._tok("", add_special_tokens=True)["input_ids"]
        bos = self._tok.bos_token_id
        self.bos_id = int(bos) if bos is not None and list(added[:1]) == [bos] else None
        self.bos_token = self._tok.bos_token or ""
        self.eos_token = self._tok.eos_token or ""
        self.chat_template = getattr(self._tok, "chat_template", None) or None
        # len() counts added tokens too, unlike .vocab_size; ids of added tokens can be produced.
        self.vocab_size = max(len(self._tok), self.eos_id + 1)
        self.name = hf_tokenizer_name(self.folder)

    def encode(self, text: str) -> List[int]:
        """Token ids of ``text`` without special tokens."""
        return list(self.encode_batch([text])[0])

    def encode_batch(self, texts: Sequence[str]) -> List[np.ndarray]:
        """Token ids of each text; one call so fast tokenizers work on the batch in parallel."""
        # verbose=False: documents are longer than model_max_length by design (they get packed),
        # so the "sequence too long" warning would be noise.
        out = self._tok(list(texts), add_special_tokens=False, verbose=False, return_attention_mask=False)
        return [np.asarray(ids, dtype=np.int64) for ids in out["input_ids"]]

    def encode_with_offsets(self, text: str) -> Optional[Tuple[List[int], List[Tuple[int, int]]]]:
        """Token ids of ``text`` without special tokens and each one's [start, end) character offsets, as
        transformers' assistant mask reads them; None for a slow tokenizer, which has no offsets."""
        if not getattr(self._tok, "is_fast", False):
            return None
        out = self._tok(text, add_special_tokens=False, verbose=False, return_offsets_mapping=True)
        return [int(i) for i in out["input_ids"]], [(int(a), int(b)) for a, b in out["offset_mapping"]]

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (special tokens kept, so document boundaries stay visible)."""
        return self._tok.decode([int(i) for i in ids])


Tokenizer = Union[ByteTokenizer, HFTokenizer]


AUTO_SPEC = "auto"
"""``data.tokenizer=auto`` outside a composed run (no pretrained model in sight): the byte tokenizer.
Composition resolves it (partrain.blueprint.config.pretrained), so a run's config never holds it."""


def tokenizer_name(spec: str) -> str:
    """Identity of the tokenizer ``spec`` names, without loading it (cheap: used for cache hits)."""
    if spec in (BYTE_SPEC, AUTO_SPEC):
        return ByteTokenizer.name
    return hf_tokenizer_name(_tokenizer_folder(spec))


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer for a ``data.tokenizer`` value: ``byte`` or a local HF tokenizer folder."""
    if spec in (BYTE_SPEC, AUTO_SPEC):
        return ByteTokenizer()
    return HFTokenizer(spec)


def hf_tokenizer_name(folder: Path) -> str:
    """``hf:<folder name>:<digest>``, the digest covering every non-weight file of the folder.

    Hashing contents rather than the path means a copied folder reuses the cache and an edited
    tokenizer (new merges, new special tokens) does not.
    """
    digest = hashlib.sha256()
    for path in sorted(folder.iterdir()):
        if not path.is_file() or path.name.startswith(".") or path.suffix in _WEIGHT_SUFFIXES:
            continue
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return f"hf:{folder.name}:{digest.hexdigest()[:16]}"


def _tokenizer_folder(spec: str) -> Path:
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            Problem(
                key="data.tokenizer",
                value=spec,
                rule="must be 'byte' or an existing local folder holding a Hugging Face tokenizer (nothing is "
                "downloaded)",
                fix="use data.tokenizer=byte, or save the tokenizer with save_pretrained() and give that folder",
            )
        )
    return folder.resolve()
