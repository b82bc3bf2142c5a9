"""What anyone needs to reproduce a rehearsal's reference without partrain, written into ROOT/reproduce:

    model/                       the shrunk model's initial weights, a Hugging Face folder (save_pretrained)
    batches/step-NNNN.safetensors  each step's micro-batches, in order: microbatch.I.input_ids, .labels and
                                 .position_ids, [rows, seq_len] int64 (labels already shifted, -100 = no loss)
    batches/batches.json         steps, micro-batches per step, rows per micro-batch, seq_len
    plain_step.py                the loss of a step with plain transformers (partrain.rehearse.plain_step)

The initial weights are a function of the seed, each tensor's name and the model config alone
(partrain.models.random_init): every process of every layout starts from them, so they are built here once
more, in one process, rather than saved by a run. The batches are the one-process reference run's own,
read from its prepared run folder by the same code the worker trains from.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

from partrain.blueprint.config.compose import load_resolved
from partrain.blueprint.validate import validate

FOLDER = "reproduce"


@contextlib.contextmanager
def no_progress_bars():
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def write_reproduction(reference_run: Path, root: Path, steps: int) -> Path:
    """ROOT/reproduce for the reference run prepared (and trained) in reference_run; its path."""
    import torch
    from safetensors.torch import save_file

    from partrain.data.open_batches import open_batches
    from partrain.models.build import build_meta_model
    from partrain.models.materialize import materialize
    from partrain.rehearse import plain_step

    v = validate(load_resolved(Path(reference_run) / "config.yaml"))
    out = Path(root) / FOLDER
    (out / "batches").mkdir(parents=True, exist_ok=True)
    model = build_meta_model(v.run.model)
    materialize(model, v.run.model, v.run.train.seed, torch.device("cpu"))
    with no_progress_bars():  # the rehearsal prints its own lines
        model.save_pretrained(str(out / "model"))

    batches, _ = open_batches(v, reference_run)
    micro = v.run.train.micro_batch_size
    for step in range(steps):
        inputs, labels, *positions = batches.rank_batch(step, 0, 1)
        position_ids = positions[0] if positions and positions[0] is not None else None
        if position_ids is None:
            position_ids = torch.arange(inputs.shape[1]).repeat(inputs.shape[0], 1)
        tensors = {}
        for i, rows in enumerate(range(0, inputs.shape[0], micro)):
            part = slice(rows, rows + micro)
            for name, t in (("input_ids", inputs), ("labels", labels), ("position_ids", position_ids)):
                tensors[f"microbatch.{i}.{name}"] = t[part].to(torch.int64).clone()  # each its own storage
        save_file(tensors, str(out / "batches" / f"step-{step + 1:04d}.safetensors"))
    t = v.run.train
    facts = {
        "steps": steps,
        "microbatches_per_step": v.global_batch_size // micro,
        "rows_per_microbatch": micro,
        "seq_len": v.run.train.seq_len,
        "loss": "per step: cross-entropy summed over the labelled tokens (label != -100) of all its "
        "micro-batches, divided by their number"
        if t.objective == "lm"
        else f"per step: {t.objective}'s loss of each pair (rows 2k chosen, 2k+1 rejected), mean over the pairs",
        "objective": t.objective,
        "beta": t.preference_beta,
        "label_smoothing": t.preference_label_smoothing,
        "simpo_gamma": t.simpo_gamma,
        "seed": v.run.train.seed,
        "reference_config": str(Path(reference_run) / "config.yaml"),
    }
    (out / "batches" / "batches.json").write_text(json.dumps(facts, indent=1) + "\n")
    shutil.copyfile(plain_step.__file__, out / "plain_step.py")
    return out
