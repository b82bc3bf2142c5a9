"""Deterministic batches of token windows, identical for every data-parallel layout.

A token file of n tokens is cut into ``(n - 1) // seq_len`` windows: window k covers tokens
``[k*seq_len, k*seq_len + seq_len + 1)``. Consecutive windows share one token (the last label
of one is the first input of the next), so every token after the first is a prediction target
exactly once per pass and the inputs of different windows never overlap.

Training (`TokenBatches`): step s of epoch e = s // steps_per_epoch takes the next
``global_batch_size`` windows of a permutation of all windows seeded by (seed, e). Windows
left over at the end of an epoch (fewer than one batch) are skipped in that epoch; the next
permutation puts them elsewhere. A global batch is a function of (file, seq_len,
global_batch_size, seed, step) only, and data-parallel rank r of dp takes rows
``[r*B/dp, (r+1)*B/dp)`` of it: the ranks' rows put together are exactly the global batch,
whatever dp is, which is what makes multi-process runs comparable with one process.

Evaluation (`EvalBatches`): the eval file's windows in file order, no shuffling, batch i is
windows ``[i*B, (i+1)*B)`` (wrapping after the last complete batch), split over ranks the same way.

Labels are returned already shifted (``labels[:, t]`` is the token after ``inputs[:, t]``):
compute the loss directly against them, do not pass them as ``labels=`` to a Hugging Face
model, which would shift them a second time.

Token files are memory-mapped: a batch reads only its own windows from disk.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple, Union

import numpy as np
import torch

from partrain.data.batch_check import too_short
from partrain.errors import ConfigError, Problem

Batch = Tuple[torch.Tensor, torch.Tensor]
"""(inputs, labels), both LongTensor [rows, seq_len]."""


def open_tokens(path: Union[str, Path], dtype: Union[str, np.dtype]) -> np.ndarray:
    """A read-only view of a flat little-endian token file (memory-mapped; empty files allowed)."""
    dt = np.dtype(dtype).newbyteorder("<")
    size = os.path.getsize(path)
    if size % dt.itemsize:
        raise ValueError(f"{path} holds {size} bytes, not a whole number of {dt.name} tokens")
    if size == 0:
        return np.zeros(0, dtype=dt)  # np.memmap cannot map an empty file
    return np.memmap(path, dtype=dt, mode="r")


class _Windows:
    """The windows of one token file and how to turn window indices into a LongTensor."""

    def __init__(self, token_file: Union[str, Path], dtype: Union[str, np.dtype], seq_len: int):
        if seq_len < 1:
            raise ConfigError(Problem(key="train.seq_len", value=seq_len, rule="must be >= 1", fix="train.seq_len=128"))
        self.path = Path(token_file)
        self.dtype = np.dtype(dtype).name
        self.seq_len = seq_len
        self.tokens = open_tokens(self.path, self.dtype)
        self.n_tokens = len(self.tokens)
        self.count = max(0, (self.n_tokens - 1) // seq_len)
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)

    def rows(self, windows: np.ndarray) -> torch.Tensor:
        """LongTensor [len(windows), seq_len + 1] holding the given windows, in that order."""
        index = windows.astype(np.int64)[:, None] * self.seq_len + self._offsets
        return torch.from_numpy(np.asarray(self.tokens[index], dtype=np.int64))


def rank_rows(batch_size: int, dp_rank: int, dp_size: int) -> slice:
    """Rows of a global batch that data-parallel rank ``dp_rank`` of ``dp_size`` owns."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is not a rank of a data-parallel group of {dp_size}")
    if batch_size % dp_size:
        divisors = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ConfigError(
            Problem(
                key="train.global_batch_size",
                value=batch_size,
                rule=f"must be divisible by the data-parallel degree {dp_size}, so every rank gets the same rows",
                fix=f"a multiple of {dp_size}, or dp in {divisors}",
            )
        )
    rows = batch_size // dp_size
    return slice(dp_rank * rows, (dp_rank + 1) * rows)


def split_inputs_labels(rows: torch.Tensor) -> Batch:
    """(inputs, labels): each window without its last token, and shifted by one."""
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


_LAYOUTS = {
    "n_tokens": ("data.format", "text", "a token stream of text"),
    "n_examples": ("data.packing", False, "fine-tuning examples one per row (data.packing=false)"),
    "n_windows": ("data.packing", True, "fine-tuning examples packed into windows (data.packing=true)"),
    "n_pairs": ("data.format", "preference", "preference pairs, two rows each (data.format=preference)"),
}
"""SIZE_FIELD -> (the key that picks this kind of position, its value, the kind in words): a saved state
names its kind by the count it carries."""


class DataPosition:
    """A deterministic batch stream's position and what its order depends on (checked on resume).

    Subclasses set ``step``, ``seed``, ``seq_len``, ``global_batch_size``, ``steps_per_epoch``, the
    counts named by ``SIZE_FIELD`` (what the order depends on) and ``ORDERED_FIELD`` (the rows the
    permutation orders), and ``rank_batch``; those whose rows are rendered
    (fine-tuning examples) also set ``identity`` (config key -> digest, what IDENTITY_COVERS says)."""

    SIZE_FIELD = "n_tokens"
    IDENTITY_COVERS = ""
    identity: Dict[str, str] = {}
    """Recorded under "rendering" only when set, so positions without one keep their old state."""
    ORDERED_FIELD = "n_windows"
    """The count of rows the per-epoch permutation orders (windows, or examples one per row)."""

    def epoch_of(self, step: int) -> int:
        """The pass over the data that ``step`` belongs to."""
        return step // self.steps_per_epoch

    def batch_order(self, step: int) -> np.ndarray:
        """Row indices of the global batch of ``step`` (int64 [global_batch_size]): epoch e's rows in
        a permutation seeded by the pair (seed, e), consumed global_batch_size at a time. The pair, not
        seed + e: with a sum, seed 1 epoch 0 and seed 0 epoch 1 would share an order."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, within = divmod(step, self.steps_per_epoch)
        cached = getattr(self, "_perm", None)  # (epoch, permutation): reused within an epoch
        if cached is None or cached[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(getattr(self, self.ORDERED_FIELD))
            cached = self._perm = (epoch, order)
        start = within * self.global_batch_size
        return cached[1][start : start + self.global_batch_size]

    def next_batch(self, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """``rank_batch`` at the current step, then advance one step."""
        batch = self.rank_batch(self.step, dp_rank, dp_size)
        self.step += 1
        return batch

    def state_dict(self) -> Dict[str, Any]:
        """The position, plus what the order depends on (checked on load)."""
        names = ("step", "seed", "seq_len", "global_batch_size", self.SIZE_FIELD)
        state: Dict[str, Any] = {name: getattr(self, name) for name in names}
        if self.identity:
            state["rendering"] = dict(self.identity)
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a saved position; a ConfigError if the saved order cannot be reproduced."""
        self._check_kind(state)
        self._check_identity(state.get("rendering") or {})
        for name, key in (
            ("seed", "train.seed"),
            ("seq_len", "train.seq_len"),
            ("global_batch_size", "train.global_batch_size"),
            (self.SIZE_FIELD, "data.source"),
        ):
            if int(state.get(name, -1)) != getattr(self, name):
                raise ConfigError(
                    Problem(
                        key=key,
                        value=getattr(self, name),
                        rule=f"the checkpoint's data position was recorded with {name}={state.get(name)}; "
                        "with another value the run would not continue the same data order",
                        fix=f"resume with the original value ({state.get(name)}), or start a new run",
                    )
                )
        self.step = int(state["step"])

    def _check_kind(self, state: Dict[str, Any]) -> None:
        """Refuse a position of another kind (packed vs padded examples, text, a stream), whose count
        would otherwise be reported as missing."""
        if self.SIZE_FIELD in state:
            return
        key, value, mine = _LAYOUTS[self.SIZE_FIELD]
        saved = next((_LAYOUTS[f] for f in _LAYOUTS if f in state), None)
        fix = "resume with the original data settings, or start a new run"
        if saved is not None:
            theirs = saved[2]
            if saved[0] == key:  # packed against padded examples: one setting tells them apart
                fix = f"resume with the original {key}={str(saved[1]).lower()}, or start a new run"
            else:  # text against examples: the rows' format, not the packing, changed
                key, value = "data.format", "text" if self.SIZE_FIELD == "n_tokens" else "fine-tuning rows"
        elif "stream_source" in state:
            key, value, theirs = "data.streaming", False, "a streamed run (data.streaming=true)"
        else:
            return  # not a position this code wrote: the field checks below report it
        raise ConfigError(
            Problem(
                key=key,
                value=value,
                rule=f"the checkpoint's data position was recorded by {theirs}, this run reads {mine}; "
                "the run would not continue the same data order",
                fix=fix,
            )
        )

    def _check_identity(self, saved: Dict[str, str]) -> None:
        """Refuse examples rendered otherwise than the saved position's (checked per key, only where both
        sides recorded it: old checkpoints and entries without it keep resuming)."""
        changed = sorted(k for k in set(saved) & set(self.identity) if saved[k] != self.identity[k])
        if changed:
            raise ConfigError(
                Problem(
                    # The position holds digests, not the settings: the value says what changed instead.
                    key=changed[0] if len(changed) == 1 else "data",
                    value="changed since the checkpoint" if len(changed) == 1 else changed,
                    rule=f"the checkpoint's examples were rendered with another {', '.join(changed)} "
                    f"(a resume must keep {self.IDENTITY_COVERS}); the run would continue on differently "
                    "labelled data",
                    fix="resume with the original data settings, or start a new run",
                )
            )


class TokenBatches(DataPosition):
    """Shuffled training batches from a token file, resumable, identical across dp layouts.

    ``global_batch(step)`` is the full batch; ``rank_batch(step, dp_rank, dp_size)`` is one
    rank's share; ``next_batch(dp_rank, dp_size)`` is the share at the current position and
    advances it. ``state_dict()`` records the position, so a restored loader continues with the
    very batch the interrupted one would have produced next.
    """

    def __init__(
        self, token_file: Union[str, Path], dtype: Union[str, np.dtype], seq_len: int, global_batch_size: int, seed: int
    ):
        if global_batch_size < 1:
            raise ConfigError(
                Problem(
                    key="train.global_batch_size",
                    value=global_batch_size,
                    rule="must be >= 1",
                    fix="set train.global_batch_size (or micro_batch_size, microbatches, dp)",
                )
            )
        if seed < 0:
            raise ConfigError(Problem(key="train.seed", value=seed, rule="must be >= 0", fix="train.seed=1234"))
        self._windows = _Windows(token_file, dtype, seq_len)
        self.token_file = self._windows.path
        self.dtype = self._windows.dtype
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.n_tokens = self._windows.n_tokens
        self.n_windows = self._windows.count
        if self.n_windows < global_batch_size:
            raise ConfigError(
                too_short(self.token_file, self.n_tokens, seq_len, global_batch_size, "or raise data.max_bytes")
            )
        self.steps_per_epoch = self.n_windows // global_batch_size
        """Global batches per pass over the data."""
        self.step = 0
        """Steps consumed by next_batch (the position state_dict records)."""

    @classmethod
    def from_packed(cls, packed: Any, seq_len: int, global_batch_size: int, seed: int) -> "TokenBatches":
        """Training batches over a ``PackedData``'s train split."""
        return cls(packed.train_path, packed.dtype, seq_len, global_batch_size, seed)

    def windows(self, step: int) -> np.ndarray:
        """Window indices of the global batch of ``step`` (int64 [global_batch_size])."""
        return self.batch_order(step)

    def global_batch(self, step: int) -> torch.Tensor:
        """LongTensor [global_batch_size, seq_len + 1]: the windows of ``step`` (inputs + next token)."""
        return self._windows.rows(self.windows(step))

    def rank_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """(inputs, labels), each [global_batch_size / dp_size, seq_len]: rank ``dp_rank``'s
        contiguous rows of ``global_batch(step)``. Reads only those rows."""
        rows = rank_rows(self.global_batch_size, dp_rank, dp_size)
        return split_inputs_labels(self._windows.rows(self.windows(step)[rows]))


class EvalBatches:
    """Held-out batches in file order, the same for every layout and every evaluation.

    ``eval_batch(i, dp_rank, dp_size)`` is rank ``dp_rank``'s rows of eval batch i (windows
    ``[i*B, (i+1)*B)`` with B = global_batch_size, i taken modulo ``num_batches``). Use the
    training global batch size and split a rank's rows into microbatches as in training, so
    the evaluated windows do not depend on dp or the microbatch size.
    """

    def __init__(self, token_file: Union[str, Path], dtype: Union[str, np.dtype], seq_len: int, global_batch_size: int):
        if global_batch_size < 1:
            raise ConfigError(
                Problem(
                    key="train.global_batch_size",
                    value=global_batch_size,
                    rule="must be >= 1",
                    fix="set train.global_batch_size",
                )
            )
        self._windows = _Windows(token_file, dtype, seq_len)
        self.seq_len = seq_len
        self.global_batch_size = global_batch_size
        self.n_windows = self._windows.count
        if self.n_windows < global_batch_size:
            raise ConfigError(
                too_short(
                    self._windows.path,
                    self._windows.n_tokens,
                    seq_len,
                    global_batch_size,
                    "or raise data.eval_fraction or data.max_bytes",
                )
            )
        self.num_batches = self.n_windows // global_batch_size
        """Distinct eval batches in the file."""

    @classmethod
    def from_packed(cls, packed: Any, seq_len: int, global_batch_size: int) -> "EvalBatches":
        """Eval batches over a ``PackedData``'s eval split."""
        return cls(packed.eval_path, packed.dtype, seq_len, global_batch_size)

    def eval_batch(self, i: int, dp_rank: int = 0, dp_size: int = 1) -> Batch:
        """(inputs, labels), each [global_batch_size / dp_size, seq_len]: rank ``dp_rank``'s rows of batch i."""
        if i < 0:
            raise ValueError(f"eval batch index must be >= 0, got {i}")
        rows = rank_rows(self.global_batch_size, dp_rank, dp_size)
        first = (i % self.num_batches) * self.global_batch_size
        return split_inputs_labels(self._windows.rows(np.arange(first + rows.start, first + rows.stop)))

    def batches(self, count: int, dp_rank: int = 0, dp_size: int = 1) -> Iterator[Batch]:
        """Eval batches 0..count-1 for one rank."""
        for i in range(count):
            yield self.eval_batch(i, dp_rank, dp_size)
