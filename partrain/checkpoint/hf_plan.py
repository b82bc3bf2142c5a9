"""Which tensors each shard of an HF export holds, under which names, decided before any weight is read.

A partrain checkpoint keys the model's tensors by the plain HF model's FQNs (`model.<fqn>` in DCP),
whatever layout saved them: tensor-parallel, FSDP and pipeline pieces are chunks of one logical
tensor in DCP's index, which a load of that key reassembles. So the plan needs only the index
(shapes and dtypes) and the model built on the meta device:

- tied aliases (GPT-2's `lm_head.weight` = `transformer.wte.weight`) are left out, as
  `save_pretrained` leaves them out; `from_pretrained` ties them again;
- transformers 5 keeps some weights fused in memory (Mixtral's experts as one 3-D `gate_up_proj`)
  and `save_pretrained` writes them in the original per-expert format; the same reverse conversion
  (`revert_weight_conversion`) is run here on meta tensors, one checkpoint tensor at a time, to know
  the names and shapes each tensor becomes;
- the checkpoint tensors are dealt to `n` shards in model order, cut where the running byte count
  crosses k/n of the total, so shard k holds about 1/n of the model and every shard is written by
  one process that reads only its own tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""`--dtype` choices of `partrain checkpoint export` (floating tensors are cast; integer buffers are not)."""

WRITABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
"""What DCP's safetensors consolidation can size (it reads element sizes from torch.finfo)."""

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for d in shape:
        count *= int(d)
    return count * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Output:
    """One tensor of the HF folder."""

    name: str
    shape: Tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Source:
    """One checkpoint tensor (`model.<key>` in DCP) and the HF tensors it becomes."""

    key: str
    shape: Tuple[int, ...]
    dtype: torch.dtype
    outputs: Tuple[Output, ...]
    converted: bool
    """True when the outputs are not the tensor itself under its own name (a reverse conversion)."""

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


@dataclass
class ShardJob:
    """What one exporting process does: read `sources` from the checkpoint, write `file`."""

    checkpoint: str
    file: str
    index: int
    n_shards: int
    sources: List[Source]
    record_model: Dict[str, Any] = field(default_factory=dict)
    """The checkpoint record's model entry: rebuilds the meta model when a conversion is needed."""
    verify_files: List[str] = field(default_factory=list)
    """Checkpoint files whose SHA-256 this process checks (the checks are dealt over the processes)."""

    @property
    def outputs(self) -> List[Output]:
        return [o for s in self.sources for o in s.outputs]

    @property
    def nbytes(self) -> int:
        return sum(nbytes(o.shape, o.dtype) for o in self.outputs)


def out_dtype(saved: torch.dtype, wanted: torch.dtype) -> torch.dtype:
    return wanted if saved.is_floating_point else saved


def tied_aliases(model) -> Dict[str, str]:
    """alias FQN -> first FQN for parameters registered under several names (tied weights)."""
    first: Dict[int, str] = {}
    alias: Dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            alias[name] = first[id(p)]
        else:
            first[id(p)] = name
    return alias


def reverse_conversion(model, tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """What `save_pretrained` writes for these in-memory tensors (names and layouts of the original
    HF format); the tensors themselves when transformers has no conversion for this model."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(tensors))


def plan_sources(model, saved: Dict[str, Tuple[Tuple[int, ...], torch.dtype]], wanted: torch.dtype) -> List[Source]:
    """The checkpoint tensors to export, in the model's state_dict order, with their HF outputs.

    saved: checkpoint key (without `model.`) -> (shape, dtype) from DCP's index. Raises KeyError
    naming a tensor of the model the checkpoint lacks."""
    alias = tied_aliases(model)
    state = model.state_dict()
    sources: List[Source] = []
    for key in state:
        if key in alias and alias[key] in state:
            continue  # a tied alias: written once, under its first name
        if key not in saved:
            raise KeyError(key)
        shape, dtype = saved[key]
        meta = torch.empty(shape, dtype=dtype, device="meta")
        reverted = reverse_conversion(model, {key: meta})
        outputs = tuple(Output(n, tuple(t.shape), out_dtype(t.dtype, wanted)) for n, t in reverted.items())
        converted = [o.name for o in outputs] != [key] or outputs[0].shape != tuple(shape)
        sources.append(Source(key, tuple(shape), dtype, outputs, converted))
    return sources


def check_conversion_is_per_tensor(model, sources: Sequence[Source]) -> None:
    """The per-tensor reverse conversion must give what the whole-model one gives (names, shapes):
    otherwise a conversion needs several checkpoint tensors at once, which shards cannot split."""
    if not any(s.converted for s in sources):
        return
    whole = reverse_conversion(model, {s.key: torch.empty(s.shape, dtype=s.dtype, device="meta") for s in sources})
    apart = {o.name: o.shape for s in sources for o in s.outputs}
    if {k: tuple(v.shape) for k, v in whole.items()} != apart:
        raise NotImplementedError(
            f"{type(model).__name__}: transformers' save format merges several in-memory tensors into one; "
            "a sharded export of this model is not supported yet"
        )


def deal(sources: Sequence[Source], n: int) -> List[List[Source]]:
    """Cut the sources (in order) into at most n non-empty runs of about equal output bytes."""
    n = max(1, min(n, len(sources)))
    sizes = [sum(nbytes(o.shape, o.dtype) for o in s.outputs) for s in sources]
    total = sum(sizes) or 1
    shards: List[List[Source]] = [[] for _ in range(n)]
    running = 0
    k = 0
    for i, (source, size) in enumerate(zip(sources, sizes)):
        left_sources = len(sources) - i
        left_shards = n - k - 1
        # Move on once this shard has its share, keeping one source for every shard still to fill.
        if shards[k] and k < n - 1 and (running + size / 2 > total * (k + 1) / n or left_sources <= left_shards):
            k += 1
        shards[k].append(source)
        running += size
    return shards


def shard_file_names(n: int) -> List[str]:
    """HF's names: model.safetensors alone, else model-0000k-of-0000n.safetensors (with an index)."""
    if n == 1:
        return [SINGLE_FILE]
    return [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]


def index_json(jobs: Sequence[ShardJob]) -> Dict[str, Any]:
    """model.safetensors.index.json: total_size and weight_map (tensor name -> file)."""
    weight_map: Dict[str, str] = {}
    for job in jobs:
        for o in job.outputs:
            weight_map[o.name] = job.file.rsplit("/", 1)[-1]
    return {
        "metadata": {"total_size": sum(job.nbytes for job in jobs)},
        "weight_map": dict(sorted(weight_map.items())),
    }


def check_dtypes(sources: Sequence[Source]) -> None:
    for s in sources:
        for o in s.outputs:
            if o.dtype not in WRITABLE_DTYPES:
                raise ValueError(f"{o.name}: dtype {o.dtype} cannot be exported (floating tensors only)")
