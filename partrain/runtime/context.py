"""The process's place in the job, read once from the launcher's environment at entry.

Nothing below the entry point reads environment variables: it receives a `DistEnv`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

from partrain.runtime.slurm import slurm_fields, under_srun


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
    node_rank: int = 0
    """This machine's index among the job's nodes (torchrun's GROUP_RANK, SLURM_NODEID)."""
    init_method: Optional[str] = None
    """How to join the process group: None = env:// (torchrun exports MASTER_ADDR/PORT), or
    tcp://master_addr:master_port (srun exports neither: rank 0 hosts the store there)."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_environ(environ: Mapping[str, str]) -> Optional[DistEnv]:
    """torchrun's variables, or SLURM's when started by srun; None outside any launcher.

    A malformed SLURM variable raises ConfigError naming it."""
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
            node_rank=int(environ.get("GROUP_RANK", 0)),
        )
    if under_srun(environ):  # srun: one task per device, each task one worker (partrain.runtime.slurm)
        fields = slurm_fields(environ)
        return DistEnv(**fields, init_method=f"tcp://{fields['master_addr']}:{fields['master_port']}")
    return None


def cpu_count() -> int:
    """Cores this process may use (respects affinity masks and cgroups where the OS exposes them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1
