"""`data.streaming=true` for fine-tuning rows (chat, prompt_completion, tokenized): examples rendered on
the fly, one padded example per row, nothing cached.

The design is streaming.StreamBatches' with an example in place of a token window: every rank reads the
rows from the start, renders each with the renderer of the examples cache (partrain.data.examples, so
templates, masks and row checks are the same) into one padded row (inputs, shifted labels: -100 on the
prompt, the template and the padding, as example_batches builds it), passes the rows through the seeded
shuffle buffer and takes consecutive rows as global batches; dp rank r takes rows [r*B/dp, (r+1)*B/dp).
A global batch is a function of (rows, tokenizer, templates, seq_len, global batch, seed, step) only, so
it is the same for every layout, and every rank knows the global batch's label count without
communicating (``label_share``: the loss is normalised by it, as for cached examples).

- Held out: with train.eval_batches > 0 the first eval_batches x global batch examples of each pass are
  the eval set, never trained on (data.eval_fraction is not used, as for streamed text).
- Long examples: data.long_examples=truncate cuts an example to its row, skip leaves it out; error cannot
  be checked ahead on a stream and is refused by validation. An example with no trained token left in
  its row is left out.
- Bad rows: data.skip_bad_rows=true skips them; otherwise the worker that meets one stops with the
  preflight's message (the dry run and the launch render the first global batches only).
- Packing streamed examples into shared windows is not built (validation refuses data.packing=true).
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional

import numpy as np
import torch

from partrain.blueprint.config.schema import DataConfig
from partrain.data.chat import IGNORE_INDEX, ChatRowError
from partrain.data.examples import _renderer, resolve_format, row_source
from partrain.data.loader import Batch, rank_rows
from partrain.data.streaming import SHUFFLE_WINDOWS, StreamBatches, _shuffled
from partrain.errors import ConfigError, Problem


def padded_row(ids, labels, seq_len: int, pad_id: int) -> np.ndarray:
    """int64 [2, seq_len]: inputs (the example without its last token, then pad_id) and the labels shifted
    by one (-100 after the example); cut at seq_len + 1 tokens."""
    n = min(len(ids), seq_len + 1)
    row = np.full((2, seq_len), pad_id, dtype=np.int64)
    row[1, :] = IGNORE_INDEX
    row[0, : n - 1] = np.asarray(ids[: n - 1], dtype=np.int64)
    row[1, : n - 1] = np.asarray(labels[1:n], dtype=np.int64)
    return row


class ExampleStreamBatches(StreamBatches):
    """Training batches of streamed examples (the surface of ExampleBatches: rank_batch, next_batch,
    label_count, label_share, state_dict, load_state_dict)."""

    def __init__(self, cfg: DataConfig, seq_len: int, global_batch_size: int, seed: int, eval_batches: int = 0):
        super().__init__(cfg, seq_len, global_batch_size, seed, eval_batches)
        self.cfg = cfg
        self.fmt = resolve_format(cfg)
        self.render = _renderer(cfg, self.fmt, self.tokenizer)
        self.pad_id = self.tokenizer.eos_id

    def pass_rows(self) -> Iterator[np.ndarray]:
        """One pass over the source as padded rows [2, seq_len], in row order."""
        for path, where, raw in row_source(self.cfg):
            try:
                example = self.render(raw)
            except ChatRowError as exc:
                if self.cfg.skip_bad_rows:
                    continue
                raise ConfigError(
                    Problem(
                        "data.source",
                        path,
                        f"{path} {where}: {exc}",
                        f"fix or remove {where}, or data.skip_bad_rows=true",
                    )
                ) from None
            too_long = len(example.input_ids) > self.seq_len + 1
            if too_long and self.cfg.long_examples == "skip":
                continue
            row = padded_row(example.input_ids, example.labels, self.seq_len, self.pad_id)
            if np.any(row[1] != IGNORE_INDEX):
                yield row

    def _training_windows(self) -> Iterator[np.ndarray]:
        for epoch in itertools.count():
            rows = self.pass_rows()
            held = sum(1 for _ in itertools.islice(rows, self.held_out))
            rng = np.random.default_rng([self.seed, epoch])
            count = 0
            for row in _shuffled(rows, SHUFFLE_WINDOWS, rng):
                count += 1
                yield row
            if epoch == 0 and (held < self.held_out or count < self.global_batch_size):
                raise ConfigError(self._too_short(held + count))

    def _too_short(self, n_rows: int) -> Problem:
        return Problem(
            "train.global_batch_size",
            self.global_batch_size,
            f"data.source ({self.cfg.source}, streamed) holds {n_rows} usable examples in one pass, fewer than "
            f"{self.held_out + self.global_batch_size} (train.eval_batches x global batch held out, plus one batch)",
            "a smaller global batch, fewer train.eval_batches, or more rows",
        )

    def rank_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """(inputs, labels), each [global_batch_size / dp_size, seq_len]: rank ``dp_rank``'s rows."""
        rows = self.global_batch(step)[rank_rows(self.global_batch_size, dp_rank, dp_size)]
        return rows[:, 0], rows[:, 1]

    def label_count(self, step: int) -> int:
        """Labelled tokens of the whole global batch of ``step`` (every rank renders the same batch)."""
        return int((self.global_batch(step)[:, 1] != IGNORE_INDEX).sum())

    def label_share(self, step: int) -> float:
        return self.label_count(step) / self.global_batch_size


class ExampleStreamEvalBatches:
    """The held-out examples of a streamed run: batch i is rows [i*B, (i+1)*B) of the eval set, wrapping."""

    def __init__(self, batches: ExampleStreamBatches, eval_batches: int):
        rows = list(itertools.islice(batches.pass_rows(), eval_batches * batches.global_batch_size))
        if len(rows) < eval_batches * batches.global_batch_size or not rows:
            raise ConfigError(batches._too_short(len(rows)))
        self.rows = torch.from_numpy(np.stack(rows))
        self.global_batch_size = batches.global_batch_size
        self.n_batches = eval_batches

    def _batch(self, i: int) -> torch.Tensor:
        start = (i % self.n_batches) * self.global_batch_size
        return self.rows[start : start + self.global_batch_size]

    def eval_batch(self, i: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        rows = self._batch(i)[rank_rows(self.global_batch_size, dp_rank, dp_size)]
        return rows[:, 0], rows[:, 1]

    def label_share(self, i: int) -> float:
        return int((self._batch(i)[:, 1] != IGNORE_INDEX).sum()) / self.global_batch_size

    def batches(self, count: int, dp_rank: int = 0, dp_size: int = 1) -> Iterator[Batch]:
        for i in range(count):
            yield self.eval_batch(i, dp_rank, dp_size)


def open_example_stream(cfg: DataConfig, seq_len: int, global_batch_size: int, seed: int, eval_batches: int):
    """(ExampleStreamBatches, ExampleStreamEvalBatches or None) of a streamed fine-tuning run."""
    batches = ExampleStreamBatches(cfg, seq_len, global_batch_size, seed, eval_batches)
    evals: Optional[ExampleStreamEvalBatches] = None
    if eval_batches > 0:
        evals = ExampleStreamEvalBatches(batches, eval_batches)
    return batches, evals


def streams_examples(cfg: DataConfig) -> bool:
    """Whether a data.streaming run reads fine-tuning rows (its format resolved from the first row)."""
    from partrain.blueprint.validate_data_format import EXAMPLE_FORMATS

    return cfg.streaming and resolve_format(cfg) in EXAMPLE_FORMATS
