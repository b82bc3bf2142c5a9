"""The sbatch script of a validated layout: `partrain launch slurm` (torch-free, no file written here).

One SLURM task per device (see partrain.runtime.slurm): `--nodes` = cluster.nodes and
`--ntasks-per-node` = cluster.devices_per_node, so `srun partrain train ...` starts exactly the
layout's world. The signals mean what they mean on clusters:

- the time limit: SLURM sends USR1 to the batch shell alone 120 s before it (`--signal=B:USR1@120`);
  the shell passes SIGTERM to the step's tasks (`scancel --signal=TERM JOB.0`, which lets every rank
  finish its step and save, where `kill -TERM` of srun makes srun kill them unsaved), waits for them
  to exit 143, and requeues the job, at most `max_requeues` times (SLURM_RESTART_COUNT counts them);
- SIGTERM (a user's `scancel`, or a preemption, which SLURM requeues by itself under
  PreemptMode=REQUEUE): the tasks get it from SLURM, save and end; the script requeues nothing, so
  one `scancel` stops the job.

The run folder is keyed by a run id written into the script when it is generated
(`train.run_id`), not by $SLURM_JOB_ID: a requeue and a resubmission of the same script continue
the same run from its newest checkpoint (`checkpoint.resume=auto`); a new script is a new run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import List, Optional, Sequence

from partrain.errors import ConfigError, Problem
from partrain.runtime.partition import JobRequest

SIGNAL_LEAD_S = 120
"""Seconds between SLURM's time-limit warning (USR1) and its kill: a step plus a checkpoint."""
DEFAULT_MAX_REQUEUES = 10
"""Requeues after a time limit before the script stops requeueing (a run that never gets far)."""
CPUS_PER_GPU_TASK = 8
"""--cpus-per-task of a GPU task when neither the user, train.threads_per_process nor sinfo says."""
CPUS_PER_CPU_TASK = 1
"""--cpus-per-task of a CPU task (one process per device) when nothing says more: any node holds it."""
JOB_NAME_MAX = 64
"""Job names are cut to this many characters (squeue shows the first few; file names stay short)."""


@dataclass(frozen=True)
class SbatchOptions:
    time: Optional[str] = None
    """Wall-clock limit, SLURM's [D-]HH:MM:SS (normalized by `parse_time`)."""
    partition: Optional[str] = None
    """SLURM partition; None = the cluster's default partition."""
    account: Optional[str] = None
    """SLURM account to charge; None = the user's default."""
    cpus_per_task: Optional[int] = None
    """CPU cores per task (one task = one worker); None = derived (see `cpus_per_task`)."""
    max_requeues: int = DEFAULT_MAX_REQUEUES
    """Requeues after the time-limit warning, in all (0 = never requeue)."""
    run_id: str = ""
    """The run folder's key written into the script (train.run_id) unless the overrides name the run
    folder themselves; empty = none written (runs/NAME/$SLURM_JOB_ID then)."""
    node_cpus: Optional[int] = None
    """CPUs per node of the target partition as sinfo lists them (None when unknown)."""


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


def check_max_requeues(value: int) -> int:
    if value < 0:
        raise ConfigError(
            Problem("--max-requeues", value, "must be 0 (never requeue) or more", "pass --max-requeues 10")
        )
    return value


def job_name(run) -> str:
    """`partrain-RECIPE`: letters, digits, `_ . -` only, no doubled dashes, at most JOB_NAME_MAX."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", run.recipe or run.model.name or "run")
    name = re.sub(r"-{2,}", "-", name).strip("-.") or "run"
    if name.startswith("partrain-"):  # a recipe called partrain-x is not partrain-partrain-x
        name = name.removeprefix("partrain-")
    return f"partrain-{name}"[:JOB_NAME_MAX].rstrip("-.")


def cpus_per_task(run, options: SbatchOptions) -> int:
    """--cpus-per-task: the option, else train.threads_per_process, else the target nodes' CPUs per
    task (sinfo), at most CPUS_PER_GPU_TASK on GPU nodes, else CPUS_PER_GPU_TASK / CPUS_PER_CPU_TASK."""
    if options.cpus_per_task:
        return options.cpus_per_task
    if run.train.threads_per_process:
        return run.train.threads_per_process
    gpu = run.cluster.device == "cuda"
    if options.node_cpus:
        share = max(1, options.node_cpus // run.cluster.devices_per_node)
        return min(share, CPUS_PER_GPU_TASK) if gpu else share
    return CPUS_PER_GPU_TASK if gpu else CPUS_PER_CPU_TASK


def job_request(run, options: SbatchOptions) -> JobRequest:
    """What the script asks SLURM for (checked against the partition by partrain.runtime.partition)."""
    cluster = run.cluster
    gpus = cluster.devices_per_node if cluster.device == "cuda" else 0
    return JobRequest(cluster.nodes, cluster.devices_per_node, cpus_per_task(run, options), gpus)


def srun_overrides(run, overrides: Sequence[str], threads: int, run_id: str = "") -> List[str]:
    """The user's overrides plus what a requeued or resubmitted job needs: resume from the newest
    checkpoint, a run folder that does not depend on the job id, and as many torch threads as SLURM
    gives each task (unless the user chose any of them)."""
    given = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    extra = [] if "checkpoint.resume" in given else ["checkpoint.resume=auto"]
    if run_id and not (run.train.run_dir or run.train.run_id):
        extra.append(f"train.run_id={run_id}")
    extra += [] if "train.threads_per_process" in given else [f"train.threads_per_process={threads}"]
    return list(overrides) + extra


def sbatch_script(validated, overrides: Sequence[str], options: SbatchOptions) -> str:
    """The sbatch script for this layout (text). `validated`: a ValidatedRun of `overrides`."""
    run = validated.run
    cluster = run.cluster
    job = job_request(run, options)
    command = ["srun", "partrain", "train", *srun_overrides(run, overrides, job.cpus_per_task, options.run_id)]
    lines = [
        "#!/bin/bash",
        f"# partrain: {validated.world_size} workers = {cluster.nodes} nodes x {cluster.devices_per_node} "
        f"({cluster.name}), one SLURM task per {'GPU' if cluster.device == 'cuda' else 'process'}.",
        "# Written by `partrain launch slurm`; submit with `sbatch FILE` (again to continue the same run).",
        f"#SBATCH --job-name={job_name(run)}",
        f"#SBATCH --nodes={job.nodes}",
        f"#SBATCH --ntasks-per-node={job.tasks_per_node}",
    ]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    lines.append(f"#SBATCH --cpus-per-task={job.cpus_per_task}")
    if options.time:
        lines.append(f"#SBATCH --time={options.time}")
    if options.partition:
        lines.append(f"#SBATCH --partition={options.partition}")
    if options.account:
        lines.append(f"#SBATCH --account={options.account}")
    lines += [
        "#SBATCH --requeue",
        f"#SBATCH --signal=B:USR1@{SIGNAL_LEAD_S}",
        "#SBATCH --open-mode=append",
        "#SBATCH --output=%x-%j.out",
        "",
        *_checkpoint_comment(run),
        *_run_folder_comment(run, options.run_id),
        "# Activate the environment `partrain` is installed in here if it is not on PATH.",
        "export PYTHONUNBUFFERED=1",
        "export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}",
        "export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}  # srun no longer inherits sbatch's (SLURM 22.05+)",
        "# Each task is one worker: rank SLURM_PROCID, device SLURM_LOCALID, node SLURM_NODEID; the rendezvous",
        "# is the first host of SLURM_JOB_NODELIST at port 15000 + SLURM_JOB_ID mod 20000 (MASTER_ADDR and",
        "# MASTER_PORT, when exported here, win).",
        "",
        "# Requeues after the time limit, in all (SLURM_RESTART_COUNT counts them; --max-requeues).",
        f"max_requeues={options.max_requeues}",
        "requeue=0",
        f"# USR1: the time limit is {SIGNAL_LEAD_S} s away (--signal=B:USR1, this shell only). The step's tasks get",
        "# SIGTERM through scancel (srun's step 0 is the one below): every rank finishes its step and saves",
        "# (`kill -TERM` of srun would make srun kill them unsaved). Requeued once they have exited 143.",
        "on_time_limit() {",
        f'  echo "partrain: time limit in {SIGNAL_LEAD_S} s: the workers finish their step and save;"'
        ' "the job is requeued after"',
        "  requeue=1; signalled=1",
        '  scancel --signal=TERM "${SLURM_JOB_ID}.0"',
        "}",
        "# SIGTERM: a user's scancel or a preemption (SLURM requeues a preempted job itself under",
        "# PreemptMode=REQUEUE). The tasks get their own SIGTERM from SLURM and save; nothing is requeued here.",
        "on_sigterm() {",
        '  echo "partrain: SIGTERM (scancel or preemption): the workers finish their step and save;"'
        ' "not requeued by this script"',
        "  requeue=0; signalled=1",
        "}",
        "trap on_time_limit USR1",
        "trap on_sigterm TERM",
        " ".join(shlex.quote(str(part)) for part in command) + " &",
        "srun_pid=$!",
        "# A trap interrupts `wait` (which then returns 128 + the signal): wait again for srun's own status.",
        "signalled=1",
        'while [ "$signalled" -eq 1 ]; do signalled=0; wait "$srun_pid"; rc=$?; done',
        "# 143: the workers stopped by SIGTERM after saving their step.",
        'if [ "$requeue" -eq 1 ] && [ "$rc" -eq 143 ]; then',
        '  if [ "${SLURM_RESTART_COUNT:-0}" -lt "$max_requeues" ]; then',
        '    echo "partrain: requeue $(( ${SLURM_RESTART_COUNT:-0} + 1 )) of at most $max_requeues"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "  else",
        '    echo "partrain: not requeued: requeued $max_requeues times already (--max-requeues);'
        ' sbatch this script again to continue"',
        "  fi",
        "fi",
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def _checkpoint_comment(run) -> List[str]:
    if run.checkpoint.every_steps > 0:
        every = run.checkpoint.every_steps
        return [f"# Checkpoints every {every} steps and at SIGTERM; a requeue resumes from the newest (resume=auto)."]
    if run.checkpoint.save_final:
        return [
            "# Checkpoints at SIGTERM and at the end only (checkpoint.save_final); a requeue resumes from the",
            "# newest, but a crashed node loses every step since: add checkpoint.every_steps=N to the overrides.",
        ]
    return [
        "# warning: checkpoint.every_steps=0 and checkpoint.save_final=false, so nothing is saved at SIGTERM",
        "# and a requeued job starts from step 0; add checkpoint.every_steps=N to continue after preemption.",
    ]


def _run_folder_comment(run, run_id: str) -> List[str]:
    if run.train.run_dir:
        where = f"train.run_dir={run.train.run_dir}"
    elif run.train.run_id or run_id:
        where = f"runs/{run.recipe or run.model.name or 'default'}/{run.train.run_id or run_id} (train.run_id)"
    else:
        where = "runs/NAME/$SLURM_JOB_ID (no train.run_id: a resubmission starts a new run)"
    return [
        f"# Run folder: {where}, on a file system every node sees.",
        "# Every submission of this script continues that run; to start over, write a new script (a new",
        "# train.run_id) or put train.run_id=NEW on the srun line.",
    ]
