"""Batches of fine-tuning examples, one example per row, padded (data.packing=false): the interface of
loader.TokenBatches. Packed windows of several examples are partrain.data.example_packing's.

Row of example e (ids x, labels l, n tokens): inputs = x[:seq_len] without its last token, padded
with the pad id to seq_len; labels = l shifted by one (labels[t] = l[t + 1], the loss's target for
inputs[t]), -100 on the padding. An example longer than seq_len + 1 tokens is cut there (counted in
``truncated``), or left out with data.long_examples=skip (the preflight refuses it under the default,
error: partrain.data.long_examples); one with no trained token left after the cut is dropped (counted
in ``dropped``), so every row, and so every microbatch, holds at least one labelled token.

Order: a seeded permutation of the usable training examples per epoch, the same for every layout;
dp rank r takes contiguous rows of the global batch, as TokenBatches does. ``label_count(step)`` is
the global batch's labelled tokens, which every rank knows without communicating: the engines divide
the summed token losses by it, so the loss is the same for every layout (partrain.train.engine).
"""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from partrain.data.chat import IGNORE_INDEX
from partrain.data.examples import RENDERING_COVERS, Examples, batch_identity, example_label_counts
from partrain.data.loader import Batch, DataPosition, rank_rows
from partrain.errors import ConfigError, Problem


def _usable(
    examples: Examples, first: int, stop: int, seq_len: int, long_examples: str = "truncate"
) -> Tuple[np.ndarray, np.ndarray, int]:
    """(indices of the examples with a trained token in their row, those rows' label counts, how many are
    longer than a row: truncated, or with long_examples=skip left out)."""
    counts = example_label_counts(examples, first, stop, seq_len)
    lengths = examples.offsets[first + 1 : stop + 1] - examples.offsets[first:stop]
    long = lengths > seq_len + 1
    keep = np.nonzero((counts > 0) & ~(long & (long_examples == "skip")))[0]
    return keep + first, counts[keep], int(np.sum(long))


def _too_few(
    split: str, usable: int, dropped: int, global_batch_size: int, fix: str, windows: Optional[Tuple[int, int]] = None
) -> ConfigError:
    """A split with fewer rows than one global batch. windows: (packed windows, seq_len) when the rows
    are packed windows: then the windows are what is compared with the batch."""
    left_out = (
        f"{dropped} more are left out: no trained token within train.seq_len, or longer than it with "
        "data.long_examples=skip"
    )
    if windows is None:
        rule = f"the {split} split holds {usable} usable examples ({left_out}), fewer than one global batch"
    else:
        rule = (
            f"the {split} split's {usable} usable examples ({left_out}) pack into {windows[0]} windows of "
            f"train.seq_len={windows[1]}, fewer than one global batch of {global_batch_size} windows"
        )
    return ConfigError(Problem("train.global_batch_size", global_batch_size, rule, fix))


class _Rows:
    """Examples as padded [rows, seq_len] inputs and shifted labels."""

    def __init__(self, examples: Examples, seq_len: int):
        self.examples = examples
        self.seq_len = seq_len

    def rows(self, indices: np.ndarray) -> Batch:
        inputs = torch.full((len(indices), self.seq_len), self.examples.pad_id, dtype=torch.long)
        labels = torch.full((len(indices), self.seq_len), IGNORE_INDEX, dtype=torch.long)
        for row, e in enumerate(indices.tolist()):
            start = int(self.examples.offsets[e])
            n = min(int(self.examples.offsets[e + 1]) - start, self.seq_len + 1)
            ids = np.asarray(self.examples.ids[start : start + n], dtype=np.int64)
            lab = np.asarray(self.examples.labels[start : start + n], dtype=np.int64)
            inputs[row, : n - 1] = torch.from_numpy(ids[:-1])
            labels[row, : n - 1] = torch.from_numpy(lab[1:])
        return inputs, labels


class ExampleBatches(DataPosition):
    """Shuffled padded training batches of examples; resumable, identical across dp layouts."""

    SIZE_FIELD = "n_examples"
    ORDERED_FIELD = "n_examples"
    IDENTITY_COVERS = RENDERING_COVERS

    def __init__(
        self, examples: Examples, seq_len: int, global_batch_size: int, seed: int, long_examples: str = "truncate"
    ):
        self._rows = _Rows(examples, seq_len)
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.index, self.counts, self.truncated = _usable(examples, 0, examples.n_train, seq_len, long_examples)
        self.dropped = examples.n_train - len(self.index)
        """Training examples left out: no trained token within seq_len, or too long with long_examples=skip."""
        self.n_examples = len(self.index)
        self.identity = batch_identity(examples, long_examples, self.truncated)
        if self.n_examples < global_batch_size:
            raise _too_few(
                "training", self.n_examples, self.dropped, global_batch_size, "lower it, or raise train.seq_len"
            )
        self.steps_per_epoch = self.n_examples // global_batch_size
        self.step = 0

    def positions(self, step: int) -> np.ndarray:
        """Positions (into the usable examples) of the global batch of ``step``."""
        return self.batch_order(step)

    def rank_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """(inputs, labels), each [global_batch_size / dp_size, seq_len]: rank ``dp_rank``'s rows."""
        rows = rank_rows(self.global_batch_size, dp_rank, dp_size)
        return self._rows.rows(self.index[self.positions(step)[rows]])

    def label_count(self, step: int) -> int:
        """Labelled tokens of the whole global batch of ``step`` (every rank computes the same)."""
        return int(self.counts[self.positions(step)].sum())

    def label_share(self, step: int) -> float:
        """Labelled tokens per row over the global batch of ``step`` (what the engines normalise by)."""
        return self.label_count(step) / self.global_batch_size


class EvalExampleBatches:
    """Held-out examples (the last data.eval_fraction of the rows) in row order, as EvalBatches."""

    def __init__(self, examples: Examples, seq_len: int, global_batch_size: int, long_examples: str = "truncate"):
        self._rows = _Rows(examples, seq_len)
        self.global_batch_size = global_batch_size
        self.index, self.counts, _ = _usable(examples, examples.n_train, examples.n_examples, seq_len, long_examples)
        dropped = examples.n_examples - examples.n_train - len(self.index)
        if len(self.index) < global_batch_size:
            raise _too_few(
                "eval", len(self.index), dropped, global_batch_size, "raise data.eval_fraction, or train.eval_batches=0"
            )
        self.num_batches = len(self.index) // global_batch_size

    def _positions(self, i: int) -> np.ndarray:
        first = (i % self.num_batches) * self.global_batch_size
        return np.arange(first, first + self.global_batch_size)

    def eval_batch(self, i: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        if i < 0:
            raise ValueError(f"eval batch index must be >= 0, got {i}")
        rows = rank_rows(self.global_batch_size, dp_rank, dp_size)
        return self._rows.rows(self.index[self._positions(i)[rows]])

    def label_share(self, i: int) -> float:
        """Labelled tokens per row over eval batch i."""
        return int(self.counts[self._positions(i)].sum()) / self.global_batch_size

    def batches(self, count: int, dp_rank: int = 0, dp_size: int = 1) -> Iterator[Batch]:
        for i in range(count):
            yield self.eval_batch(i, dp_rank, dp_size)
