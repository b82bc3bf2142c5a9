"""Measure on this machine what the planner predicts (tests and benchmarks; imports torch).

- `saved_activation_bytes`: bytes autograd keeps for backward during one microbatch's forward and
  loss, counted by `partrain.runtime.activations.SavedActivations`: every saved tensor once by storage,
  parameters excluded (autocast's 16-bit weight copies are not parameters and do count).
(Per-rank parameter shards of the real wrappers: `partrain.simulate.fake_world`, also `plan --simulate`.)
"""

from __future__ import annotations

import contextlib

from partrain.blueprint.config.schema import ModelConfig


def _hf_model(model_cfg: ModelConfig, seed: int = 0):
    import torch
    from transformers import AutoModelForCausalLM

    from partrain.models.build import hf_config

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(model_cfg))


def _checkpoint_layers(model) -> None:
    """Full recompute as partrain's planner assumes it: each decoder layer re-run in backward,
    keeping only its input (reentrant torch.utils.checkpoint, use_cache is off)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    from partrain.models.adapters import get_adapter

    layers = get_adapter(model).layers(model)
    for i in range(len(layers)):
        layers[i] = checkpoint_wrapper(layers[i], checkpoint_impl=CheckpointImpl.REENTRANT)


def saved_activation_bytes(
    model_cfg: ModelConfig, batch: int, seq: int, precision: str = "fp32", recompute: str = "none", model=None
) -> int:
    """Bytes saved for backward by one forward + loss of `batch` x `seq` tokens on CPU."""
    import torch

    from partrain.models.loss import forward_loss
    from partrain.runtime.activations import SavedActivations

    if model is None:
        model = _hf_model(model_cfg)
        if recompute == "full":
            _checkpoint_layers(model)
        elif recompute != "none":
            raise ValueError("only recompute none/full can be measured here")
    model.train()
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (batch, seq), generator=g)
    y = torch.randint(0, vocab, (batch, seq), generator=g)
    if precision == "fp32":
        cast = contextlib.nullcontext()
    else:
        cast = torch.autocast("cpu", dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
    with SavedActivations(model.parameters()) as saved, cast:
        loss = forward_loss(model, x, y)
    loss.backward()  # proves the graph was complete
    return saved.total


def model_config(name: str, **overrides) -> ModelConfig:
    """ModelConfig of a conf/model/NAME.yaml (tests and benchmarks)."""
    import yaml

    from partrain.blueprint.config.paths import conf_dir

    data = yaml.safe_load((conf_dir() / "model" / f"{name}.yaml").read_text())
    config = dict(data.get("config") or {})
    config.update(overrides)
    return ModelConfig(arch=data["arch"], config=config, name=data.get("name", name))
