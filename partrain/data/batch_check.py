"""Whether a token file holds one batch: the launcher's check before any process starts, and the
loaders' own refusal, from the token counts alone (no torch import: the CLI runs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List

from partrain.errors import Problem


def batch_problems(packed: Any, seq_len: int, global_batch_size: int, with_eval: bool) -> List[Problem]:
    """What `TokenBatches.from_packed` (and `EvalBatches.from_packed` when `with_eval`) would refuse
    for lack of tokens, found from the token counts alone: the launcher's check before any process starts."""
    splits = [(packed.train_path, packed.n_train_tokens, "or raise data.max_bytes")]
    if with_eval:
        splits.append((packed.eval_path, packed.n_eval_tokens, "or raise data.eval_fraction or data.max_bytes"))
    return [
        too_short(Path(path), n_tokens, seq_len, global_batch_size, more)
        for path, n_tokens, more in splits
        if max(0, (n_tokens - 1) // seq_len) < global_batch_size
    ]


def text_epoch_counts(packed: Any, seq_len: int, global_batch_size: int) -> tuple:
    """("windows", training windows of one pass, global batches per pass), as `TokenBatches` counts them."""
    n_windows = max(0, (packed.n_train_tokens - 1) // seq_len)
    return "windows", n_windows, n_windows // global_batch_size


def too_short(path: Path, n_tokens: int, seq_len: int, batch: int, more: str) -> Problem:
    n_windows = max(0, (n_tokens - 1) // seq_len)
    longest = (n_tokens - 1) // batch
    fix = f"train.seq_len <= {longest}, " if longest >= 1 else ""
    return Problem(
        key="train.seq_len",
        value=seq_len,
        rule=(
            f"{path} holds {n_tokens} tokens: {n_windows} windows of seq_len+1={seq_len + 1} tokens, "
            f"fewer than one batch of {batch} sequences"
        ),
        fix=f"{fix}a smaller global batch, {more}",
    )
