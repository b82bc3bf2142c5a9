"""`checkpoint.init_from=PATH`: a new run whose model weights start from a partrain checkpoint.

The run is new in every other way: step 0, a fresh optimizer and LR schedule, its own data order,
and, under `peft=lora`, fresh adapters (B = 0, so the first step's model is exactly the checkpoint's).
The typical use: LoRA fine-tuning of a model pre-trained (fully) by partrain, without exporting it
to HF first. Only the base model's tensors are read: a LoRA checkpoint's adapters are left out (its
merged weights are what `checkpoint export --hf` writes). The checkpoint may come from any layout
(DCP reshards it, as for a resume).

A resume wins: once the run has saved checkpoints of its own, `checkpoint.resume` loads those and
init_from is not read again (the worker calls `load_init_weights` only for a run starting at step 0).

Checked before any process (`init_from_problems`, from the launch's preflight): the folder is a
complete checkpoint of the same model (architecture and parameter shapes), and `checkpoint.resume`
does not name a checkpoint itself (which would give every weight: init_from would be unused).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, List, Sequence

from torch import nn

from partrain.checkpoint.dist_util import distributed, quiet_single_process
from partrain.checkpoint.folders import RECORD_FILE
from partrain.checkpoint.record import check_model, read_record, run_meta
from partrain.checkpoint.state import MODEL, for_dcp, model_state
from partrain.errors import ConfigError, Problem

KEY = "checkpoint.init_from"
log = logging.getLogger(__name__)


def init_from_problems(v) -> List[Problem]:
    """checkpoint.init_from of the ValidatedRun `v`: the problems found on disk (no tensor is read)."""
    from partrain.checkpoint.export import require_checkpoint

    ck = v.run.checkpoint
    if not ck.init_from:
        return []
    if ck.resume not in ("none", "auto"):
        return [
            Problem(
                KEY,
                ck.init_from,
                f"checkpoint.resume={ck.resume} loads every weight from that checkpoint: init_from would be unused",
                "drop checkpoint.init_from, or set checkpoint.resume=none (or auto, to continue this run later)",
            )
        ]
    path = Path(ck.init_from).expanduser()
    try:
        require_checkpoint(path, key=KEY)
        record = read_record(path, key=KEY)
        check_model(record, run_meta(v), path / RECORD_FILE)
    except ConfigError as err:
        return list(err.problems)
    return []


def load_init_weights(path: Path, parts: Sequence[nn.Module], optimizer: Any) -> int:
    """Load the base model's tensors of checkpoint `path` into `parts` (collective; every rank its own
    shards), and into the optimizer's fp32 master weights where it keeps them. Adapter weights are
    not requested. Returns the number of tensors loaded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    from partrain.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
    from partrain.models.lora_init import is_lora_weight
    from partrain.models.shards import param_fqns
    from partrain.parallel.master_weights import MasterWeightOptimizer

    path = Path(path).expanduser()
    master = isinstance(optimizer, MasterWeightOptimizer)
    names = param_fqns(parts) if master else {}
    # Collective under ZeRO-1 masters: every rank takes the current values before any load.
    current: Dict[str, Any] = optimizer.master_model_state(names) if master else {}
    state = model_state(parts)
    if master:  # 16-bit parameters: load the fp32 values into the masters' shape, then both from them
        state.update(optimizer.master_model_state(names, template=True))
    request = {k: t for k, t in state.items() if not is_lora_weight(k)}
    loaded = for_dcp({MODEL: request}, for_save=False)
    with quiet_single_process():
        dcp.load(
            loaded.state,
            storage_reader=SafeFileSystemReader(path),
            planner=SafeLoadPlanner(),
            no_dist=not distributed(),
        )
    loaded.finish_load()
    values = loaded.state[MODEL]
    for part in parts:
        mine = {k: values[k] for k in get_model_state_dict(part) if k in values}
        set_model_state_dict(part, mine, options=StateDictOptions(strict=False))
    if master:
        optimizer.load_master_model_state(names, {**current, **values})  # adapters keep their fresh values
    log.info("model weights from %s (%d tensors; checkpoint.init_from)", path, len(values))
    return len(values)
