"""Write one shard of an HF export through torch DCP's `HuggingFaceStorageWriter`, in bounded memory.

Runs in an exporting process (`partrain checkpoint export --nproc N` starts N of them; a training
run with `checkpoint.export_hf=true` uses its own ranks). The process loads its checkpoint tensors
through DCP in batches of at most READ_BATCH_BYTES (a DCP load of a subset of keys reads only the
chunks of those keys, from whichever ranks' files hold them), turns them into the HF tensors
(`hf_tensors`: transformers' reverse conversion where the in-memory layout differs from the saved
one, the cast to the export dtype), and hands each batch to `dcp.save` with DCP's
`HuggingFaceStorageWriter`. DCP's safetensors consolidation (`consolidate_safetensors_files`, what
the writer's `enable_consolidation` runs) then copies the batch files, tensor by tensor, into the
shard's one safetensors file, with its header in model order.

Why batches and not one `dcp.save` of the whole shard: DCP's safetensors writer keeps every tensor
of a file and then a serialized copy of all of them (`safetensors.torch.save` returns bytes), about
twice the shard in memory; batched, an exporting process holds about two read batches (one
loaded, one serialized) and two copies of its largest tensor (consolidation reads, then writes it),
never its shard (benchmarks/hf_export.py: 116-127 MiB held for a 167 MiB shard; the hand-written
streaming writer this replaced held 39 MiB, and wrote each byte once where this writes it twice).
Consolidation is called directly (the function the writer's `enable_consolidation` runs; its
module is private, present since torch 2.9, the floor in pyproject.toml) because the writer passes
the same `fqn_to_index_mapping` to the batch files and to the output, and the batches need one
file each. Reports the process's peak RSS so tests and benchmarks can check the bound.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List

import safetensors.torch  # noqa: F401 - DCP's writer imports it on first use: loaded with our code, not counted as held
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

from partrain.checkpoint.hf_plan import ShardJob, Source, reverse_conversion
from partrain.runtime.resident import current_rss_bytes, peak_rss_bytes

READ_BATCH_BYTES = 32 << 20
"""Checkpoint bytes one DCP load reads at most (a bigger single tensor is read alone)."""


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc malloc_trim). DCP reads each chunk into
    a fresh buffer; glibc's adaptive mmap threshold then serves later chunks from the heap, whose
    freed pages it keeps, so without this a process's RSS creeps up batch after batch."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim, or its allocator returns memory by itself


def _batches(sources: List[Source], limit: int) -> Iterator[List[Source]]:
    batch: List[Source] = []
    size = 0
    for s in sources:
        if batch and size + s.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(s)
        size += s.nbytes
    if batch:
        yield batch


def _read(checkpoint: Path, batch: List[Source]) -> Dict[str, torch.Tensor]:
    """The batch's tensors, full and in the saved dtype, read without a process group."""
    from partrain.checkpoint.dist_util import quiet_single_process
    from partrain.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
    from partrain.checkpoint.state import MODEL

    tensors = {s.key: torch.empty(s.shape, dtype=s.dtype) for s in batch}
    with quiet_single_process():
        dcp.load(
            {MODEL: tensors}, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(), no_dist=True
        )
    return tensors


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor alone in a storage of its own size: the reverse conversion may return views of
    one fused tensor (Mixtral's experts), and safetensors refuses tensors that share memory."""
    size = tensor.numel() * tensor.element_size()
    alone = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == size and tensor.is_contiguous()
    return tensor if alone else tensor.clone(memory_format=torch.contiguous_format)


def _save_batch(tensors: Dict[str, torch.Tensor], scratch: Path, number: int) -> None:
    """One `dcp.save` through HuggingFaceStorageWriter: the batch as one safetensors file in scratch
    (save_distributed names it after the batch number, so batches never overwrite each other)."""
    from partrain.checkpoint.dist_util import quiet_single_process
    from partrain.checkpoint.failures import is_failure, os_error

    writer = HuggingFaceStorageWriter(
        str(scratch), fqn_to_index_mapping=dict.fromkeys(tensors, number), save_distributed=True
    )
    try:
        with quiet_single_process():
            dcp.save(tensors, storage_writer=writer, no_dist=True)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        # DCP wraps the writer's OSError (a full disk): raise that one, so callers see the cause.
        found = os_error(exc) if is_failure(exc) else None
        if found is None:
            raise
        raise found from None


def mark_pytorch_format(path: Path) -> None:
    """Add `"__metadata__": {"format": "pt"}` to a safetensors header, as save_pretrained writes it:
    DCP's consolidation writes none, and some readers (transformers 4.46, for one) fail on a file
    without it. DCP's header is JSON with spaces after its separators; written compactly it
    leaves room for the entry, so the header keeps its length (padded with spaces, as the format
    allows) and only its bytes are rewritten; a header with too little room (a file of a few
    tensors) is written longer, and the data copied after it in 1 MiB pieces."""
    with open(path, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        header.pop("__metadata__", None)
        text = json.dumps({"__metadata__": {"format": "pt"}, **header}, separators=(",", ":")).encode()
        if len(text) <= size:
            f.seek(8)
            f.write(text + b" " * (size - len(text)))
            return
        longer = path.with_name(path.name + ".tmp")
        with open(longer, "wb") as out:
            text += b" " * (-len(text) % 8)
            out.write(struct.pack("<Q", len(text)) + text)
            shutil.copyfileobj(f, out, 1 << 20)
    os.replace(longer, path)


def write_file(file: Path, batches: Iterable[Dict[str, torch.Tensor]]) -> int:
    """Write the tensors of `batches` (HF name -> tensor, in file order) as the safetensors file
    `file`, which appears only once complete; returns the number of tensors. The scratch folders
    next to it are removed whatever happens."""
    file = Path(file)
    scratch, whole = file.with_name(f".{file.name}.batches"), file.with_name(f".{file.name}.whole")
    names: List[str] = []
    try:
        for number, tensors in enumerate(batches, start=1):
            names += list(tensors)
            _save_batch(tensors, scratch, number)
            del tensors
            release_freed_memory()
        whole.mkdir()
        consolidate_safetensors_files(str(scratch), str(whole), dict.fromkeys(names, 1))
        mark_pytorch_format(whole / "model-00001-of-00001.safetensors")
        os.replace(whole / "model-00001-of-00001.safetensors", file)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(whole, ignore_errors=True)
    return len(names)


def _meta_model(job: ShardJob):
    if not any(s.converted for s in job.sources):
        return None
    from partrain.checkpoint.export_model import hf_model_from_record

    return hf_model_from_record(job.record_model)


def hf_tensors(model, batch: List[Source], tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The state-dict adapter: the checkpoint tensors of `batch` (popped from `tensors`) as the HF
    tensors they become, under their HF names, in the export dtype and in their own storage."""
    out: Dict[str, torch.Tensor] = {}
    for source in batch:
        value = tensors.pop(source.key)
        converted = reverse_conversion(model, {source.key: value}) if source.converted else {source.key: value}
        del value
        for o in source.outputs:
            out[o.name] = own_storage(converted.pop(o.name).to(o.dtype))
    return out


def _job_batches(job: ShardJob, read_batch_bytes: int) -> Iterator[Dict[str, torch.Tensor]]:
    model = _meta_model(job)
    for batch in _batches(job.sources, read_batch_bytes):
        out = hf_tensors(model, batch, _read(Path(job.checkpoint), batch))
        yield out
        del out  # before the next batch is read: one batch held at a time


def write_shard(job: ShardJob, read_batch_bytes: int = READ_BATCH_BYTES) -> Dict[str, Any]:
    """Write job.file; returns {index, file, bytes, tensors, rss_before_bytes, peak_rss_bytes, seconds}.

    rss_before_bytes is this process's memory once its code is loaded, before any weight is read;
    the difference to peak_rss_bytes is what the export itself held."""
    from partrain.checkpoint.record import check_files, read_record

    start = time.perf_counter()
    checkpoint = Path(job.checkpoint)
    if job.verify_files:  # this process's share of the SHA-256 checks: never export changed weights
        check_files(checkpoint, read_record(checkpoint, key="PATH"), key="PATH", files=job.verify_files)
    rss_before, peak_before = current_rss_bytes(), peak_rss_bytes()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # it only copies; more threads give glibc more heaps that keep freed pages
    try:
        written = write_file(Path(job.file), _job_batches(job, read_batch_bytes))
    finally:
        torch.set_num_threads(threads)
    return {
        "index": job.index,
        "file": job.file,
        "bytes": job.nbytes,
        "tensors": written,
        "rss_before_bytes": rss_before,
        "peak_rss_before_bytes": peak_before,
        "peak_rss_bytes": peak_rss_bytes(),
        "seconds": time.perf_counter() - start,
    }


def write_shard_in_child(job: ShardJob) -> Dict[str, Any]:
    """write_shard in a process of its own (started by the export)."""
    return write_shard(job)
