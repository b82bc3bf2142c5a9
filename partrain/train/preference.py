"""The preference objectives (train.objective=dpo or simpo): a microbatch's loss from its pairs, and the
per-step metrics TRL users read.

A microbatch's rows are pairs, [c0, r0, c1, r1, ...] (partrain.data.preference_batches). Each row's
log-probability is the sum of its labelled tokens' log-probabilities (the answer's: the prompt is never
labelled), computed in fp32 from the model's logits, vocabulary-sharded ones included (inside
`loss_parallel()`, as the LM loss).

- dpo: margin = (log p(c) - log p_ref(c)) - (log p(r) - log p_ref(r)); the reference is the same model
  with its LoRA adapters switched off (partrain.parallel.lora.adapters_disabled), run without gradients
  before the policy's forward on the same rows. Loss = -log sigmoid(beta x margin) (TRL's sigmoid loss).
- simpo: margin = log p(c) / |c| - log p(r) / |r| (length-averaged; no reference);
  loss = -log sigmoid(beta x margin - gamma) (TRL's CPOTrainer with loss_type=simpo, cpo_alpha=0).

Under pipeline parallelism the last stage's loss_fn is `pipeline_loss(logits, target)`: dpo's target carries
each row's reference log-probability in one more column (`with_reference`), so each microbatch's reference
meets its logits whatever order the schedule computes the losses in.

With label smoothing e both become (1 - e) x loss(z) + e x loss(-z) (conservative DPO). The microbatch's
loss is the mean over its pairs; every microbatch holds as many pairs, so the engines' mean over
microbatches and data-parallel ranks is the mean over the global batch's pairs, for every layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from partrain.models.loss import IGNORE_INDEX

STAT_NAMES = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""The per-step metrics (TRL's names): means over the step's pairs."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A loss_parallel result (a replicated DTensor) as the plain tensor every tp rank holds."""
    return t.to_local() if hasattr(t, "to_local") else t


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor, sequence_group=None) -> tuple:
    """(sum of the labelled tokens' log-probabilities per row [B], labelled tokens per row [B]); fp32.

    sequence_group: the sp group when each rank holds a slice of every row; the slices' sums are added over
    it, with gradients: every sp rank computes the same pair losses from the whole rows' sums, and the
    backward of the sum hands each rank sp x its slice's share, which the gradients' mean over dp x sp
    brings back to the unsplit gradient (as SequenceShard.loss's sp x scaling does for the LM loss)."""
    rows, length = labels.shape
    token_nll = F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    logps = -_local(token_nll).view(rows, length).sum(dim=1)
    counts = (labels != IGNORE_INDEX).sum(dim=1)
    if sequence_group is not None:
        import torch.distributed.nn.functional as dist_nn

        logps = (
            dist_nn.all_reduce(logps, group=sequence_group) if logps.requires_grad else _summed(logps, sequence_group)
        )
        counts = _summed(counts, sequence_group)
    return logps, counts


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


@dataclass
class PreferenceObjective:
    """forward_loss for the engines (the signature of partrain.models.loss.forward_loss) and the step's metrics."""

    kind: str
    """dpo or simpo (train.objective)."""
    beta: float
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    reference: Optional[Callable[[nn.Module], ContextManager]] = None
    """dpo with a reference computed in the step: policy model -> a context giving the module to run as the
    reference (the frozen copy), or giving nothing while the policy is the reference (its adapters switched
    off); None with a table or simpo."""
    frozen: Optional[nn.Module] = None
    """train.preference_reference=copy: the frozen copy (partrain.train.assemble.frozen_copy)."""
    sequence: Any = None
    """Sequence parallelism: this rank's SequenceShard (partrain.parallel.context_parallel); None without sp."""
    table: Optional[torch.Tensor] = None
    """dpo in full fine-tuning: every example's reference log-probability (partrain.train.reference_logps),
    looked up for the rows `use_rows` names."""
    _sums: List[torch.Tensor] = field(default_factory=list)
    _rows: Optional[torch.Tensor] = None
    _next: int = 0

    def use_rows(self, examples) -> None:
        """The examples (cache indices) of the rows the next forwards score, in order (full-FT dpo)."""
        self._rows, self._next = self.table[torch.as_tensor(examples, dtype=torch.long)], 0

    def next_reference(self, rows: int, device=None) -> torch.Tensor:
        """The reference log-probabilities of the next `rows` rows that use_rows named (full-FT dpo)."""
        if self._rows is None or self._next + rows > len(self._rows):
            raise RuntimeError("dpo without a LoRA reference needs the rows' reference log-probabilities (use_rows)")
        ref = self._rows[self._next : self._next + rows]
        self._next += rows
        return ref.to(device=device, dtype=torch.float32)

    def __call__(
        self, model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, position_ids=None, **_ignored
    ) -> torch.Tensor:
        group = self.sequence.group if self.sequence is not None else None
        if position_ids is None and self.sequence is not None:  # the rows' global positions of this slice
            position_ids = self.sequence.position_ids(input_ids.shape[1] * self.sequence.size, input_ids.device)
        elif position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        ref = None
        if self.kind == "dpo" and self.reference is None:
            ref = self.next_reference(input_ids.shape[0], input_ids.device)
        elif self.kind == "dpo":
            with torch.no_grad(), self.reference(model) as reference:
                reference = reference if reference is not None else model  # a context may yield nothing: the policy
                ref, _ = sequence_logps(reference(input_ids=input_ids, position_ids=position_ids).logits, labels, group)
        logits = model(input_ids=input_ids, position_ids=position_ids).logits
        return self.pair_loss(logits, labels, ref, group)

    def pair_loss(self, logits: torch.Tensor, labels: torch.Tensor, ref: Optional[torch.Tensor], group=None):
        """The mean loss of the microbatch's pairs from the policy's logits (ref: dpo's per-row reference
        log-probabilities, None for simpo); the pairs' metrics counted."""
        logps, counts = sequence_logps(logits, labels, group)
        chosen, rejected = logps[0::2], logps[1::2]
        if self.kind == "dpo":
            chosen_reward = self.beta * (chosen - ref[0::2]).detach()
            rejected_reward = self.beta * (rejected - ref[1::2]).detach()
            z = self.beta * ((chosen - ref[0::2]) - (rejected - ref[1::2]))
        else:
            chosen_avg, rejected_avg = chosen / counts[0::2], rejected / counts[1::2]
            chosen_reward, rejected_reward = self.beta * chosen_avg.detach(), self.beta * rejected_avg.detach()
            z = self.beta * (chosen_avg - rejected_avg) - self.simpo_gamma
        e = self.label_smoothing
        losses = -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)
        self._add(chosen_reward, rejected_reward, chosen.detach(), rejected.detach())
        return losses.mean()

    # -- pipeline parallelism: the last stage's loss_fn(logits, target) -------------------------------------
    def with_reference(self, labels: torch.Tensor, ref: Optional[torch.Tensor]) -> torch.Tensor:
        """The pipeline's target for dpo: labels [B, S] and one more column holding each row's reference
        log-probability (float64 bits in an int64), so that a microbatch's reference travels with its labels
        whatever order the schedule computes the microbatches' losses in. simpo: the labels."""
        if self.kind != "dpo":
            return labels
        bits = ref.to(device=labels.device, dtype=torch.float64).contiguous().view(torch.int64)
        return torch.cat([labels, bits.unsqueeze(1)], dim=1)

    def pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """loss_fn of the pipeline's last stage (target: `with_reference`'s)."""
        if self.kind != "dpo":
            return self.pair_loss(logits, target, None)
        ref = target[:, -1].contiguous().view(torch.float64).float()
        return self.pair_loss(logits, target[:, :-1], ref)

    def _add(self, chosen_reward, rejected_reward, chosen, rejected) -> None:
        row = torch.stack(
            [
                chosen_reward.sum(),
                rejected_reward.sum(),
                (chosen_reward > rejected_reward).sum(),
                (chosen_reward - rejected_reward).sum(),
                chosen.sum(),
                rejected.sum(),
                torch.tensor(float(len(chosen)), device=chosen.device),
            ]
        )
        self._sums.append(row.double().cpu())

    def step_metrics(self, group=None, pp_group=None) -> Dict[str, float]:
        """Means over the step's pairs of every data-parallel rank (`group`: the ranks holding other pairs;
        a collective when given), then a fresh count. Under pipeline parallelism (`pp_group`) only the last
        stage counts pairs: the sums meet over the pp group too, so every rank reads them. Evaluation
        forwards count too: call after them only through `reset`."""
        if not self._sums and pp_group is None:
            return {}
        total = torch.stack(self._sums).sum(dim=0) if self._sums else torch.zeros(len(STAT_NAMES) + 1).double()
        self._sums.clear()
        for g in (group, pp_group):
            if g is not None:
                dist.all_reduce(total, group=g)
        pairs = float(total[-1])
        return {name: float(total[i]) / pairs for i, name in enumerate(STAT_NAMES)} if pairs else {}

    def reset(self) -> None:
        """Forget what was counted (evaluation forwards, which are not the step's)."""
        self._sums.clear()
