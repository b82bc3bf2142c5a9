"""A safetensors file written tensor by tensor, so a writer never holds the whole file in memory.

`safetensors.torch.save_file` first turns every tensor into a bytes object (a second copy of the
shard) and only then writes. The format is simple enough to stream instead: an 8-byte
little-endian header length, a JSON header giving each tensor's dtype, shape and byte range in
the data section (padded with spaces to a multiple of 8 bytes), then the raw little-endian bytes of
the tensors in header order. The header is known before any tensor is read (shapes and dtypes
come from the checkpoint's index), so each tensor is written as soon as it is loaded and freed.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

SAFETENSORS_DTYPES: Dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count * element_size(dtype)


def header_bytes(entries: Sequence[Tuple[str, Sequence[int], torch.dtype]], metadata: Optional[dict] = None) -> bytes:
    """The length prefix and JSON header for tensors (name, shape, dtype) stored in this order."""
    header: Dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype in entries:
        size = nbytes(shape, dtype)
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": [int(d) for d in shape],
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


class StreamingSafetensors:
    """Write `entries` (name, shape, dtype) to `path`: `write(name, tensor)` in entry order, then
    `close()`; the file appears under its name only once complete (written as `<name>.tmp`)."""

    def __init__(self, path: Path, entries: Sequence[Tuple[str, Sequence[int], torch.dtype]]) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("safetensors stores little-endian bytes; this machine is big-endian")
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.pending: List[Tuple[str, Tuple[int, ...], torch.dtype]] = [(n, tuple(s), d) for n, s, d in entries]
        self.file = open(self.tmp, "wb")
        self.file.write(header_bytes(entries))
        self.written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        expected = self.pending[self.written] if self.written < len(self.pending) else None
        if expected is None or expected[0] != name:
            raise ValueError(f"{name} written out of order (expected {expected and expected[0]})")
        if tuple(tensor.shape) != expected[1] or tensor.dtype != expected[2]:
            raise ValueError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, the header says {expected[1:]}")
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        self.file.write(flat.view(torch.uint8).numpy().data)
        self.written += 1

    def close(self) -> None:
        if self.written != len(self.pending):
            self.abort()
            raise ValueError(f"{self.path}: {self.written} of {len(self.pending)} tensors written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)
