"""Full initial value of one parameter or buffer, from HF's own init code, seeded per name.

Why reuse HF's `_init_weights` instead of a table of rules: it is the definition of "what HF does"
for each family (normal(0, initializer_range) for Linear/Embedding, zeros for biases, ones for
norms, GPT-2's 1/sqrt(2 n_layer) c_proj scaling, 3-D expert tensors, routers, rotary inv_freq,
padding rows), so new families and new transformers releases need no code here.

How: a *shadow* copy of the model lives on the meta device. To produce tensor `fqn`, one real CPU
tensor of its full shape is swapped into the shadow and HF's init is run on the modules that can
write it (its owner, then each ancestor, in the order of HF's post-order `initialize_weights`),
every time with the default CPU generator freshly seeded from (seed, fqn). The other tensors stay
on meta, where init ops are no-ops that consume no random numbers. The value therefore depends only
on the seed, the name and the config: never on sharding, rank, device or the order of calls.
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterator, List, Tuple

import torch
from torch import nn


def name_seed(seed: int, fqn: str) -> int:
    """A 63-bit seed from (seed, fqn), stable across processes and Python versions (unlike hash())."""
    digest = hashlib.sha256(f"{int(seed)}\x00{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class InitOracle:
    """Generates full initial values of `shadow`'s tensors; `shadow` is a meta HF model it owns."""

    def __init__(self, shadow: nn.Module, seed: int):
        self.shadow = shadow
        self.seed = int(seed)

    @torch.no_grad()
    def value(self, fqn: str) -> torch.Tensor:
        """Full initial value (on CPU) of the parameter or buffer named `fqn` in the plain HF model."""
        chain = _owner_chain(self.shadow, fqn)
        owner, name = chain[0], fqn.rpartition(".")[2]
        slots = owner._parameters if name in owner._parameters else owner._buffers
        placeholder = slots[name]
        if placeholder is None:
            raise KeyError(f"{fqn} is None in the model")
        # NaN marks "not written": HF init that does not touch a tensor must not pass silently.
        full = (
            torch.full(placeholder.shape, math.nan, dtype=placeholder.dtype)
            if placeholder.is_floating_point()
            else torch.zeros(placeholder.shape, dtype=placeholder.dtype)
        )
        slots[name] = (
            nn.Parameter(full, requires_grad=placeholder.requires_grad)
            if isinstance(placeholder, nn.Parameter)
            else full
        )
        try:
            with torch.random.fork_rng(devices=[]):  # leave the caller's CPU random state untouched
                for module, init_owner in _writers(chain):
                    torch.default_generator.manual_seed(name_seed(self.seed, fqn))
                    init_owner._init_weights(module)
        finally:
            slots[name] = placeholder  # the shadow never keeps more than one real tensor
        if full.is_floating_point() and torch.isnan(full).any():
            raise NotImplementedError(
                f"transformers' _init_weights does not initialise {fqn}; "
                "partrain cannot derive its initial value on the meta device"
            )
        return full


def _owner_chain(root: nn.Module, fqn: str) -> List[nn.Module]:
    """Modules from the one owning `fqn` up to the root."""
    chain = [root]
    for part in fqn.split(".")[:-1]:
        chain.append(getattr(chain[-1], part))
    return chain[::-1]


def _writers(chain: List[nn.Module]) -> Iterator[Tuple[nn.Module, nn.Module]]:
    """(module, the PreTrainedModel whose _init_weights HF applies to it), owner first.

    HF's `initialize_weights` dispatches each module to its nearest enclosing PreTrainedModel
    (itself included), so a base model nested in the causal-LM wrapper uses its own _init_weights.
    """
    from transformers import PreTrainedModel

    for i, module in enumerate(chain):
        init_owner = next(m for m in chain[i:] if isinstance(m, PreTrainedModel))
        yield module, init_owner
