"""Measure on this machine what the planner predicts (tests and benchmarks; imports torch).

- `saved_activation_bytes`: bytes autograd keeps for backward during one microbatch's forward and
  loss, counted with `torch.autograd.graph.saved_tensors_hooks`: every saved tensor once by storage,
  parameters excluded (autocast's 16-bit weight copies are not parameters and do count).
- `local_shard_elements`: per-rank parameter elements of a TP/FSDP-sharded meta model, built for
  each rank in turn on torch's fake process group (no weights, no processes).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List

from ..config.schema import ModelConfig


def _hf_model(model_cfg: ModelConfig, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.build import hf_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(model_cfg))


def _checkpoint_layers(model) -> None:
    """Full recompute as partrain's planner assumes it: each decoder layer re-run in backward,
    keeping only its input (reentrant torch.utils.checkpoint, use_cache is off)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    from ..models.adapters import get_adapter

    layers = get_adapter(model).layers(model)
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.REENTRANT)


def saved_activation_bytes(model_cfg: ModelConfig, batch: int, seq: int, precision: str = "fp32",
                           recompute: str = "none", model=None) -> int:
    """Bytes saved for backward by one forward + loss of `batch` x `seq` tokens on CPU."""
    import torch

    from ..models.loss import forward_loss

    if model is None:
        model = _hf_model(model_cfg)
        if recompute == "full":
            _checkpoint_layers(model)
        elif recompute != "none":
            raise ValueError("only recompute none/full can be measured here")
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: Dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = storage.nbytes()
        return t

    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    if precision == "fp32":
        cast = contextlib.nullcontext()
    else:
        cast = torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        loss = forward_loss(model, x, y)
    loss.backward()  # proves the graph was complete
    return sum(seen.values())


def local_shard_elements(model_cfg: ModelConfig, layout, zero_stage: int, tp_sequence_parallel: bool = False) -> List[int]:
    """Parameter elements each rank holds after partrain's TP and FSDP (zero_stage 2/3) on meta.

    Uses torch's fake process group, one rank at a time, so world sizes far beyond this machine work.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..models.adapters import get_adapter
    from ..models.build import build_meta_model
    from ..parallel import data_parallel
    from ..parallel.tensor_parallel import apply_tp
    from ..runtime.mesh import build_mesh

    out = []
    for rank in range(layout.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
        try:
            mesh = build_mesh(layout, "cpu")
            model = build_meta_model(model_cfg)
            adapter = get_adapter(model)
            apply_tp(model, adapter, mesh["tp"], sequence_parallel=tp_sequence_parallel)
            if data_parallel.uses_fsdp(zero_stage):
                data_parallel.apply_fsdp(model, adapter, mesh, zero_stage)
            total = 0
            for p in model.parameters():
                total += (p.to_local() if hasattr(p, "to_local") else p).numel()
            out.append(total)
        finally:
            dist.destroy_process_group()
    return out


def model_config(name: str, **overrides) -> ModelConfig:
    """ModelConfig of a conf/model/NAME.yaml (tests and benchmarks)."""
    import yaml

    from ..config.paths import conf_dir

    data = yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text())
    config = dict(data.get("config") or {})
    config.update(overrides)
    return ModelConfig(arch=data["arch"], config=config, name=data.get("name", name))
