"""Write one shard of an HF export: read only its tensors from the checkpoint, stream them to disk.

Runs in an exporting process (`partrain checkpoint export --nproc N` starts N of them; a training
run with `checkpoint.export_hf=true` uses its own ranks). The process loads its checkpoint tensors
through DCP in batches of at most READ_BATCH_BYTES (a DCP load of a subset of keys reads only the
chunks of those keys, from whichever ranks' files hold them), casts them to the export dtype,
applies transformers' reverse conversion where the in-memory layout differs from the saved one,
and appends each to the safetensors file. Its memory beyond the interpreter's stays about one
batch, not one shard and never the model. Reports its peak RSS so tests and benchmarks can check.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Iterator, List

import torch

from partrain.checkpoint.hf_plan import ShardJob, Source, reverse_conversion
from partrain.checkpoint.safetensors_stream import StreamingSafetensors
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
    import torch.distributed.checkpoint as dcp

    from partrain.checkpoint.dist_util import quiet_single_process
    from partrain.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
    from partrain.checkpoint.state import MODEL

    tensors = {s.key: torch.empty(s.shape, dtype=s.dtype) for s in batch}
    with quiet_single_process():
        dcp.load(
            {MODEL: tensors}, storage_reader=SafeFileSystemReader(checkpoint), planner=SafeLoadPlanner(), no_dist=True
        )
    return tensors


def _meta_model(job: ShardJob):
    if not any(s.converted for s in job.sources):
        return None
    from partrain.checkpoint.export_model import hf_model_from_record

    return hf_model_from_record(job.record_model)


def write_shard(job: ShardJob, read_batch_bytes: int = READ_BATCH_BYTES) -> Dict[str, Any]:
    """Write job.file; returns {index, file, bytes, tensors, rss_before_bytes, peak_rss_bytes, seconds}.

    rss_before_bytes is this process's memory once its code is loaded, before any weight is read;
    the difference to peak_rss_bytes is what the export itself held."""
    from partrain.checkpoint.record import check_files, read_record

    start = time.perf_counter()
    checkpoint = Path(job.checkpoint)
    if job.verify_files:  # this process's share of the SHA-256 checks: never export changed weights
        check_files(checkpoint, read_record(checkpoint, key="PATH"), key="PATH", files=job.verify_files)
    model = _meta_model(job)
    rss_before, peak_before = current_rss_bytes(), peak_rss_bytes()
    writer = StreamingSafetensors(Path(job.file), [(o.name, o.shape, o.dtype) for o in job.outputs])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # it only copies; more threads give glibc more heaps that keep freed pages
    try:
        for batch in _batches(job.sources, read_batch_bytes):
            tensors = _read(checkpoint, batch)
            for source in batch:
                value = tensors.pop(source.key)
                out = reverse_conversion(model, {source.key: value}) if source.converted else {source.key: value}
                del value
                for o in source.outputs:
                    writer.write(o.name, out.pop(o.name).to(o.dtype))
                del out
            del tensors
            release_freed_memory()
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        torch.set_num_threads(threads)
    return {
        "index": job.index,
        "file": job.file,
        "bytes": job.nbytes,
        "tensors": len(job.outputs),
        "rss_before_bytes": rss_before,
        "peak_rss_before_bytes": peak_before,
        "peak_rss_bytes": peak_rss_bytes(),
        "seconds": time.perf_counter() - start,
    }


def write_shard_in_child(job: ShardJob) -> Dict[str, Any]:
    """write_shard in a process of its own (started by the export)."""
    return write_shard(job)
