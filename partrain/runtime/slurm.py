"""A worker's place in a SLURM job step, derived from SLURM's variables alone (one task per device).

Under `srun partrain train ...` every task is one worker: its global rank is SLURM_PROCID, its local
rank (the device it drives) SLURM_LOCALID, its node SLURM_NODEID, the world SLURM_NTASKS. The
rendezvous host is the first node of the step's node list (expanded here from SLURM's compressed
form, `gpu[01-04,07]`, without `scontrol`) and the port is derived from SLURM_JOB_ID, so every task
of the step computes the same address without talking to the others; MASTER_ADDR / MASTER_PORT in
the environment win when set. Everything here is a pure function of the environment mapping it is
given: tests pass a fake SLURM environment.
"""

from __future__ import annotations

import re
from typing import List, Mapping, Sequence

from partrain.errors import ConfigError, Problem

PORT_BASE = 15000
PORT_SPAN = 20000
"""MASTER_PORT = PORT_BASE + SLURM_JOB_ID mod PORT_SPAN: one port per job, below Linux's ephemeral range."""

NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
NNODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
NTASKS_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
"""The step's own variables first (srun inside sbatch sets both), then the job's."""

SRUN_FIX = "partrain launch slurm OVERRIDES writes an sbatch script whose srun matches the layout"


def under_srun(environ: Mapping[str, str]) -> bool:
    """True for a task of a SLURM step of several tasks (each task is then one worker); False under
    torchrun (RANK and WORLD_SIZE set), also when torchrun itself runs inside a SLURM job."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return False
    ntasks = _first(environ, NTASKS_VARS)
    return "SLURM_PROCID" in environ and ntasks is not None and ntasks.strip().isdigit() and int(ntasks) > 1


def expand_nodelist(text: str) -> List[str]:
    """SLURM's compressed host list to host names: `node[03-04],login5` -> node03, node04, login5.

    Ranges keep their zero padding; several bracket groups in one name multiply
    (`r[1-2]n[1-2]` -> r1n1, r1n2, r2n1, r2n2)."""
    hosts: List[str] = []
    for item in _split_outside_brackets(text.strip()):
        if item:
            hosts.extend(_expand_one(item, text))
    if not hosts:
        raise ValueError(f"empty node list {text!r}")
    return hosts


def expand_counts(text: str) -> List[int]:
    """SLURM's compressed per-node counts: `4(x2),2` -> [4, 4, 2]."""
    counts: List[int] = []
    for item in text.strip().split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise ValueError(f"not a SLURM count list: {text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def master_port_for(job_id: str) -> int:
    """The rendezvous port of a job: the same on every task, different for jobs sharing a node."""
    return PORT_BASE + int(job_id) % PORT_SPAN


def slurm_fields(environ: Mapping[str, str]) -> dict:
    """DistEnv's fields for this task: rank, world_size, local_rank, local_world_size, node_rank,
    master_addr, master_port. A variable SLURM sets malformed raises ConfigError naming it."""
    rank = _int(environ, "SLURM_PROCID")
    world = _int(environ, _present(environ, NTASKS_VARS))
    node = _int(environ, "SLURM_NODEID", default=0)
    per_node = _tasks_per_node(environ)
    local_world = per_node[node] if node < len(per_node) else per_node[-1]
    fields = dict(
        rank=rank,
        world_size=world,
        local_rank=_int(environ, "SLURM_LOCALID", default=0),
        local_world_size=local_world,
        node_rank=node,
        master_addr=environ.get("MASTER_ADDR") or _first_host(environ),
        master_port=_int(environ, "MASTER_PORT") if environ.get("MASTER_PORT") else _port(environ),
    )
    for name, value, limit in (("SLURM_PROCID", rank, world), ("SLURM_LOCALID", fields["local_rank"], local_world)):
        if not 0 <= value < limit:
            raise ConfigError(Problem(name, value, f"must be below {limit}", "start partrain under srun"))
    return fields


def allocation_problems(environ: Mapping[str, str], nodes: int, devices_per_node: int) -> List[Problem]:
    """How the SLURM step differs from the layout's cluster.nodes x cluster.devices_per_node (empty
    when it matches, or when this is not a step of several tasks)."""
    if not under_srun(environ):
        return []
    world = _int(environ, _present(environ, NTASKS_VARS))
    step_nodes = _int(environ, _present(environ, NNODES_VARS)) if _first(environ, NNODES_VARS) else None
    per_node = _tasks_per_node(environ)
    srun = f"srun --nodes={nodes} --ntasks-per-node={devices_per_node}"
    problems = []
    if step_nodes is not None and step_nodes != nodes:
        problems.append(
            Problem(
                "cluster.nodes",
                nodes,
                f"the SLURM step runs on {step_nodes} nodes (SLURM_NNODES={step_nodes}), the layout needs {nodes}",
                f"allocate and run `{srun}`, or set cluster.nodes={step_nodes}; {SRUN_FIX}",
            )
        )
    if any(count != devices_per_node for count in per_node):
        got = ",".join(str(c) for c in per_node)
        problems.append(
            Problem(
                "cluster.devices_per_node",
                devices_per_node,
                f"the SLURM step runs {got} tasks per node (one task is one worker), the layout needs "
                f"{devices_per_node} on every node",
                f"run `{srun}`, or set cluster.devices_per_node to the tasks per node; {SRUN_FIX}",
            )
        )
    if not problems and world != nodes * devices_per_node:
        problems.append(
            Problem(
                "cluster.nodes",
                nodes,
                f"the SLURM step has {world} tasks (SLURM_NTASKS), the layout needs nodes x devices_per_node = "
                f"{nodes * devices_per_node}",
                f"run `{srun}`; {SRUN_FIX}",
            )
        )
    return problems


def check_allocation(environ: Mapping[str, str], nodes: int, devices_per_node: int) -> None:
    """Raise ConfigError (exit 2) when a SLURM step does not match the layout; before any file exists."""
    problems = allocation_problems(environ, nodes, devices_per_node)
    if problems:
        raise ConfigError(problems)


def _split_outside_brackets(text: str) -> List[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    return items + [current]


def _expand_one(item: str, whole: str) -> List[str]:
    match = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not match:
        if "[" in item or "]" in item:
            raise ValueError(f"unbalanced brackets in node list {whole!r}")
        return [item]
    prefix, ranges, rest = match.groups()
    tails = _expand_one(rest, whole) if rest else [""]
    names = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"not a host range {part!r} in node list {whole!r}")
        width = len(low)
        for n in range(int(low), int(high or low) + 1):
            names.extend(f"{prefix}{n:0{width}d}{tail}" for tail in tails)
    return names


def _first(environ: Mapping[str, str], names: Sequence[str]):
    return next((environ[n] for n in names if environ.get(n)), None)


def _present(environ: Mapping[str, str], names: Sequence[str]) -> str:
    return next((n for n in names if environ.get(n)), names[-1])


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = environ.get(name)
    if text is None and default is not None:
        return default
    try:
        return int(str(text).strip())
    except ValueError:
        raise ConfigError(
            Problem(name, text, "must be an integer (set by SLURM for every task)", "start partrain under srun")
        ) from None


def _tasks_per_node(environ: Mapping[str, str]) -> List[int]:
    name = _present(environ, TASKS_PER_NODE_VARS)
    if not environ.get(name):  # no per-node counts: the tasks are spread evenly over the nodes
        nodes = _int(environ, _present(environ, NNODES_VARS), default=1)
        return [_int(environ, _present(environ, NTASKS_VARS)) // max(1, nodes)] * max(1, nodes)
    try:
        return expand_counts(environ[name])
    except ValueError as exc:
        raise ConfigError(Problem(name, environ[name], str(exc), "start partrain under srun")) from None


def _first_host(environ: Mapping[str, str]) -> str:
    name = _present(environ, NODELIST_VARS)
    if not environ.get(name):
        return "127.0.0.1"  # one node and no list: a fake or minimal environment
    try:
        return expand_nodelist(environ[name])[0]
    except ValueError as exc:
        raise ConfigError(Problem(name, environ[name], str(exc), "start partrain under srun")) from None


def _port(environ: Mapping[str, str]) -> int:
    if not environ.get("SLURM_JOB_ID"):
        return 29500
    return master_port_for(str(_int(environ, "SLURM_JOB_ID")))
