"""partrain's data pipeline: corpus -> tokens -> packed cache files -> deterministic batches.

Typical use::

    packed = prepare_tokens(cfg.data)                    # once, before workers start
    packed = open_packed(meta_path)                      # in each worker
    train = TokenBatches.from_packed(packed, seq_len, global_batch_size, seed)
    inputs, labels = train.next_batch(dp_rank, dp_size)
    evals = EvalBatches.from_packed(packed, seq_len, global_batch_size)
"""

from partrain.data.corpus import BUILTIN, Corpus
from partrain.data.loader import Batch, EvalBatches, TokenBatches, batch_problems, open_tokens
from partrain.data.packing import (
    PackedData,
    cache_root_for,
    default_cache_root,
    open_packed,
    prepare_tokens,
    token_dtype,
)
from partrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
    tokenizer_name,
)

__all__ = [
    "BUILTIN",
    "Batch",
    "ByteTokenizer",
    "Corpus",
    "EvalBatches",
    "HFTokenizer",
    "PackedData",
    "TokenBatches",
    "Tokenizer",
    "batch_problems",
    "cache_root_for",
    "default_cache_root",
    "load_tokenizer",
    "open_packed",
    "open_tokens",
    "prepare_tokens",
    "token_dtype",
    "tokenizer_name",
]
