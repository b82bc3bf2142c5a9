"""What a SLURM partition can hold, from `sinfo`, and the job requests it cannot satisfy.

SLURM accepts a job that asks more than any node of its partition has (more CPUs, more GPUs, more
nodes) and leaves it PENDING forever (Reason=PartitionConfig) without a word, so `partrain launch
slurm` asks `sinfo` first when it is on PATH and refuses such a request (exit 2). `sinfo` is read
through `read_sinfo`, which tests replace; everything else is a pure function of its text.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, List, Optional

from partrain.errors import Problem

SINFO_FORMAT = "%P|%D|%c|%G"
"""One line per group of alike nodes: partition (default marked `*`), node count, CPUs per node, GRES."""
SINFO_TIMEOUT_S = 20


@dataclass(frozen=True)
class NodeGroup:
    """Nodes of one partition that `sinfo` lists on one line (same CPUs and GPUs)."""

    partition: str
    """Partition name, without sinfo's `*` default marker."""
    default: bool
    """The cluster's default partition (where a job without --partition goes)."""
    nodes: int
    """How many nodes the line stands for."""
    cpus: int
    """CPUs per node."""
    gpus: int
    """GPUs per node (the `gpu` GRES counts summed; 0 when none)."""


@dataclass(frozen=True)
class JobRequest:
    """What the sbatch script asks per job and per node."""

    nodes: int
    tasks_per_node: int
    cpus_per_task: int
    gpus_per_node: int


@dataclass(frozen=True)
class SinfoAnswer:
    """`sinfo`'s node groups, or why there are none (not installed, failed)."""

    groups: Optional[List[NodeGroup]]
    unchecked: str = ""
    """Why the partition could not be checked; empty when groups holds the answer."""


def read_sinfo(which: Callable[[str], Optional[str]] = shutil.which) -> SinfoAnswer:
    """Ask `sinfo` (only when it is on PATH) for every partition's node groups."""
    program = which("sinfo")
    if program is None:
        return SinfoAnswer(None, "sinfo is not on PATH")
    try:
        done = subprocess.run(
            [program, "--noheader", f"--format={SINFO_FORMAT}"],
            capture_output=True,
            text=True,
            timeout=SINFO_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return SinfoAnswer(None, f"sinfo did not answer ({exc})")
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return SinfoAnswer(None, f"sinfo failed: {why}")
    return SinfoAnswer(parse_sinfo(done.stdout))


def parse_sinfo(text: str) -> List[NodeGroup]:
    """Lines of `sinfo --noheader --format=%P|%D|%c|%G`; lines that do not parse are skipped."""
    groups = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 4:
            continue
        name, nodes, cpus, gres = fields
        nodes_n, cpus_n = _leading_int(nodes), _leading_int(cpus)  # "8+" (summarized): at least 8
        if not name or nodes_n is None or cpus_n is None:
            continue
        groups.append(NodeGroup(name.rstrip("*"), name.endswith("*"), nodes_n, cpus_n, gpu_count(gres)))
    return groups


def gpu_count(gres: str) -> int:
    """GPUs per node in sinfo's GRES text: `gpu:8`, `gpu:a100:4(S:0-1),gpu:v100:2`, `(null)`."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        parts = re.sub(r"\(.*?\)", "", item).strip().split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def partition_groups(groups: List[NodeGroup], partition: Optional[str]) -> List[NodeGroup]:
    """The node groups a job lands on: the named partition's, else the default partition's."""
    if partition:
        return [g for g in groups if g.partition == partition]
    return [g for g in groups if g.default]


def partition_problems(groups: List[NodeGroup], partition: Optional[str], job: JobRequest) -> List[Problem]:
    """Why `job` would pend forever in the partition (empty when some `job.nodes` nodes can hold it)."""
    names = sorted({g.partition for g in groups})
    mine = partition_groups(groups, partition)
    if not mine:
        if partition:
            return [
                Problem(
                    "--partition",
                    partition,
                    f"sinfo lists no such partition (there are: {', '.join(names) or 'none'})",
                    "pass one of the partitions sinfo lists",
                )
            ]
        return [] if not groups else [_no_default(names)]
    where = f"partition {mine[0].partition}"
    cpus_needed = job.tasks_per_node * job.cpus_per_task
    problems = []
    if max(g.cpus for g in mine) < cpus_needed:
        most = max(g.cpus for g in mine)
        problems.append(
            Problem(
                "--cpus-per-task",
                job.cpus_per_task,
                f"{job.tasks_per_node} tasks per node x {job.cpus_per_task} CPUs = {cpus_needed} CPUs per node, "
                f"and the nodes of {where} have at most {most} (SLURM would leave the job pending forever)",
                f"pass --cpus-per-task {max(1, most // job.tasks_per_node)}, or fewer cluster.devices_per_node",
            )
        )
    if max(g.gpus for g in mine) < job.gpus_per_node:
        most = max(g.gpus for g in mine)
        problems.append(
            Problem(
                "cluster.devices_per_node",
                job.tasks_per_node,
                f"needs {job.gpus_per_node} GPUs per node, and the nodes of {where} have at most {most}",
                f"set cluster.devices_per_node={most}" if most else "choose a partition with GPUs (--partition)",
            )
        )
    if not problems:
        fitting = sum(g.nodes for g in mine if g.cpus >= cpus_needed and g.gpus >= job.gpus_per_node)
        if fitting < job.nodes:
            problems.append(
                Problem(
                    "cluster.nodes",
                    job.nodes,
                    f"the job asks {job.nodes} nodes, and {where} has {fitting} with {cpus_needed} CPUs"
                    + (f" and {job.gpus_per_node} GPUs" if job.gpus_per_node else "")
                    + " (SLURM would leave the job pending forever)",
                    f"set cluster.nodes={fitting} (or fewer) or choose a larger partition (--partition)"
                    if fitting
                    else "choose another partition (--partition)",
                )
            )
    return problems


def cpus_per_node(groups: List[NodeGroup], partition: Optional[str], nodes: int, gpus_per_node: int) -> Optional[int]:
    """The most CPUs per node that `nodes` nodes of the partition (with the GPUs asked) all have; None
    when sinfo does not list enough such nodes (partition_problems then says why)."""
    usable = sorted((g for g in partition_groups(groups, partition) if g.gpus >= gpus_per_node), key=lambda g: -g.cpus)
    counted = 0
    for group in usable:
        counted += group.nodes
        if counted >= nodes:
            return group.cpus
    return None


def _no_default(names: List[str]) -> Problem:
    return Problem(
        "--partition",
        None,
        "sinfo shows no default partition, so SLURM needs one named",
        f"pass --partition, one of: {', '.join(names)}",
    )


def _leading_int(text: str) -> Optional[int]:
    match = re.match(r"\s*(\d+)", text)
    return int(match.group(1)) if match else None
