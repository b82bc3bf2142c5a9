"""Count the activation bytes autograd keeps for backward, with saved-tensor hooks (the one counter
used by the pipeline tests, the planner's measurements and the benchmarks).

Every tensor saved for backward inside the block is counted by its storage, once however many ops
save it or view it. Parameters (and any leaf that requires grad) are weights, not activations, and
are skipped, as are the storages of the `params` given and meta tensors. Two figures come out:

- `total`: bytes of every distinct storage saved in the block (what one forward leaves for
  backward, the planner's "activation bytes");
- `peak`: the most bytes held at once, as autograd frees saved tensors during backward (what a
  pipeline schedule keeps in flight over a whole step).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if hasattr(t, "to_local") else t
    # A functional collective's result (AsyncCollectiveTensor, e.g. the reduce-scattered output of a
    # vocabulary-parallel embedding under Megatron-SP) has no storage of its own: count the tensor it wraps.
    elem = getattr(local, "elem", None)
    return elem if isinstance(elem, torch.Tensor) else local


class _Held:
    """What autograd keeps for one saved tensor; dropping it lowers the running total."""

    __slots__ = ("tensor", "key", "ledger")

    def __init__(self, tensor: torch.Tensor, key: int, ledger: "SavedActivations"):
        self.tensor, self.key, self.ledger = tensor, key, ledger

    def __del__(self):
        self.ledger._release(self.key)


class SavedActivations:
    """`with SavedActivations(params) as saved: ...`, then `saved.total`, `saved.peak`, `saved.tensors`."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self._skip = set()
        for p in params:
            local = _local(p)
            if local.device.type != "meta":
                self._skip.add(local.untyped_storage().data_ptr())
        self._held: Dict[int, List[int]] = {}  # storage pointer -> [references, bytes]
        self._seen: set = set()
        self.total = 0
        self.tensors = 0
        self.current = 0
        self.peak = 0
        self._hooks: Optional[Any] = None

    def _pack(self, t: torch.Tensor):
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t
        local = _local(t)
        if local.device.type == "meta":
            return t
        try:
            storage = local.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            return t
        if key == 0 or key in self._skip:
            return t
        if key not in self._seen:
            self._seen.add(key)
            self.total += size
            self.tensors += 1
        entry = self._held.get(key)
        if entry is None:
            self._held[key] = [1, size]
            self.current += size
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        return _Held(t, key, self)

    @staticmethod
    def _unpack(x):
        return x.tensor if isinstance(x, _Held) else x

    def _release(self, key: int) -> None:
        entry = self._held.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self._held[key]

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def saved_activation_bytes(fn: Callable[[], Any], params: Sequence[torch.Tensor] = ()) -> Tuple[Any, int]:
    """Run fn() and return (its result, peak bytes autograd held in saved tensors meanwhile).
    Wrap a whole `PipelineRunner.step` to see how many microbatches a schedule keeps in flight."""
    with SavedActivations(params) as saved:
        result = fn()
    return result, saved.peak


class ModuleSavedActivations:
    """What one module (a decoder layer) saves for backward during its forward, counted like
    `SavedActivations` (each storage once, `params` skipped), whatever runs around it:

        with ModuleSavedActivations(layer, params) as counted:
            loss = forward_loss(model, x, y)
        counted.total

    Hooks open a `SavedActivations` when the module's forward starts and close it when it returns,
    so a block's pre-hooks (Megatron-SP's gather) count and the rest of the model does not."""

    def __init__(self, module: torch.nn.Module, params: Iterable[torch.Tensor] = ()):
        self.module, self.params = module, list(params)
        self.total = 0
        self._open: Optional[SavedActivations] = None
        self._handles: List[Any] = []

    def _start(self, *_):
        self._open = SavedActivations(self.params).__enter__()

    def _stop(self, *_):
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self.total += self._open.total
            self._open = None

    def __enter__(self) -> "ModuleSavedActivations":
        self._handles = [
            self.module.register_forward_pre_hook(self._start, prepend=True),
            self.module.register_forward_hook(self._stop, always_call=True),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
