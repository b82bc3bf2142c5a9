"""A prepared run's batches: the one place that picks the batch source from the run's data block
(a stream, fine-tuning examples, or packed pretraining tokens). The worker trains from it; `partrain
rehearse` writes the reference run's batches out from it."""

from __future__ import annotations

import json
from pathlib import Path

from partrain.blueprint.validate import ValidatedRun

DATA_MANIFEST = "data.json"
"""Written by the launcher in the run folder: where the packed token files are."""


def open_batches(v: ValidatedRun, run_dir: Path):
    """(training batches, eval batches or None) of the run prepared in run_dir; every rank calls this."""
    from partrain.data import EvalBatches, TokenBatches, open_packed
    from partrain.data.prepare import is_examples_entry, open_example_batches

    t = v.run.train
    if v.run.data.streaming:  # tokenized (or rendered, for fine-tuning rows) on the fly by every rank, no cache
        from partrain.data.example_stream import open_example_stream, streams_examples
        from partrain.data.streaming import open_stream

        if streams_examples(v.run.data):
            return open_example_stream(v.run.data, t.seq_len, v.global_batch_size, t.seed, t.eval_batches)
        return open_stream(v.run.data, t.seq_len, v.global_batch_size, t.seed, t.eval_batches)
    meta_path = json.loads((Path(run_dir) / DATA_MANIFEST).read_text())["meta_path"]
    if is_examples_entry(meta_path):  # fine-tuning rows: packed windows or padded rows
        return open_example_batches(
            meta_path,
            t.seq_len,
            v.global_batch_size,
            t.seed,
            t.eval_batches > 0,
            v.run.data.long_examples,
            v.run.data.packing,
        )
    packed = open_packed(meta_path)
    batches = TokenBatches.from_packed(packed, t.seq_len, v.global_batch_size, t.seed)
    evals = EvalBatches.from_packed(packed, t.seq_len, v.global_batch_size) if t.eval_batches > 0 else None
    return batches, evals
