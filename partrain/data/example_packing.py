"""Fine-tuning examples packed into train.seq_len windows with document boundaries (data.packing=true).

An example of n tokens (ids x, labels l) takes n - 1 input slots of a window: inputs x[:n-1], targets
l[1:n], position ids 0..n-2, exactly the row it would have alone (example_batches), so the model sees
the same thing packed or padded as long as attention stays inside the example. Its last token is only a
target, so the first token of the next example is never the target of the previous one. An example of
more than seq_len + 1 tokens is cut to one whole window (counted in ``truncated``), or left out with
data.long_examples=skip, as in the padded rows.

Packing rule: first fit over a buffer. The examples are taken in one seeded order (seed, fixed for the
run); each goes into the oldest of the last ``OPEN_WINDOWS`` open windows with room for it, else a new
window opens (the oldest open one is closed when more than OPEN_WINDOWS are open). The windows are then
fixed for the run: each epoch shuffles the windows (seeded by (seed, epoch), as TokenBatches shuffles
token windows), so the window count, steps per epoch and every ``label_count(step)`` are known to every
rank from the examples alone, without communication. The tail of a window after its last example is
padding (pad id, label -100, position ids restarting at 0: a document of its own, never trained).

Batches are (inputs, labels, position_ids), each [rows, seq_len]. Attention never crosses examples:
Hugging Face builds a block-diagonal causal mask from position ids that restart (masking_utils,
``find_packed_sequence_indices``, with no attention mask and no cache, which partrain never uses), and
partrain's sequence-parallel attention reads the same position ids (parallel.context_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import numpy as np
import torch

from partrain.blueprint.validate_data_format import EXAMPLE_FORMATS
from partrain.data.chat import IGNORE_INDEX
from partrain.data.example_batches import EvalExampleBatches, ExampleBatches, _too_few, _usable
from partrain.data.examples import RENDERING_COVERS, Examples, batch_identity, open_examples, uses_examples
from partrain.data.loader import DataPosition, rank_rows
from partrain.errors import ConfigError

OPEN_WINDOWS = 64
"""Windows kept open for first fit: more fill the windows better, but cost a longer scan per example."""
PACK_SALT = 0x9ACC
"""Mixed into the seed of the packing order, so it differs from the epoch permutations."""

PackedBatch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""(inputs, labels, position_ids), LongTensor [rows, seq_len] each."""


def first_fit(slots: np.ndarray, seq_len: int, open_windows: int = OPEN_WINDOWS) -> Tuple[np.ndarray, np.ndarray]:
    """(window of each entry, windows) packing entries of ``slots`` tokens (each <= seq_len), in order.

    Each entry goes into the oldest open window with room, among the last ``open_windows`` opened."""
    window = np.empty(len(slots), dtype=np.int64)
    free = np.empty(0, dtype=np.int64)  # room left in the open windows, oldest first
    first_open = 0  # index of free[0] among all windows
    for i, n in enumerate(slots.tolist()):
        fits = np.flatnonzero(free >= n)
        if len(fits):
            j = int(fits[0])
            free[j] -= n
            window[i] = first_open + j
            continue
        free = np.append(free, seq_len - n)
        window[i] = first_open + len(free) - 1
        if len(free) > open_windows:
            free, first_open = free[1:], first_open + 1
    return window, np.int64(first_open + len(free))


@dataclass(frozen=True)
class Packing:
    """Examples grouped into windows: window w holds members[starts[w]:starts[w+1]], in that order."""

    members: np.ndarray
    """Example indices (into the Examples), window by window."""
    starts: np.ndarray
    """int64 [windows + 1]."""
    slots: np.ndarray
    """Input slots each member takes (its tokens - 1, at most seq_len), aligned with members."""
    counts: np.ndarray
    """Labelled tokens of each window."""

    @property
    def n_windows(self) -> int:
        return len(self.starts) - 1

    def padding_share(self, seq_len: int) -> float:
        """Share of the windows' input slots that hold no example."""
        return 1.0 - float(self.slots.sum()) / max(1, self.n_windows * seq_len)


def pack_examples(
    examples: Examples, index: np.ndarray, counts: np.ndarray, seq_len: int, order: np.ndarray
) -> Packing:
    """Pack the examples ``index[order]`` (label counts ``counts``, aligned with index) by first fit."""
    index, counts = index[order], counts[order]
    lengths = examples.offsets[index + 1] - examples.offsets[index]
    slots = np.minimum(lengths - 1, seq_len).astype(np.int64)
    window, n_windows = first_fit(slots, seq_len)
    by_window = np.argsort(window, kind="stable")  # members of a window stay in packing order
    starts = np.zeros(int(n_windows) + 1, dtype=np.int64)
    np.cumsum(np.bincount(window, minlength=int(n_windows)), out=starts[1:])
    window_counts = np.bincount(window, weights=counts, minlength=int(n_windows)).astype(np.int64)
    return Packing(index[by_window], starts, slots[by_window], window_counts)


class _PackedRows:
    """Windows of a Packing as (inputs, labels, position_ids) tensors."""

    def __init__(self, examples: Examples, packing: Packing, seq_len: int):
        self.examples, self.packing, self.seq_len = examples, packing, seq_len

    def rows(self, windows: np.ndarray) -> PackedBatch:
        ex, p, s = self.examples, self.packing, self.seq_len
        inputs = torch.full((len(windows), s), ex.pad_id, dtype=torch.long)
        labels = torch.full((len(windows), s), IGNORE_INDEX, dtype=torch.long)
        positions = torch.zeros((len(windows), s), dtype=torch.long)
        for row, w in enumerate(windows.tolist()):
            at = 0
            for k in range(int(p.starts[w]), int(p.starts[w + 1])):
                e, n = int(p.members[k]), int(p.slots[k])
                start = int(ex.offsets[e])
                ids = np.asarray(ex.ids[start : start + n + 1], dtype=np.int64)
                lab = np.asarray(ex.labels[start : start + n + 1], dtype=np.int64)
                inputs[row, at : at + n] = torch.from_numpy(ids[:-1])
                labels[row, at : at + n] = torch.from_numpy(lab[1:])
                positions[row, at : at + n] = torch.arange(n)
                at += n
            positions[row, at:] = torch.arange(s - at)  # the padding: a document of its own
        return inputs, labels, positions


class PackedExampleBatches(DataPosition):
    """Shuffled packed training windows of examples; resumable, identical across dp layouts
    (the interface of ExampleBatches, batches carry position_ids)."""

    SIZE_FIELD = "n_windows"
    IDENTITY_COVERS = RENDERING_COVERS

    def __init__(
        self, examples: Examples, seq_len: int, global_batch_size: int, seed: int, long_examples: str = "truncate"
    ):
        self.seq_len, self.global_batch_size, self.seed = seq_len, global_batch_size, seed
        index, counts, self.truncated = _usable(examples, 0, examples.n_train, seq_len, long_examples)
        self.dropped = examples.n_train - len(index)
        """Training examples left out (no trained token within seq_len, or too long with skip)."""
        self.n_examples = len(index)
        self.identity = batch_identity(examples, long_examples, self.truncated)
        order = np.random.default_rng([seed, PACK_SALT]).permutation(len(index))
        self.packing = pack_examples(examples, index, counts, seq_len, order)
        self._rows = _PackedRows(examples, self.packing, seq_len)
        self.n_windows = self.packing.n_windows
        if self.n_windows < global_batch_size:
            raise _too_few(
                "training",
                self.n_examples,
                self.dropped,
                global_batch_size,
                "lower it, or set data.packing=false (one example per row)",
                windows=(self.n_windows, seq_len),
            )
        self.steps_per_epoch = self.n_windows // global_batch_size
        self.step = 0

    @property
    def padding_share(self) -> float:
        """Share of the training windows' input slots that are padding."""
        return self.packing.padding_share(self.seq_len)

    def windows(self, step: int) -> np.ndarray:
        """Window indices of the global batch of ``step``."""
        return self.batch_order(step)

    def rank_batch(self, step: int, dp_rank: int = 0, dp_size: int = 1) -> PackedBatch:
        """(inputs, labels, position_ids), each [global_batch_size / dp_size, seq_len]."""
        return self._rows.rows(self.windows(step)[rank_rows(self.global_batch_size, dp_rank, dp_size)])

    def label_count(self, step: int) -> int:
        """Labelled tokens of the whole global batch of ``step`` (every rank computes the same)."""
        return int(self.packing.counts[self.windows(step)].sum())

    def label_share(self, step: int) -> float:
        """Labelled tokens per row over the global batch of ``step`` (what the engines normalise by)."""
        return self.label_count(step) / self.global_batch_size


class PackedEvalExampleBatches:
    """Held-out examples packed in row order (first fit), batches of windows in order, as EvalBatches."""

    def __init__(self, examples: Examples, seq_len: int, global_batch_size: int, long_examples: str = "truncate"):
        self.global_batch_size = global_batch_size
        index, counts, _ = _usable(examples, examples.n_train, examples.n_examples, seq_len, long_examples)
        self.packing = pack_examples(examples, index, counts, seq_len, np.arange(len(index)))
        self._rows = _PackedRows(examples, self.packing, seq_len)
        if self.packing.n_windows < global_batch_size:
            raise _too_few(
                "eval",
                len(index),
                examples.n_examples - examples.n_train - len(index),
                global_batch_size,
                "raise data.eval_fraction, or train.eval_batches=0 (no eval)",
                windows=(self.packing.n_windows, seq_len),
            )
        self.num_batches = self.packing.n_windows // global_batch_size

    def _windows(self, i: int) -> np.ndarray:
        first = (i % self.num_batches) * self.global_batch_size
        return np.arange(first, first + self.global_batch_size)

    def eval_batch(self, i: int, dp_rank: int = 0, dp_size: int = 1) -> PackedBatch:
        if i < 0:
            raise ValueError(f"eval batch index must be >= 0, got {i}")
        return self._rows.rows(self._windows(i)[rank_rows(self.global_batch_size, dp_rank, dp_size)])

    def label_share(self, i: int) -> float:
        """Labelled tokens per row over eval batch i."""
        return int(self.packing.counts[self._windows(i)].sum()) / self.global_batch_size

    def batches(self, count: int, dp_rank: int = 0, dp_size: int = 1) -> Iterator[PackedBatch]:
        for i in range(count):
            yield self.eval_batch(i, dp_rank, dp_size)


def padded_share(examples: Examples, index: np.ndarray, seq_len: int) -> float:
    """Share of padding in rows of one example each (data.packing=false)."""
    lengths = examples.offsets[index + 1] - examples.offsets[index]
    return 1.0 - float(np.minimum(lengths - 1, seq_len).sum()) / max(1, len(index) * seq_len)


def packing_facts(
    examples: Examples, packing: bool, seq_len: int, global_batch_size: int, seed: int, long: str
) -> dict:
    """The run summary's "packing" of the training examples: {"packed", "rows", "examples", "padding_share",
    "truncated"} (rows: windows when packed, else one per example)."""
    if packing:
        b = PackedExampleBatches(examples, seq_len, global_batch_size, seed, long)
        rows, used, share, truncated = b.n_windows, b.n_examples, b.padding_share, b.truncated
    else:
        index, _, truncated = _usable(examples, 0, examples.n_train, seq_len, long)
        rows, used, share = len(index), len(index), padded_share(examples, index, seq_len)
    return {
        "packed": packing,
        "rows": int(rows),
        "examples": int(used),
        "padding_share": round(share, 4),
        "truncated": int(truncated),
    }


def run_packing_facts(meta_path, cfg, seq_len: int, global_batch_size: int, seed: int) -> dict:
    """{"packing": packing_facts} for the examples entry at ``meta_path`` ({} for text, or unreadable)."""
    try:
        examples = open_examples(meta_path)  # ValueError for a packed text entry
        facts = packing_facts(examples, cfg.packing, seq_len, global_batch_size, seed, cfg.long_examples)
    except (OSError, ValueError, KeyError, ConfigError):
        return {}  # the summary goes on without it; the workers already read this entry
    return {"packing": facts}


def packs_documents(cfg) -> bool:
    """Whether the run's rows are packed fine-tuning examples (data.packing of chat, prompt_completion
    or tokenized rows): attention must then stay inside each example. data.format=auto reads the first row."""
    if not cfg.packing or cfg.streaming:
        return False
    if cfg.format != "auto":
        return cfg.format in EXAMPLE_FORMATS
    return uses_examples(cfg)


def example_batch_classes(packing: bool, paired: bool = False) -> tuple:
    """(training, eval) batch classes of examples: preference pairs (paired: Examples.paired, never packed),
    packed windows (data.packing) or padded rows."""
    if paired:
        from partrain.data.preference_batches import EvalPreferenceBatches, PreferenceBatches

        return PreferenceBatches, EvalPreferenceBatches
    if packing:
        return PackedExampleBatches, PackedEvalExampleBatches
    return ExampleBatches, EvalExampleBatches


def example_batch_problems(
    examples: Examples,
    seq_len: int,
    global_batch_size: int,
    with_eval: bool,
    long_examples: str = "truncate",
    packing: bool = False,
) -> list:
    """The problems the workers would meet opening these examples (the preflight's check)."""
    problems = []
    train_cls, eval_cls = example_batch_classes(packing, examples.paired)
    try:
        train_cls(examples, seq_len, global_batch_size, 0, long_examples)
    except ConfigError as err:
        problems += err.problems
    if with_eval:
        try:
            eval_cls(examples, seq_len, global_batch_size, long_examples)
        except ConfigError as err:
            problems += err.problems
    return problems


def example_epoch_counts(
    examples: Examples, seq_len: int, global_batch_size: int, long_examples: str, packing: bool
) -> Optional[Tuple[str, int, int]]:
    """(what a batch row is, how many of them one pass over the training split holds, global batches
    per pass), as the workers' training batches count them; None when they would not open."""
    train_cls, _ = example_batch_classes(packing, examples.paired)
    try:
        batches = train_cls(examples, seq_len, global_batch_size, 0, long_examples)
    except ConfigError:
        return None
    if packing:
        return "packed windows", batches.n_windows, batches.steps_per_epoch
    return "examples", batches.n_examples, batches.steps_per_epoch


def resume_position_problems(
    examples: Examples,
    saved: dict,
    seq_len: int,
    global_batch_size: int,
    seed: int,
    long_examples: str = "truncate",
    packing: bool = False,
) -> list:
    """The problems the workers would meet loading a checkpoint's data position ``saved`` (its record's
    extra["data"]) over these examples: lets the preflight refuse a resume on other data settings with
    exit 2 before any process starts, by the very check the workers run."""
    train_cls, _ = example_batch_classes(packing, examples.paired)
    try:
        train_cls(examples, seq_len, global_batch_size, seed, long_examples).load_state_dict(saved)
    except ConfigError as err:
        return list(err.problems)
    return []
