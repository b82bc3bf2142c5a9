"""The process's place in the job, read once from the launcher's environment at entry.

Nothing below the entry point reads environment variables: it receives a `DistEnv`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    restart_count: int = 0
    """How many times torchrun's elastic agent restarted this job (TORCHELASTIC_RESTART_COUNT)."""
    agent_store: bool = False
    """The elastic agent hosts the TCPStore at master_addr:master_port (TORCHELASTIC_USE_AGENT_STORE)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_environ(environ: Mapping[str, str]) -> Optional[DistEnv]:
    """torchrun's variables, or SLURM's when started by srun; None outside any launcher."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return DistEnv(
            rank=int(environ["RANK"]),
            world_size=int(environ["WORLD_SIZE"]),
            local_rank=int(environ.get("LOCAL_RANK", 0)),
            local_world_size=int(environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])),
            master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(environ.get("MASTER_PORT", 29500)),
            restart_count=int(environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        )
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ and int(environ["SLURM_NTASKS"]) > 1:
        nodelist = environ.get("SLURM_LAUNCH_NODE_IPADDR") or environ.get("MASTER_ADDR", "127.0.0.1")
        return DistEnv(
            rank=int(environ["SLURM_PROCID"]),
            world_size=int(environ["SLURM_NTASKS"]),
            local_rank=int(environ.get("SLURM_LOCALID", 0)),
            local_world_size=int(environ.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]),
            master_addr=environ.get("MASTER_ADDR", nodelist),
            master_port=int(environ.get("MASTER_PORT", 29500)),
        )
    return None


def cpu_count() -> int:
    """Cores this process may use (respects affinity masks and cgroups where the OS exposes them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1
