"""model.pretrained: are the weight files there, whole, and of the model the config builds?

Reads only the safetensors headers (an 8-byte little-endian length, then that many bytes of JSON:
name -> dtype, shape, data offsets), never a tensor, so it costs milliseconds whatever the size.
A header that does not parse, a file shorter than its header says (truncated), a file the index
names but the folder lacks, a parameter the model needs but the files lack, and a shape that
differs from the model's are each reported naming the file or tensor. The model is built on the
meta device, as the workers build it, and matched with the loader's own name rules
(`SafetensorsCheckpoint.stored_key`), so "passes here" means "loads there".
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from partrain.blueprint.config.schema import ModelConfig
from partrain.errors import ConfigError, Problem

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # the safetensors format caps its JSON header at 100 MB
_KEY = "model.pretrained"
_REEXPORT = "re-save the model with save_pretrained(..., safe_serialization=True), or unset model.pretrained"


class _Bad(Exception):
    """One weight problem: raised to stop at the first, turned into a Problem by the caller."""


def read_header(path: Path) -> Dict[str, Tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header; _Bad naming the file if it is damaged."""
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            head = f.read(8)
            if len(head) < 8:
                raise _Bad(f"{path} is truncated ({size} bytes): no safetensors header")
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise _Bad(f"{path} is not a safetensors file or is truncated (header length {length}, {size} bytes)")
            header = json.loads(f.read(length))
    except FileNotFoundError:
        raise _Bad(f"{path} is missing") from None
    except OSError as exc:
        raise _Bad(f"{path} cannot be read ({exc.strerror or exc})") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise _Bad(f"{path} has a damaged safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise _Bad(f"{path} has a damaged safetensors header (not a JSON object)")
    shapes, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            shapes[name] = tuple(int(d) for d in entry["shape"])
            end = max(end, int(entry["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise _Bad(f"{path} has a damaged safetensors header (entry {name!r})") from None
    if 8 + length + end > size:
        raise _Bad(f"{path} is truncated: {size} bytes, its header describes {8 + length + end}")
    return shapes


def _stored_shapes(folder: Path) -> Dict[str, Tuple[int, ...]]:
    """{tensor name: shape} over the folder's safetensors files (the index's, or the single file)."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise _Bad(f"{index} is not a readable safetensors index ({exc})") from None
        shapes: Dict[str, Tuple[int, ...]] = {}
        for file in files:
            found = read_header(folder / file)
            lost = [k for k, f in weight_map.items() if f == file and k not in found]
            if lost:
                raise _Bad(f"{folder / file} lacks {lost[0]}, which {index.name} places there")
            shapes.update(found)
        return shapes
    if (folder / SINGLE_FILE).is_file():
        return read_header(folder / SINGLE_FILE)
    pickled = sorted(p.name for p in folder.glob("*.bin"))
    also = f" (found {', '.join(pickled)}: pickled .bin files are never loaded)" if pickled else ""
    raise _Bad(f"{folder} has no safetensors weights ({SINGLE_FILE} or {INDEX_FILE}){also}")


def _expected_shape(fqn: str, shape: Tuple[int, ...], ckpt, stored: Dict[str, Tuple[int, ...]]):
    """The shape the loader would produce for `fqn` from the files, or None when they lack it."""
    key = ckpt.stored_key(fqn)
    if key is not None:
        return key, stored[key]
    packed = ckpt.mxfp4_key(fqn)
    if packed is not None:  # gpt-oss' experts as released: dequantized on load
        from partrain.models.pretrained import MXFP4_BLOCKS, mxfp4_shape

        return packed + MXFP4_BLOCKS, mxfp4_shape(stored[packed + MXFP4_BLOCKS])
    adapter = ckpt.adapter
    legacy, experts_attr = adapter.legacy_experts, adapter.experts_attr
    layer, sep, param = fqn.rpartition(f".{experts_attr}.") if legacy and experts_attr else ("", "", "")
    if not sep or param not in ("gate_up_proj", "down_proj"):
        return None
    # Experts saved one Linear per expert: stacked along a new first dimension, gate and up concatenated.
    names = (legacy.gate, legacy.up) if param == "gate_up_proj" else (legacy.down,)
    parts = [stored.get(f"{layer}.{legacy.file_experts_attr}.0.{n}.weight") for n in names]
    if any(p is None for p in parts):
        return None
    return f"{layer}.{legacy.file_experts_attr}.*", (shape[0], sum(p[0] for p in parts), parts[0][1])


def weight_problems(model_cfg: ModelConfig) -> List[Problem]:
    """Problems with `model_cfg.pretrained`'s weights (none when it is unset)."""
    if not model_cfg.pretrained:
        return []
    folder = Path(model_cfg.pretrained).expanduser()
    try:
        stored = _stored_shapes(folder)
    except _Bad as bad:
        return [Problem(_KEY, model_cfg.pretrained, str(bad), _REEXPORT)]
    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.pretrained import SafetensorsCheckpoint
    from partrain.models.shards import canonical_fqn

    try:
        model = build_meta_model(model_cfg)
    except ConfigError as err:
        return list(err.problems)
    with SafetensorsCheckpoint(str(folder), get_adapter(model)) as ckpt:
        for name, param in model.named_parameters():
            fqn, shape = canonical_fqn(name), tuple(param.shape)
            found: Optional[tuple] = _expected_shape(fqn, shape, ckpt, stored)
            if found is None:
                return [
                    Problem(
                        _KEY,
                        model_cfg.pretrained,
                        f"the weights have no tensor for parameter {fqn}",
                        "use a folder saved from this architecture and config",
                    )
                ]
            if found[1] != shape:
                stored_as = f" (stored as {found[0]})" if found[0] != fqn else ""
                return [
                    Problem(
                        _KEY,
                        model_cfg.pretrained,
                        f"{fqn} has shape {found[1]} in the weight files{stored_as}, the model expects {shape}",
                        "do not override size keys in model.config when loading a pretrained folder",
                    )
                ]
    return []
