"""Reading checkpoint files without running code from them.

DCP's own reader loads `.metadata` with plain `pickle.load` and non-tensor values with
`torch.load(weights_only=False)`: either would execute whatever a crafted file asks for. partrain
reads checkpoints through the two classes below instead:

- `SafeFileSystemReader` unpickles `.metadata` with an allow-list: only DCP's own metadata
  dataclasses, `torch.Size`, dtypes, layouts, memory formats and `pathlib.PosixPath` may appear.
- `SafeLoadPlanner` loads non-tensor values with `torch.load(weights_only=True)` (tensor data is
  already read that way by DCP).

Per-rank RNG files are plain tensors written by `torch.save` and read with `weights_only=True`.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from pathlib import Path
from typing import Any, Dict

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.futures import Future

METADATA_FILE = ".metadata"
"""DCP's index of a checkpoint: which file and byte range holds each tensor chunk."""

_ALLOWED = {
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointData(pickle.UnpicklingError):
    """The file asks to build an object partrain does not expect in checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise UnsafeCheckpointData(f"refusing to load {module}.{name} from checkpoint metadata")


def read_metadata(folder: Path) -> Metadata:
    """DCP's `.metadata` of `folder`, unpickled with the allow-list."""
    data = (Path(folder) / METADATA_FILE).read_bytes()
    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointData(
            f"{Path(folder) / METADATA_FILE} holds a {type(metadata).__name__}, not DCP metadata"
        )
    return metadata


class UnreadableFile(Exception):
    """Reading one data file of a checkpoint failed; names the file (DCP's own errors do not).
    Built from plain strings, so it crosses ranks inside DCP's gathered CheckpointException."""

    def __init__(self, relative_path: str, reason: str) -> None:
        super().__init__(relative_path, reason)
        self.relative_path = relative_path
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.relative_path}: {self.reason}"


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with `.metadata` read by the allow-listed unpickler, and failures to read
    a data file raised as UnreadableFile naming it."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: Dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative_path, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except Exception as exc:  # noqa: BLE001 - torch.load, unpickling, short reads: all name the file
                text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
                raise UnreadableFile(relative_path, f"{type(exc).__name__}: {text[:300]}") from exc
        done: Future = Future()
        done.set_result(None)
        return done

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("partrain checkpoints have one .metadata file (saved with collectives)")
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values with weights_only=True."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import (
                set_element,  # DCP's own helper, as its planner uses
            )

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def save_tensors(path: Path, tensors: Dict[str, torch.Tensor]) -> None:
    """torch.save of a dict of tensors, written to a temporary name then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(tensors, tmp)
    tmp.replace(path)


def load_tensors(path: Path) -> Dict[str, torch.Tensor]:
    """The dict `save_tensors` wrote; weights_only=True, so nothing but tensors is ever built."""
    loaded = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(loaded, dict) or not all(torch.is_tensor(v) for v in loaded.values()):
        raise ValueError(f"{path} does not hold a dict of tensors")
    return loaded
