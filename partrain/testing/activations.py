"""Count the activation bytes autograd keeps for backward, with saved-tensor hooks."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, Iterable, Iterator

import torch


@contextmanager
def count_saved_bytes(params: Iterable[torch.Tensor] = ()) -> Iterator[Dict[str, int]]:
    """Bytes of distinct storages saved for backward inside the block (parameters excluded).

    Storages are counted once even when several saved tensors view them; tensors that are
    parameters (requires_grad leaves) are not activations and are skipped, and so are views of
    the storages of `params` (a linear layer saves `weight.t()`, a view, not the parameter).
    """
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = set()
    totals = {"bytes": 0, "tensors": 0}

    def pack(t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t
        local = t.to_local() if hasattr(t, "to_local") else t
        try:
            storage = local.untyped_storage()
            if storage.data_ptr() in skip:
                return t
            key = (storage.data_ptr(), storage.nbytes())
            size = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            key, size = id(local), local.numel() * local.element_size()
        if key not in seen:
            seen.add(key)
            totals["bytes"] += size
            totals["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield totals
