"""Where a multi-node run's checkpoints may go: one folder every node sees (torch-free, pure).

Every rank of a checkpoint writes its DCP shards into the same `step-N.partial/` folder and rank 0
alone commits it (partrain.checkpoint.save). When the folder is node-local (the default,
`RUN_DIR/checkpoints`, where each node has its own run folder), node 0's checkpoint names files
only the other nodes wrote and their copies stay `.partial` forever: nothing can be resumed. So a
multi-node run that saves checkpoints (periodic ones, the final one of checkpoint.save_final, the
one checkpoint.export_hf exports from) must name checkpoint.dir, on every launcher alike: torchrun
(`partrain.multinode`), srun (`partrain.launch`) and the sbatch script (`partrain launch slurm`).
A checkpoint.dir that is set but still node-local is caught at the first save and at resume, where
every rank reports what it sees (partrain.checkpoint.save, partrain.checkpoint.load).
"""

from __future__ import annotations

from typing import List

from partrain.blueprint.config.saving import kept_checkpoint, saving_keys
from partrain.errors import Problem

SHARED_DIR_FIX = (
    "set checkpoint.dir to a folder on a file system every node mounts "
    "(or, to save nothing, checkpoint.every_steps=0 checkpoint.save_final=false checkpoint.export_hf=false)"
)
"""The fix named wherever a multi-node run lacks a shared checkpoint folder."""


def checkpoint_dir_problems(run) -> List[Problem]:
    """The problem of a run over several nodes that saves checkpoints without checkpoint.dir (its
    default lies inside each node's own run folder); empty when fine. run: a RunConfig."""
    saving = saving_keys(kept_checkpoint(run))
    if run.cluster.nodes <= 1 or not saving or run.checkpoint.dir:
        return []
    return [
        Problem(
            "checkpoint.dir",
            "",
            f"a run over cluster.nodes={run.cluster.nodes} nodes that saves checkpoints ({', '.join(saving)}) "
            "writes every rank's shards into one folder; the default (inside each node's run folder) would "
            "split every checkpoint between nodes, and none could be resumed or exported",
            SHARED_DIR_FIX,
        )
    ]
