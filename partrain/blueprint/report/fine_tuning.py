"""The fine-tuning lines of the layout report (issue 37 item 7): what the dry run found in the data, and
what LoRA trains.

JSON key "fine_tuning" (null for a text run without peft):
  data: {format, detected (data.format was auto), template, labelling ({method: rows}: how each chat's
         trained text was found, partrain.data.chat_labels; {} for rows that are not chats), train_on,
         packing, examples_train,
         examples_eval, eval_set, skipped_rows ({rule: count} that data.skip_bad_rows left out, {} when
         none), long_examples ({mode, count} truncated or skipped by data.long_examples, else null),
         first_batches: {steps, tokens, trained, masked_share}} or null (text data; or `plan` without
         --check, which reads no data); a streamed run's skipped_rows and long_examples are null (its
         rows are met by the workers, not counted ahead);
  adapters: {method, r, alpha, target_modules, params, base_params, share, memory_bytes} or null;
  objective: {objective, beta, reference (dpo's: adapters, table or copy; null for simpo), reference_holds}
         or null (train.objective=lm).
The data part is measured by the launch's own preflight (partrain.preflight.fine_tuning); the adapter
part is counted here from the model's parameter shapes, as the planner counts them (torch-free).
"""

from __future__ import annotations

from math import prod
from typing import Optional

from partrain.blueprint.planner.params import tensor_specs, with_lora
from partrain.blueprint.validate import ValidatedRun
from partrain.blueprint.validate_objective import reference_kind
from partrain.blueprint.validate_peft import lora_targets

ADAPTER_BYTES_PER_PARAM = 16
"""fp32 weight + fp32 gradient + AdamW's two fp32 moments: what each adapter parameter costs (the base
weights take no gradient and no optimizer state)."""


def adapter_facts(v: ValidatedRun) -> Optional[dict]:
    """LoRA's adapters over the whole model (before any sharding): their parameters, their share of the
    model and their memory (weights, gradients, optimizer state); None without peft."""
    peft = v.run.peft
    if peft.method != "lora":
        return None
    targets = lora_targets(v.run.model.arch, peft.target_modules)
    tensors = with_lora(tensor_specs(v.facts), peft.r, targets)
    adapters = sum(prod(t.shape) for t in tensors if t.trainable)
    base = sum(prod(t.shape) for t in tensors if not t.trainable)
    return {
        "method": peft.method,
        "r": peft.r,
        "alpha": peft.alpha,
        "target_modules": list(targets),
        "params": adapters,
        "base_params": base,
        "share": adapters / max(1, adapters + base),
        "memory_bytes": adapters * ADAPTER_BYTES_PER_PARAM,
    }


REFERENCE_HOLDS = {
    "adapters": "the model with its adapters switched off: nothing more held; one forward without gradients a "
    "microbatch",
    "table": "the starting model's log-probabilities, computed by one forward of every row before step 1 and "
    "cached beside the data: 8 bytes a row, nothing held in the step",
    "copy": "a frozen copy of the starting model sharded as the policy: this rank's parameters again (the memory "
    "estimate's params count it); one forward without gradients a microbatch",
}
"""What each dpo reference (train.preference_reference) holds and costs, as the report says it."""


def objective_facts(v: ValidatedRun) -> Optional[dict]:
    """train.objective's settings and dpo's reference (what it holds); None for lm."""
    t = v.run.train
    if t.objective == "lm":
        return None
    reference = reference_kind(t, v.run.peft.method)
    return {
        "objective": t.objective,
        "beta": t.preference_beta,
        "reference": reference,
        "reference_holds": REFERENCE_HOLDS.get(reference),
    }


def fine_tuning_section(v: ValidatedRun, data: Optional[dict]) -> Optional[dict]:
    """The report's "fine_tuning" value: the preflight's data facts, the adapters and the preference objective;
    None when none."""
    adapters, objective = adapter_facts(v), objective_facts(v)
    if data is None and adapters is None and objective is None:
        return None
    return {"data": data, "adapters": adapters, "objective": objective}


def fine_tuning_lines(section: Optional[dict]) -> list:
    """(label, text) rows of the terminal summary table."""
    if not section:
        return []
    rows = []
    d = section.get("data")
    if d:
        fmt = f"{d['format']}" + (" (detected from the first row)" if d["detected"] else "")
        template = f", template {d['template']}" if d.get("template") else ""
        if d.get("labelling"):  # how the assistant's text was found in the template's rendering
            template += " (labels by " + ", ".join(f"{m}: {n} rows" for m, n in d["labelling"].items()) + ")"
        rows.append(
            (
                "fine-tuning data",
                f"{fmt}{template}; loss on {d['train_on']}; "
                + ("packed windows" if d["packing"] else "one padded example per row")
                + (
                    f"; {d['examples_train']} training examples, {d['examples_eval']} eval ({d['eval_set']})"
                    if d["examples_train"] is not None
                    else f"; streamed, eval on {d['eval_set']}"
                ),
            )
        )
        fb = d.get("first_batches")
        if fb:
            rows.append(
                (
                    "masked tokens",
                    f"{fb['masked_share']:.1%} of the {fb['tokens']:,} tokens of the first {fb['steps']} global "
                    f"batch(es) take no loss (prompts, template, padding); {fb['trained']:,} are trained",
                )
            )
    a = section.get("adapters")
    if a:
        rows.append(
            (
                "adapters",
                f"LoRA r={a['r']} alpha={a['alpha']:g} on {', '.join(a['target_modules'])}: {a['params']:,} "
                f"trainable parameters ({a['share']:.2%} of the model; base frozen), "
                f"{a['memory_bytes'] / 2**20:.2f} MiB with gradients and AdamW state",
            )
        )
    o = section.get("objective")
    if o:
        text = f"{o['objective']}, beta {o['beta']:g}"
        if o["reference"]:
            text += f"; reference ({o['reference']}): {o['reference_holds']}"
        rows.append(("objective", text))
    return rows
