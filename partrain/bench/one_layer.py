"""One decoder layer of the run's HF model, alone, and its forward + backward as the runtime runs it:
what `partrain bench compute` times (compute.py, cpu/host_costs.py)."""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch

from partrain.blueprint.planner.spec import PlanSpec

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def one_layer(run, device):
    """The run's HF model cut to one decoder layer, materialised (HF's own init) on `device`."""
    from transformers import AutoModelForCausalLM

    from partrain.models.adapters import get_adapter
    from partrain.models.build import hf_config

    config = hf_config(run.model)
    config.num_hidden_layers = 1
    for key in ("mlp_only_layers", "layer_types"):  # per-layer lists sized for the full model
        if isinstance(getattr(config, key, None), list):
            setattr(config, key, getattr(config, key)[:1])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    model.train()  # dropout as training runs it
    adapter = get_adapter(model)
    rotary = adapter.rotary(model)
    if rotary is None:
        return model, adapter.layers(model)[0], None
    kind = (getattr(config, "layer_types", None) or ["full_attention"])[0]
    return model, adapter.layers(model)[0], lambda h, pos: adapter.position_embeddings(rotary, h, pos, kind)


def layer_step(layer, rotary, spec: PlanSpec, device) -> Tuple[Callable[[], torch.Tensor], Callable[[], None]]:
    """(forward, forward + backward) of one decoder layer at micro batch x seq tokens, as partrain's
    runtime runs it (fp32 weights; under torch.autocast for 16-bit)."""
    b, s, h = spec.mbs, spec.seq, spec.facts.hidden
    hs = torch.randn(b, s, h, device=device, requires_grad=True)
    kwargs: Dict[str, object] = {}
    if rotary is not None:
        pos = torch.arange(s, device=device)[None].expand(b, s)
        kwargs = {"attention_mask": None, "position_ids": pos, "position_embeddings": rotary(hs, pos)}
    dtype = DTYPES[spec.precision]
    cast = spec.precision != "fp32"

    def forward():
        with torch.autocast(device.type, dtype=dtype, enabled=cast):
            out = layer(hs, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def step():
        forward().float().sum().backward()

    return forward, step
