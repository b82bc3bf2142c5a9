"""The launcher's multi-node side: the c10d rendezvous of one node, and how a node's end is told.

`partrain train OVERRIDES --node-rank K --rdzv-endpoint HOST:PORT` on every node (cluster.nodes of
them) starts torchrun there with cluster.devices_per_node processes; the nodes meet at HOST:PORT
(node 0 hosts the store; torchrun's static rendezvous, so node K runs global ranks K*n..K*n+n-1 and
node 0 runs global rank 0; an elastic run uses c10d, whose order the ranks follow). Each node has its
own run folder (train.run_dir: logs, its data manifest; metrics and summary land in the folder of the
node running global rank 0);
checkpoints go to checkpoint.dir, one folder every node sees (DCP writes each rank's shards there),
whose lock only node 0 holds. Workers check that all nodes composed the same run (runtime.agreement).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from pathlib import Path
from typing import Iterator, List, Optional

from partrain.blueprint.validate import ValidatedRun
from partrain.errors import ConfigError, Problem
from partrain.runtime.agreement import SAME_RUN_FIX
from partrain.runtime.shared_checkpoints import checkpoint_dir_problems
from partrain.runtime.torchrun import Rendezvous

ENDPOINT = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:(\d{1,5})$")


def rendezvous_of(v: ValidatedRun) -> Optional[Rendezvous]:
    """The rendezvous of a multi-node run (None for one node); ConfigError (exit 2) before anything
    starts when the endpoint is missing or malformed, the node rank out of range, or checkpoints
    would be written to node-local folders."""
    c = v.run.cluster
    if c.nodes <= 1:
        if c.node_rank != 0:
            raise ConfigError(
                Problem(
                    "cluster.node_rank",
                    c.node_rank,
                    "names a node of a multi-node run, but cluster.nodes=1",
                    "set cluster.nodes to the number of machines, or leave out --node-rank",
                )
            )
        return None
    problems: List[Problem] = []
    if not c.rdzv_endpoint:
        problems.append(
            Problem(
                "cluster.rdzv_endpoint",
                "",
                f"a run over cluster.nodes={c.nodes} nodes needs the rendezvous address (--rdzv-endpoint)",
                "pass --rdzv-endpoint HOST:PORT (node 0's address and a free port) and --node-rank K on every node",
            )
        )
    elif not ENDPOINT.match(c.rdzv_endpoint) or not 0 < int(ENDPOINT.match(c.rdzv_endpoint).group(1)) < 65536:
        problems.append(
            Problem("cluster.rdzv_endpoint", c.rdzv_endpoint, "must be HOST:PORT", "e.g. --rdzv-endpoint node0:29400")
        )
    if not 0 <= c.node_rank < c.nodes:
        problems.append(
            Problem(
                "cluster.node_rank",
                c.node_rank,
                f"must be in 0..{c.nodes - 1} (cluster.nodes={c.nodes})",
                "pass --node-rank K, a different K on every node, 0 on the node named by --rdzv-endpoint",
            )
        )
    problems += checkpoint_dir_problems(v.run)  # the same rule under srun and `launch slurm`
    if problems:
        raise ConfigError(problems)
    run_id = "partrain-" + re.sub(r"[^A-Za-z0-9]", "-", c.rdzv_endpoint)
    return Rendezvous(
        c.nodes,
        c.node_rank,
        c.rdzv_endpoint,
        run_id,
        timeout_s=int(v.run.train.timeout_s),
        min_nodes=c.min_nodes or c.nodes,
        wait_s=c.elastic_wait_s,
    )


def node_outcome(rdzv: Rendezvous, code: int, seen: dict, log_text: str) -> Optional[tuple]:
    """How a node whose launcher saw no rank-0 events ended: (exit code, line), or None when rank 0's
    events (or a plain failure) decide. seen: the events `partrain.launch._follow` collected."""
    if seen.get("refused"):
        lines = [f"error: the nodes do not agree on {line}" for line in seen["refused"]["lines"]]
        lines.append(f"fix: {seen['refused'].get('fix') or SAME_RUN_FIX}")
        return 2, "\n".join(lines)
    if "start" in seen or seen.get("stopped"):
        return None
    if code == 0:
        # The static rendezvous puts global rank 0 on node 0; an elastic run's c10d puts it anywhere.
        where = "the node that ran global rank 0" if rdzv.elastic else "node 0 (it runs global rank 0)"
        return 0, (
            f"node {rdzv.node_rank}: its workers ended cleanly; the run's summary and metrics are in the run "
            f"folder of {where}"
        )
    if _rendezvous_timed_out(log_text):
        # The join times out below cluster.nodes participants; with two nodes that means this one alone.
        joined = "only this node joined" if rdzv.nodes == 2 else f"fewer than {rdzv.nodes} joined"
        return 1, (
            f"error: node {rdzv.node_rank} waited {rdzv.timeout_s} s (train.timeout_s) at {rdzv.endpoint} "
            f"for {rdzv.nodes} nodes to join; {joined}. Start `partrain train ... --node-rank K "
            f"--rdzv-endpoint {rdzv.endpoint}` on every node within train.timeout_s"
        )
    return None


def _rendezvous_timed_out(log_text: str) -> bool:
    """torchrun's agent gave up meeting the other nodes: c10d's errors, or the static rendezvous's
    store (node 0 waiting for clients, another node failing to connect; only the agent's own
    traceback names static_tcp_rendezvous, a worker losing the store mid-run does not)."""
    if "RendezvousTimeoutError" in log_text or "RendezvousClosedError" in log_text:
        return True
    store_gave_up = "waiting for clients" in log_text or "while trying to connect to" in log_text
    return store_gave_up and "static_tcp_rendezvous" in log_text


PREPARE_LOCK = ".prepare.lock"


@contextlib.contextmanager
def preparing_data(v: ValidatedRun) -> Iterator[None]:
    """Hold the token cache's preparation lock for the block (waiting for another node to finish).

    Nodes sharing a cache (one host, or a shared file system) would otherwise tokenize the same entry
    at once, each clearing the other's temporary files; with the lock the second finds the entry
    built. A cache root this creates is removed again if it ends up holding only the lock file."""
    from partrain.data.packing import cache_root_for

    root = cache_root_for(v.run.data)
    created = not root.exists()
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / PREPARE_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
        if created and [p.name for p in root.iterdir()] == [PREPARE_LOCK]:
            with contextlib.suppress(OSError):
                (root / PREPARE_LOCK).unlink()
                root.rmdir()


def torchrun_log_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-200_000:]
    except OSError:
        return ""
