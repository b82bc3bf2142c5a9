"""`data.streaming=true`: batches tokenized on the fly, for corpora too large to tokenize ahead.

No cache entry is written. Every worker reads the corpus (files, or a `datasets` source as an
IterableDataset) from its start, tokenizes the documents in batches as the packed cache does
(``doc eos doc eos ...``) and cuts each pass over the corpus into windows of seq_len + 1 tokens
overlapping by one token (the loader's convention; the part of a window left at a pass's end is
dropped, so every pass yields the same windows).

- Held out: with train.eval_batches > 0 the first eval_batches x global_batch_size windows of each
  pass are the eval set (kept in memory) and are never trained on.
- Order: each pass goes through a seeded shuffle buffer of `SHUFFLE_WINDOWS` windows (as
  `IterableDataset.shuffle(buffer_size)` does for rows), drained at the pass's end; global batches
  take consecutive windows of that stream. A global batch is a function of (corpus, tokenizer,
  seq_len, global_batch_size, seed, step) only and data-parallel rank r takes rows
  ``[r*B/dp, (r+1)*B/dp)``: the same for every layout, as with the cache.
- Resume: the position is the step; a restored stream replays the corpus up to it (tokenizing
  again), which is exact and costs a read of what was already trained on.
- Every rank reads and tokenizes the whole stream: no coordination between ranks and batches that
  do not depend on the layout, for the price of tokenizing every global batch on every rank.
"""

from __future__ import annotations

import itertools
from typing import Any, Dict, Iterator, List, Optional

import numpy as np
import torch

from partrain.blueprint.config.schema import DataConfig
from partrain.data.corpus import Corpus
from partrain.data.loader import Batch, rank_rows, split_inputs_labels
from partrain.data.packing import check_ids, document_batches
from partrain.data.stream_facts import STREAM_SOURCE_COVERS, stream_facts
from partrain.data.tokenizer import Tokenizer, load_tokenizer
from partrain.errors import ConfigError, Problem

SHUFFLE_WINDOWS = 1024
"""Windows held by the shuffle buffer (1024 windows of 2049 int64 tokens: 16 MiB)."""


def _pass_windows(corpus, tokenizer: Tokenizer, seq_len: int) -> Iterator[np.ndarray]:
    """One pass over the corpus as windows of seq_len + 1 tokens (int64), consecutive ones sharing a token."""
    pending: List[np.ndarray] = []
    held = 0
    for batch in document_batches(corpus.documents()):
        for ids in tokenizer.encode_batch(batch):
            check_ids(ids, tokenizer)
            pending += [np.asarray(ids, dtype=np.int64), np.array([tokenizer.eos_id], dtype=np.int64)]
            held += len(ids) + 1
            if held < seq_len + 1:
                continue
            tokens = np.concatenate(pending)
            count = (len(tokens) - 1) // seq_len
            for k in range(count):
                yield tokens[k * seq_len : k * seq_len + seq_len + 1]
            rest = tokens[count * seq_len :]
            pending, held = [rest], len(rest)


def _shuffled(windows: Iterator[np.ndarray], size: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    """`windows` through a shuffle buffer of `size`, drained in random order at the end."""
    buffer: List[np.ndarray] = []
    for window in windows:
        if len(buffer) < size:
            buffer.append(window)
            continue
        j = int(rng.integers(size))
        yield buffer[j]
        buffer[j] = window
    for j in rng.permutation(len(buffer)):
        yield buffer[int(j)]


class StreamBatches:
    """Training batches of a streaming run (the surface of `TokenBatches`: rank_batch, next_batch,
    global_batch, state_dict, load_state_dict). Steps are served in order; asking for an earlier
    step than the last one served replays the stream from its start."""

    def __init__(self, cfg: DataConfig, seq_len: int, global_batch_size: int, seed: int, eval_batches: int = 0):
        if seq_len < 1:
            raise ConfigError(Problem("train.seq_len", seq_len, "must be >= 1", "train.seq_len=128"))
        if global_batch_size < 1:
            raise ConfigError(Problem("train.global_batch_size", global_batch_size, "must be >= 1", "set it"))
        self.corpus = Corpus.from_config(cfg)
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.held_out = eval_batches * global_batch_size
        """Windows at the start of every pass kept for evaluation."""
        self.source = stream_facts(cfg)["stream_source"]
        self.step = 0
        """Steps consumed by next_batch (the position state_dict records)."""
        self._reset()

    def _reset(self) -> None:
        self._stream = self._global_batches()
        self._served = -1  # the step of self._batch
        self._batch: Optional[torch.Tensor] = None

    def _training_windows(self) -> Iterator[np.ndarray]:
        for epoch in itertools.count():
            windows = _pass_windows(self.corpus, self.tokenizer, self.seq_len)
            held = sum(1 for _ in itertools.islice(windows, self.held_out))
            rng = np.random.default_rng([self.seed, epoch])
            count = 0
            for window in _shuffled(windows, SHUFFLE_WINDOWS, rng):
                count += 1
                yield window
            if epoch == 0 and (held < self.held_out or count < self.global_batch_size):
                raise ConfigError(self._too_short(held + count))

    def _too_short(self, n_windows: int) -> Problem:
        need = self.held_out + self.global_batch_size
        return Problem(
            "train.seq_len",
            self.seq_len,
            f"data.source ({self.corpus.root}, streamed) holds {n_windows} windows of seq_len+1={self.seq_len + 1} "
            f"tokens in one pass, fewer than {need} (train.eval_batches x global batch held out, plus one batch)",
            "a smaller train.seq_len or global batch, fewer train.eval_batches, or raise data.max_bytes",
        )

    def _global_batches(self) -> Iterator[torch.Tensor]:
        windows = self._training_windows()
        while True:
            rows = list(itertools.islice(windows, self.global_batch_size))
            yield torch.from_numpy(np.stack(rows))

    def global_batch(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch_size, seq_len + 1]: the windows of ``step`` (inputs + next token)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self._served:
            self._reset()
        while self._served < step:
            self._batch = next(self._stream)
            self._served += 1
        return self._batch

    def rank_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """(inputs, labels), each [global_batch_size / dp_size, seq_len]: rank ``dp_rank``'s rows of step's batch."""
        return split_inputs_labels(self.global_batch(step)[rank_rows(self.global_batch_size, dp_rank, dp_size)])

    def next_batch(self, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """``rank_batch`` at the current step, then advance one step."""
        batch = self.rank_batch(self.step, dp_rank, dp_size)
        self.step += 1
        return batch

    def state_dict(self) -> Dict[str, Any]:
        """The position, plus what the order depends on (checked on load)."""
        return {
            "step": self.step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch_size": self.global_batch_size,
            "stream_source": self.source,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a saved position (replayed lazily); a ConfigError if the order would differ."""
        checks = (
            ("seed", "train.seed", self.seed),
            ("seq_len", "train.seq_len", self.seq_len),
            ("global_batch_size", "train.global_batch_size", self.global_batch_size),
            ("stream_source", "data.streaming", self.source),
        )
        for name, key, mine in checks:
            if state.get(name) != mine:
                saved = state.get(name, "a cached (not streamed) position" if name == "stream_source" else None)
                if name == "stream_source" and name in state:  # a digest: say what it covers instead
                    saved = f"another stream ({STREAM_SOURCE_COVERS})"
                raise ConfigError(
                    Problem(
                        key=key,
                        value=mine if name != "stream_source" else True,
                        rule=f"the checkpoint's data position was recorded with {name}={saved}; "
                        "with another value the run would not continue the same data order",
                        fix="resume with the original data settings, or start a new run",
                    )
                )
        self.step = int(state["step"])


class StreamEvalBatches:
    """The held-out windows of a streaming run (the surface of `EvalBatches`): batch i is windows
    ``[i*B, (i+1)*B)`` of the eval set, wrapping after its last batch."""

    def __init__(self, batches: StreamBatches, eval_batches: int):
        windows = _pass_windows(batches.corpus, batches.tokenizer, batches.seq_len)
        rows = list(itertools.islice(windows, eval_batches * batches.global_batch_size))
        if len(rows) < eval_batches * batches.global_batch_size or not rows:
            raise ConfigError(batches._too_short(len(rows)))
        self.windows = torch.from_numpy(np.stack(rows))
        self.global_batch_size = batches.global_batch_size
        self.n_batches = eval_batches

    def eval_batch(self, i: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        start = (i % self.n_batches) * self.global_batch_size
        rows = self.windows[start : start + self.global_batch_size]
        return split_inputs_labels(rows[rank_rows(self.global_batch_size, dp_rank, dp_size)])

    def batches(self, count: int, dp_rank: int = 0, dp_size: int = 1) -> Iterator[Batch]:
        for i in range(count):
            yield self.eval_batch(i, dp_rank, dp_size)


def open_stream(cfg: DataConfig, seq_len: int, global_batch_size: int, seed: int, eval_batches: int):
    """(StreamBatches, StreamEvalBatches or None) of a streaming run."""
    batches = StreamBatches(cfg, seq_len, global_batch_size, seed, eval_batches)
    return batches, (StreamEvalBatches(batches, eval_batches) if eval_batches > 0 else None)
