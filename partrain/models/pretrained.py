"""Read full tensors, one at a time and by model FQN, from a local `save_pretrained` folder.

Only safetensors files are read (memory-mapped with `safe_open`); pickled `.bin` checkpoints are
never loaded because unpickling runs arbitrary code. Besides exact names, the reader understands
the differences between transformers' in-memory names and what `save_pretrained` writes:
- a base-model-only file (keys without "model." / "transformer.", as on the Hub for gpt2);
- the adapter's renames (Mixtral's router lives under "block_sparse_moe" on disk);
- MoE experts stored per expert on disk but as stacked 3-D parameters in memory (LegacyExperts);
- experts stored in MXFP4 (gpt-oss as released: `<name>_blocks` and `<name>_scales`, blocks of 32 4-bit
  values sharing one power-of-two scale), dequantized on load by transformers' own function into the
  training dtype (`mxfp4_shape` says what they become; training runs on the dequantized weights).
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
from safetensors import safe_open

from partrain.errors import ConfigError, Problem
from partrain.models.adapters import Adapter

_SINGLE_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


class SafetensorsCheckpoint:
    """Tensor lookup over the safetensors files of one folder. Use as a context manager."""

    def __init__(self, folder: str, adapter: Adapter):
        self.folder = Path(folder).expanduser()
        self.adapter = adapter
        self.key_to_file = _key_to_file(self.folder)
        self._stack = ExitStack()
        self._handles: Dict[str, object] = {}

    def __enter__(self) -> "SafetensorsCheckpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._stack.close()
        self._handles.clear()

    def read(self, key: str) -> torch.Tensor:
        """The tensor stored under `key` (CPU, dtype as stored)."""
        file = self.key_to_file[key]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._stack.enter_context(safe_open(str(self.folder / file), framework="pt", device="cpu"))
            self._handles[file] = handle
        return handle.get_tensor(key)

    def value(self, fqn: str, shape: Sequence[int]) -> Optional[torch.Tensor]:
        """Full value of the model tensor `fqn` (of `shape`), or None when the folder lacks it."""
        for key in self._candidate_keys(fqn):
            if key in self.key_to_file:
                return self.read(key)
        packed = self.mxfp4_key(fqn)
        if packed is not None:
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            blocks, scales = self.read(packed + MXFP4_BLOCKS), self.read(packed + MXFP4_SCALES)
            return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        return self._legacy_experts(fqn, shape)

    def mxfp4_key(self, fqn: str) -> Optional[str]:
        """The key (without its _blocks / _scales suffix) under which `fqn` is stored in MXFP4, or None."""
        for key in self._candidate_keys(fqn):
            if key + MXFP4_BLOCKS in self.key_to_file and key + MXFP4_SCALES in self.key_to_file:
                return key
        return None

    def stored_key(self, fqn: str) -> Optional[str]:
        """The key under which the folder stores model tensor `fqn` whole, or None (absent, or
        stored per expert)."""
        return next((key for key in self._candidate_keys(fqn) if key in self.key_to_file), None)

    def _candidate_keys(self, fqn: str) -> List[str]:
        keys = [fqn]
        for in_model, in_file in self.adapter.checkpoint_renames:
            if in_model in fqn:
                keys.append(fqn.replace(in_model, in_file))
        prefix = self.adapter.base_prefix + "."
        keys += [k[len(prefix) :] for k in list(keys) if k.startswith(prefix)]
        return keys

    def _legacy_experts(self, fqn: str, shape: Sequence[int]) -> Optional[torch.Tensor]:
        """Stack per-expert Linear weights into the [E, ...] parameter transformers 5 uses in memory."""
        legacy, experts_attr = self.adapter.legacy_experts, self.adapter.experts_attr
        if legacy is None or experts_attr is None:
            return None
        layer_path, sep, param = fqn.rpartition(f".{experts_attr}.")
        if not sep or param not in ("gate_up_proj", "down_proj"):
            return None
        prefix = f"{layer_path}.{legacy.file_experts_attr}"
        names = (legacy.gate, legacy.up) if param == "gate_up_proj" else (legacy.down,)
        keys = [[f"{prefix}.{e}.{n}.weight" for n in names] for e in range(shape[0])]
        if not all(k in self.key_to_file for per_expert in keys for k in per_expert):
            return None
        # Fill one preallocated tensor so at most one full parameter (plus one expert) is alive.
        # gate_up_proj[e] is [gate_e; up_e] along the output dimension, as transformers merges it.
        full: Optional[torch.Tensor] = None
        for e, per_expert in enumerate(keys):
            row = 0
            for key in per_expert:
                part = self.read(key)
                if full is None:
                    full = torch.empty(tuple(shape), dtype=part.dtype)
                full[e, row : row + part.shape[0]].copy_(part)
                row += part.shape[0]
                del part
            if row != shape[1]:
                raise ValueError(f"{fqn}: per-expert weights give {row} rows, the model expects {shape[1]}")
        return full


MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
"""The suffixes of an MXFP4 tensor's two parts: [E, rows, groups, 16] uint8 (two 4-bit values a byte) and
[E, rows, groups] uint8 (each group's power-of-two exponent, biased by 127)."""


def mxfp4_shape(blocks_shape: Sequence[int]) -> tuple:
    """The shape MXFP4 blocks of `blocks_shape` dequantize to: [E, groups x 32, rows] (transformers stores
    gpt-oss' experts transposed: the in-memory [E, in, out] is [E, out, in] on disk)."""
    experts, rows, groups, packed = blocks_shape
    return (experts, groups * packed * 2, rows)


def _key_to_file(folder: Path) -> Dict[str, str]:
    index = folder / _INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = folder / _SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt", device="cpu") as handle:
            return {key: _SINGLE_FILE for key in handle.keys()}
    raise ConfigError(
        Problem(
            "model.pretrained",
            str(folder),
            "no safetensors weights in that folder "
            f"({_SINGLE_FILE} or {_INDEX_FILE}); pickled .bin files are never loaded",
            "re-save the model with save_pretrained(..., safe_serialization=True)",
        )
    )
