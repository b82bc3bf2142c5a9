"""The one place that builds a torchrun command line (`python -m torch.distributed.run`).

Single machine: the standalone rendezvous (a free port on localhost, no endpoint to configure).
Multi-node runs start partrain under the user's own torchrun or srun instead (see README).
No torch import here: the CLI builds the command before any heavy import.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional, Sequence


def torchrun_command(
    nproc_per_node: int,
    target: Sequence[str],
    max_restarts: int = 0,
    log_dir: Optional[Path] = None,
    quiet_other_ranks: bool = False,
) -> List[str]:
    """`python -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=N ... TARGET`.

    target: what each process runs, e.g. ["-m", "partrain.worker", RUN_DIR] or [script, args...].
    quiet_other_ranks: ranks other than 0 write their output to files under log_dir only.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={nproc_per_node}",
    ]
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir)]
    if quiet_other_ranks and nproc_per_node > 1:
        cmd += ["--redirects", ",".join(f"{i}:3" for i in range(1, nproc_per_node))]
    return cmd + [str(part) for part in target]
