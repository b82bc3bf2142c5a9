"""The logits' score cap (Gemma 2's final_logit_softcapping): what HF's causal-LM forward does to the
head's output, for the places where partrain runs the head itself (the pipeline's last stage, the
chunked loss). Linear factors on the logits (Granite's divisor, Cohere's scale) are the stage's
business (models/families/base.py); the cap is not linear, so it must follow the head, chunk by chunk."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch


def final_softcap(config: Any) -> Optional[float]:
    """The model's logit cap (HF's `final_logit_softcapping`), or None when it has none."""
    cap = getattr(config, "final_logit_softcapping", None)
    return float(cap) if cap else None


def softcapped(logits: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """cap * tanh(logits / cap), as HF computes it; the logits unchanged without a cap."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap


@contextlib.contextmanager
def cap_lifted(config: Any) -> Iterator[Optional[float]]:
    """Within the block HF's forward leaves the logits uncapped (the chunked loss swaps the head for a
    passthrough: HF would cap the hidden states); yields the cap for the caller to apply after the head."""
    cap = final_softcap(config)
    if cap is None:
        yield None
        return
    config.final_logit_softcapping = None
    try:
        yield cap
    finally:
        config.final_logit_softcapping = cap
