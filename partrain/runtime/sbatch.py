"""The sbatch script of a validated layout: `partrain launch slurm` (torch-free, no file written here).

One SLURM task per device (see partrain.runtime.slurm): `--nodes` = cluster.nodes and
`--ntasks-per-node` = cluster.devices_per_node, so `srun partrain train ...` starts exactly the
layout's world. Preemption and the time limit end in a checkpoint and a requeue: SLURM sends SIGTERM
to the tasks 120 s before the kill (`--signal=TERM@120`), every rank finishes its step and saves it,
the tasks exit 143, and the script requeues the job; the requeued job keeps its SLURM_JOB_ID, hence
its run folder, and `checkpoint.resume=auto` continues from the newest checkpoint.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import List, Optional, Sequence

from partrain.errors import ConfigError, Problem

SIGNAL_LEAD_S = 120
"""Seconds between SLURM's SIGTERM and its SIGKILL at the time limit: a step plus a checkpoint."""

DEFAULT_CPUS_PER_TASK = 8


@dataclass(frozen=True)
class SbatchOptions:
    time: Optional[str] = None
    """Wall-clock limit, SLURM's [D-]HH:MM:SS (normalized by `parse_time`)."""
    partition: Optional[str] = None
    account: Optional[str] = None
    cpus_per_task: Optional[int] = None
    """CPU cores per task (one task = one worker); default train.threads_per_process, else 8."""


def parse_time(text: str) -> str:
    """SLURM's time limit as HH:MM:SS or D-HH:MM:SS (also accepts a plain number of minutes and
    D-HH:MM); ConfigError naming --time otherwise."""
    text = text.strip()
    if text.isdigit() and int(text) > 0:
        minutes = int(text)
        return _format(minutes // 1440, minutes % 1440 // 60, minutes % 60, 0)
    match = re.fullmatch(r"(?:(\d+)-)?(\d{1,3}):(\d{2})(?::(\d{2}))?", text)
    if match and (match.group(1) is not None or match.group(4) is not None):  # HH:MM alone reads as MM:SS in SLURM
        days, hours, minutes, seconds = (int(g) if g else 0 for g in match.groups())
        hours_ok = hours < 24 or match.group(1) is None  # 48:00:00 is two days; 1-30:00:00 is not a time
        if hours_ok and minutes < 60 and seconds < 60 and (days, hours, minutes, seconds) != (0, 0, 0, 0):
            return _format(days, hours, minutes, seconds)
    raise ConfigError(
        Problem(
            "--time",
            text,
            "must be a positive time limit HH:MM:SS or D-HH:MM:SS (minutes, seconds below 60; hours below 24 after D-)",
            "for example --time 04:00:00, or --time 1-12:00:00 for a day and a half",
        )
    )


def _format(days: int, hours: int, minutes: int, seconds: int) -> str:
    clock = f"{hours:02d}:{minutes:02d}:{seconds:02d}"
    return f"{days}-{clock}" if days else clock


def check_name(option: str, value: Optional[str]) -> Optional[str]:
    """A partition or account name goes into the script as is: one word of safe characters."""
    if value is None:
        return None
    if not re.fullmatch(r"[A-Za-z0-9_.,:+-]+", value):
        raise ConfigError(
            Problem(
                option,
                value,
                "must be a SLURM name: letters, digits and _ . , : + - (no spaces or shell characters)",
                f"pass the name as `sinfo` / `sacctmgr` show it, e.g. {option} gpu",
            )
        )
    return value


def check_cpus(value: Optional[int]) -> Optional[int]:
    if value is not None and value < 1:
        raise ConfigError(Problem("--cpus-per-task", value, "must be at least 1", "pass --cpus-per-task 8"))
    return value


def srun_overrides(overrides: Sequence[str], threads: int) -> List[str]:
    """The user's overrides plus what a requeued job needs: resume from the newest checkpoint, and
    as many torch threads as SLURM gives each task (unless the user chose either)."""
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    extra = [] if "checkpoint.resume" in given else ["checkpoint.resume=auto"]
    extra += [] if "train.threads_per_process" in given else [f"train.threads_per_process={threads}"]
    return list(overrides) + extra


def sbatch_script(validated, overrides: Sequence[str], options: SbatchOptions) -> str:
    """The sbatch script for this layout (text). `validated`: a ValidatedRun of `overrides`."""
    run = validated.run
    cluster = run.cluster
    threads = options.cpus_per_task or run.train.threads_per_process or DEFAULT_CPUS_PER_TASK
    name = run.recipe or run.model.name or "run"
    command = ["srun", "partrain", "train", *srun_overrides(overrides, threads)]
    lines = [
        "#!/bin/bash",
        f"# partrain: {validated.world_size} workers = {cluster.nodes} nodes x {cluster.devices_per_node} "
        f"({cluster.name}), one SLURM task per {'GPU' if cluster.device == 'cuda' else 'process'}.",
        "# Written by `partrain launch slurm`; submit with `sbatch FILE`.",
        f"#SBATCH --job-name=partrain-{_safe(name)}",
        f"#SBATCH --nodes={cluster.nodes}",
        f"#SBATCH --ntasks-per-node={cluster.devices_per_node}",
    ]
    if cluster.device == "cuda":
        lines.append(f"#SBATCH --gpus-per-node={cluster.devices_per_node}")
    lines.append(f"#SBATCH --cpus-per-task={threads}")
    if options.time:
        lines.append(f"#SBATCH --time={options.time}")
    if options.partition:
        lines.append(f"#SBATCH --partition={options.partition}")
    if options.account:
        lines.append(f"#SBATCH --account={options.account}")
    lines += [
        "#SBATCH --requeue",
        f"#SBATCH --signal=TERM@{SIGNAL_LEAD_S}",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=partrain-%x-%j.out",
        "",
        *_preemption_comment(run),
        "# Activate the environment `partrain` is installed in here if it is not on PATH.",
        "export PYTHONUNBUFFERED=1",
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
        "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}  # srun no longer inherits sbatch's (SLURM 22.05+)",
        "# Each task is one worker: rank SLURM_PROCID, device SLURM_LOCALID, node SLURM_NODEID; the rendezvous",
        "# is the first host of SLURM_JOB_NODELIST at port 15000 + SLURM_JOB_ID mod 20000 (MASTER_ADDR and",
        "# MASTER_PORT, when exported here, win). The run folder defaults to runs/NAME/$SLURM_JOB_ID",
        "# (unchanged by a requeue) and must be on a file system every node sees.",
        "",
        "# The batch shell ignores SLURM's SIGTERM (the tasks get their own) and waits for srun to end.",
        "trap 'echo \"partrain: SIGTERM; the workers finish their step and save a checkpoint\"' TERM",
        " ".join(shlex.quote(str(part)) for part in command) + " &",
        "srun_pid=$!",
        'wait "$srun_pid"; rc=$?',
        'while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; rc=$?; done',
        "# 143: stopped by SIGTERM after saving its step (time limit or preemption): run again from there.",
        'if [ "$rc" -eq 143 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def _preemption_comment(run) -> List[str]:
    if run.checkpoint.every_steps > 0:
        every = run.checkpoint.every_steps
        return [f"# Checkpoints every {every} steps and at SIGTERM; a requeue resumes from the newest (resume=auto)."]
    return [
        "# warning: checkpoint.every_steps=0, so nothing is saved at SIGTERM and a requeued job starts",
        "# from step 0; add checkpoint.every_steps=N to the overrides to continue after preemption.",
    ]


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)
