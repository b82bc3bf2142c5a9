"""Batches of preference pairs (data.format=preference, data.packing=false): the interface of
partrain.data.example_batches.ExampleBatches, with a pair as the unit.

A pair is two padded rows of the examples cache, k = 2p (prompt + chosen) and 2p + 1 (prompt + rejected)
(partrain.data.preference_rows), kept next to each other in every batch: rows [c0, r0, c1, r1, ...]. Since
train.micro_batch_size is even (validated), a microbatch never splits a pair, so the preference loss of a
microbatch needs nothing from another. A pair is used when both its rows keep a trained token within
train.seq_len (and, with data.long_examples=skip, neither is longer than a row).

Order: a seeded permutation of the usable pairs per epoch, the same for every layout; dp rank r takes
contiguous pairs of the global batch (train.global_batch_size counts rows: twice the pairs). No
`label_share`: the preference loss is a mean over pairs, which the engines' mean over microbatches and
ranks already gives (every microbatch holds the same number of pairs).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from partrain.data.example_batches import _Rows, _too_few
from partrain.data.examples import RENDERING_COVERS, Examples, batch_identity, example_label_counts
from partrain.data.loader import Batch, DataPosition, rank_rows


def _usable_pairs(examples: Examples, first: int, stop: int, seq_len: int, long_examples: str):
    """(indices of the usable pairs' first rows, examples longer than a row): examples first..stop-1,
    first and stop even."""
    counts = example_label_counts(examples, first, stop, seq_len)
    lengths = examples.offsets[first + 1 : stop + 1] - examples.offsets[first:stop]
    long = lengths > seq_len + 1
    keep = (counts > 0) & ~(long & (long_examples == "skip"))
    pair_ok = keep[0::2] & keep[1::2]
    return np.nonzero(pair_ok)[0] * 2 + first, int(np.sum(long))


def _rows_of(firsts: np.ndarray) -> np.ndarray:
    """Each pair's two rows, in order: [c0, r0, c1, r1, ...]."""
    return np.stack([firsts, firsts + 1], axis=1).reshape(-1)


class PreferenceBatches(DataPosition):
    """Shuffled padded training batches of preference pairs; resumable, identical across dp layouts."""

    SIZE_FIELD = "n_pairs"
    ORDERED_FIELD = "n_pairs"
    IDENTITY_COVERS = RENDERING_COVERS

    def __init__(
        self, examples: Examples, seq_len: int, global_batch_size: int, seed: int, long_examples: str = "truncate"
    ):
        self._rows = _Rows(examples, seq_len)
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.pairs_per_step = global_batch_size // 2
        self.seed = seed
        self.firsts, self.truncated = _usable_pairs(examples, 0, examples.n_train, seq_len, long_examples)
        self.n_pairs = len(self.firsts)
        self.dropped = examples.n_train // 2 - self.n_pairs
        """Training pairs left out: a row with no trained token within seq_len, or too long with long_examples=skip."""
        self.n_examples = 2 * self.n_pairs
        self.identity = batch_identity(examples, long_examples, self.truncated)
        if self.n_examples < global_batch_size:
            raise _too_few(
                "training", self.n_examples, 2 * self.dropped, global_batch_size, "lower it, or raise train.seq_len"
            )
        self.steps_per_epoch = self.n_pairs // self.pairs_per_step
        self.step = 0

    def batch_order(self, step: int) -> np.ndarray:
        """Pair indices of the global batch of ``step``: epoch e's pairs in a permutation seeded by (seed, e)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, within = divmod(step, self.steps_per_epoch)
        cached = getattr(self, "_perm", None)
        if cached is None or cached[0] != epoch:
            cached = self._perm = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.n_pairs))
        start = within * self.pairs_per_step
        return cached[1][start : start + self.pairs_per_step]

    def rank_examples(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray:
        """The examples (cache indices) of rank ``dp_rank``'s rows at ``step``, in row order."""
        pairs = self.batch_order(step)[rank_rows(self.pairs_per_step, dp_rank, dp_size)]
        return _rows_of(self.firsts[pairs])

    def rank_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """(inputs, labels), each [global_batch_size / dp_size, seq_len]: rank ``dp_rank``'s pairs, two rows each."""
        return self._rows.rows(self.rank_examples(step, dp_rank, dp_size))

    def label_count(self, step: int) -> int:
        """Labelled tokens of the whole global batch of ``step`` (the dry run's masked share)."""
        rows = _rows_of(self.firsts[self.batch_order(step)])
        return int(example_label_counts(self._rows.examples, 0, self._rows.examples.n_train, self.seq_len)[rows].sum())


class EvalPreferenceBatches:
    """Held-out pairs (the last data.eval_fraction of the rows) in row order, as EvalBatches."""

    def __init__(self, examples: Examples, seq_len: int, global_batch_size: int, long_examples: str = "truncate"):
        self._rows = _Rows(examples, seq_len)
        self.global_batch_size = global_batch_size
        self.pairs_per_batch = global_batch_size // 2
        self.firsts, _ = _usable_pairs(examples, examples.n_train, examples.n_examples, seq_len, long_examples)
        dropped = (examples.n_examples - examples.n_train) // 2 - len(self.firsts)
        if 2 * len(self.firsts) < global_batch_size:
            raise _too_few(
                "eval",
                2 * len(self.firsts),
                2 * dropped,
                global_batch_size,
                "raise data.eval_fraction, or train.eval_batches=0",
            )
        self.num_batches = len(self.firsts) // self.pairs_per_batch

    def eval_examples(self, i: int, dp_rank: int = 0, dp_size: int = 1) -> np.ndarray:
        """The examples (cache indices) of rank ``dp_rank``'s rows of eval batch i, in row order."""
        if i < 0:
            raise ValueError(f"eval batch index must be >= 0, got {i}")
        first = (i % self.num_batches) * self.pairs_per_batch
        pairs = np.arange(first, first + self.pairs_per_batch)[rank_rows(self.pairs_per_batch, dp_rank, dp_size)]
        return _rows_of(self.firsts[pairs])

    def eval_batch(self, i: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        return self._rows.rows(self.eval_examples(i, dp_rank, dp_size))

    def batches(self, count: int, dp_rank: int = 0, dp_size: int = 1) -> Iterator[Batch]:
        for i in range(count):
            yield self.eval_batch(i, dp_rank, dp_size)
