"""What a run keeps: which checkpoint keys make it save, and the commands that export its last step.

Pure and torch-free: the dry run, the launch and the worker's summary say the same thing.
"""

from __future__ import annotations

import dataclasses
import shlex
from typing import List, Optional


def step_name(step: int) -> str:
    """A complete checkpoint's folder name (partrain.checkpoint.folders matches it)."""
    return f"step-{step:08d}"


def saving_keys(checkpoint) -> List[str]:
    """The checkpoint keys that make a run save (`key=value`), empty when it saves nothing.
    checkpoint: a CheckpointConfig."""
    keys = [f"checkpoint.every_steps={checkpoint.every_steps}"] if checkpoint.every_steps > 0 else []
    keys += ["checkpoint.save_final=true"] if checkpoint.save_final else []
    keys += ["checkpoint.export_hf=true"] if checkpoint.export_hf else []
    return keys


SAVES_NOTHING = (
    "this run saves nothing (checkpoint.every_steps=0, checkpoint.save_final=false, checkpoint.export_hf=false): "
    "what it trains is lost when it ends; drop checkpoint.save_final=false to keep its last step"
)
"""What the launch and the dry run say about a run that keeps nothing."""

CANNOT_CHECKPOINT = {
    "parameter-server": "parallel.dp_sync=parameter-server cannot checkpoint yet (the servers' master shards and "
    "optimizer state are not saved), so this run saves nothing: what it trains is lost when it ends",
}
"""dp_sync strategies whose runs cannot save: their final checkpoint is skipped, and said (periodic
checkpoints, export and resume are refused by the validator)."""


def kept_checkpoint(run):
    """run.checkpoint as the run can honour it: no final checkpoint for a strategy that cannot save."""
    if run.parallel.dp_sync in CANNOT_CHECKPOINT:
        return dataclasses.replace(run.checkpoint, save_final=False)
    return run.checkpoint


def nothing_note(run) -> Optional[str]:
    """What the launch, the dry run and the summary say of a run that keeps nothing; None when it keeps
    something. run: a RunConfig."""
    if saving_keys(kept_checkpoint(run)):
        return None
    return CANNOT_CHECKPOINT.get(run.parallel.dp_sync, SAVES_NOTHING)


def export_commands(checkpoint_path: str, run_dir: str, lora: bool) -> List[str]:
    """The `partrain checkpoint export` commands that turn a saved step into a folder others load, quoted
    for a shell (a run folder may hold spaces)."""
    folders = [("--peft", "adapter"), ("--hf", "merged")] if lora else [("--hf", "hf")]
    path = shlex.quote(checkpoint_path)
    return [f"partrain checkpoint export {path} {flag} {shlex.quote(f'{run_dir}/{name}')}" for flag, name in folders]


def saving_plan(run) -> dict:
    """What a run will keep, for the dry run's report (JSON key `saves`): the saving keys, the folder
    and the last step's checkpoint, and the note when it keeps nothing. run: a RunConfig."""
    ck = kept_checkpoint(run)
    root = ck.dir or f"{run.train.run_dir or 'RUN_DIR'}/checkpoints"
    final = f"{root}/{step_name(run.train.steps)}" if (ck.save_final or ck.export_hf) else None
    return {
        "keys": saving_keys(ck),
        "folder": root,
        "every_steps": ck.every_steps,
        "final": final,
        "hf_export": f"{run.train.run_dir or 'RUN_DIR'}/hf" if ck.export_hf else None,
        "nothing": nothing_note(run),
    }


def saving_line(plan: dict) -> str:
    """The dry run's `checkpoints` row."""
    if plan["nothing"]:
        return plan["nothing"]
    parts = [f"every {plan['every_steps']} steps into {plan['folder']}"] if plan["every_steps"] else []
    if plan["final"]:
        parts.append(f"the last step to {plan['final']}")
    if plan["hf_export"]:
        parts.append(f"an HF folder to {plan['hf_export']}")
    return "; ".join(parts)
