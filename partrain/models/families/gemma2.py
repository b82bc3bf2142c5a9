"""Gemma 2 at runtime: Gemma 3's paths and four norms a layer, one rotary base for every layer, and
no per-head q/k norms. Its score caps are HF's own: attn_logit_softcapping inside transformers'
eager attention (and partrain's Ulysses attention; ring attention refuses it), final_logit_softcapping
on the logits, which HF's causal-LM forward applies and partrain applies where it runs the head itself
(the pipeline's last stage, the chunked loss: models/logits.py). The planner's side is
blueprint/families/gemma2.py."""

from __future__ import annotations

from dataclasses import replace

from partrain.models.families.gemma3 import GEMMA3

GEMMA2 = replace(GEMMA3, family="gemma2", archs=("gemma2",))
