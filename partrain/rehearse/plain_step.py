"""A rehearsal's reference loss, recomputed with plain transformers (no partrain import).

`partrain rehearse` copies this file into its folder as reproduce/plain_step.py:

    python reproduce/plain_step.py reproduce [STEP]

prints the loss of training step STEP (default 1) of the one-process reference, computed from the shrunk
model's initial weights (reproduce/model, a Hugging Face folder) and that step's batch
(reproduce/batches/step-NNNN.safetensors). For step 1 it equals the loss the rehearsal's reference logged;
later steps need the trained weights (only step 1 starts from the initial ones).

The loss of a step: the cross-entropy summed over every labelled token (label != -100) of every micro-batch,
divided by the number of labelled tokens. Labels are already shifted (labels[t] is the token after
input_ids[t]), so no shift happens here; position_ids restart at 0 at each document start in packed rows,
and transformers keeps attention inside each document when it sees them with no attention mask.

Preference objectives (batches.json's "objective": dpo or simpo): a micro-batch's rows are pairs, chosen then
rejected; each row's log-probability is the sum over its labelled tokens. dpo: -log sigmoid(beta x the
policy's log-ratio margin over the reference's), the reference being the initial model (at step 1 the
policy is its reference); simpo: -log sigmoid(beta x the margin of length-averaged log-probabilities -
gamma); both with label smoothing e as (1 - e) loss(z) + e loss(-z). The step's loss is the mean over pairs.
"""

from __future__ import annotations

import sys
from pathlib import Path


def step_microbatches(folder: Path, step: int):
    """The micro-batches of one step, in order: a list of dicts with input_ids, labels and position_ids
    ([rows, seq_len] int64 tensors)."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / "batches" / f"step-{step:04d}.safetensors"))
    count = len({name.split(".")[1] for name in tensors})
    return [
        {key: tensors[f"microbatch.{i}.{key}"] for key in ("input_ids", "labels", "position_ids")} for i in range(count)
    ]


def plain_loss(folder: Path, step: int = 1) -> float:
    """Step `step`'s loss with the model of folder/model as loaded by transformers, in fp32."""
    import json

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(Path(folder) / "model"), dtype=torch.float32)
    model.eval()  # the rehearsal turns dropout off: train() and eval() compute the same forward
    facts = json.loads((Path(folder) / "batches" / "batches.json").read_text())
    if facts.get("objective", "lm") != "lm":
        return _preference_loss(model, folder, step, facts)
    total, count = 0.0, 0
    with torch.no_grad():
        for micro in step_microbatches(folder, step):
            logits = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"]).logits
            labels = micro["labels"]
            total += float(
                F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            )
            count += int((labels != -100).sum())
    return total / count


def _preference_loss(model, folder: Path, step: int, facts: dict) -> float:
    import torch
    import torch.nn.functional as F

    beta, smoothing, gamma = facts["beta"], facts["label_smoothing"], facts["simpo_gamma"]
    losses = []
    with torch.no_grad():
        for micro in step_microbatches(folder, step):
            logits = model(input_ids=micro["input_ids"], position_ids=micro["position_ids"]).logits.float()
            labels = micro["labels"]
            nll = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
            logps = -nll.view(labels.shape).sum(dim=1)
            counts = (labels != -100).sum(dim=1)
            if facts["objective"] == "dpo":  # the reference is this same initial model: its log-ratios are 0
                z = beta * ((logps[0::2] - logps[0::2]) - (logps[1::2] - logps[1::2]))
            else:
                z = beta * (logps[0::2] / counts[0::2] - logps[1::2] / counts[1::2]) - gamma
            losses.append(-(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z))
    return float(torch.cat(losses).mean())


if __name__ == "__main__":
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
    print(f"{plain_loss(where, int(sys.argv[2]) if len(sys.argv) > 2 else 1):.8f}")
