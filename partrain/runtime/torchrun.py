"""The one place that builds a torchrun command line (`python -m torch.distributed.run`).

Single machine: the standalone rendezvous (a free port on localhost, no endpoint to configure).
Several machines: a rendezvous at a HOST:PORT every node is given (`Rendezvous`): torchrun's static
one (node K hosts global ranks K*devices_per_node...), or c10d for an elastic run.
No torch import here: the CLI builds the command before any heavy import.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence


@dataclass(frozen=True)
class Rendezvous:
    """Where and how the nodes of a multi-node run meet.

    A fixed set of nodes meets at torchrun's static rendezvous: `--node-rank` is torchrun's node
    rank, so node K runs global ranks K*n..K*n+n-1 (n = devices per node) and node 0 runs global
    rank 0, whichever node starts first. An elastic run (min_nodes < nodes) needs c10d, whose
    membership may change; there global ranks follow c10d's order of the nodes, not node_rank."""

    nodes: int
    node_rank: int
    endpoint: str
    """HOST:PORT; node 0 hosts the store there (is_host), the others connect to it."""
    run_id: str
    """Names the rendezvous: every node of one run passes the same id."""
    timeout_s: int
    """How long a node waits for the others to join, and at the end for the others to finish (train.timeout_s)."""
    min_nodes: int = 0
    """Elastic run: train on while this many nodes take part (cluster.min_nodes); 0 = all `nodes` (not elastic)."""
    wait_s: int = 30
    """Elastic run: once min_nodes joined, how long the rendezvous waits for the rest (cluster.elastic_wait_s)."""

    @property
    def elastic(self) -> bool:
        return 0 < self.min_nodes < self.nodes

    def args(self) -> List[str]:
        if not self.elastic:
            # Node 0 serves the store at the endpoint; the others retry connecting for timeout_s.
            return [
                f"--nnodes={self.nodes}",
                "--rdzv-backend=static",
                f"--rdzv-endpoint={self.endpoint}",
                f"--node-rank={self.node_rank}",
                f"--rdzv-id={self.run_id}",
                f"--rdzv-conf=timeout={self.timeout_s}",
            ]
        # torchrun ignores --node-rank under c10d (global ranks follow the join order); partrain's node
        # rank picks the store host, so two nodes on one host never both try to serve the port.
        host = "true" if self.node_rank == 0 else "false"
        conf = f"join_timeout={self.timeout_s},is_host={host}"
        nnodes = str(self.nodes)
        if self.elastic:
            nnodes = f"{self.min_nodes}:{self.nodes}"
            # A lost node leaves the rendezvous when ELASTIC_KEEP_ALIVE heartbeats are missed (1 s each):
            # torch's default, 3 x 5 s, would add 15 s to every restart after a node is lost.
            conf += (
                f",last_call_timeout={self.wait_s},keep_alive_interval=1,keep_alive_max_attempt={ELASTIC_KEEP_ALIVE}"
            )
        return [
            f"--nnodes={nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.endpoint}",
            f"--rdzv-id={self.run_id}",
            f"--rdzv-conf={conf}",
        ]

    def environ(self) -> dict:
        """Variables torchrun needs on this node. Elastic: torch's agent shares one TCP store between
        rendezvous rounds and only the node that was rank 0 at the first round publishes its address,
        so a node joining later waits for it forever; without sharing, each round's rank 0 serves a
        fresh store."""
        return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if self.elastic else {}


ELASTIC_KEEP_ALIVE = 3
"""Missed 1-s heartbeats after which an elastic run's rendezvous counts a node as gone."""

ELASTIC_RESTARTS_PER_NODE = 2
"""Restarts an elastic run adds to train.max_restarts per node it may lose: a lost node costs the
others one (a node joining costs none: torch does not count membership changes)."""


def elastic_restarts(max_restarts: int, rendezvous: Optional["Rendezvous"]) -> int:
    """torchrun's --max-restarts for a run: train.max_restarts, plus room for an elastic run's node losses."""
    if rendezvous is None or not rendezvous.elastic:
        return max_restarts
    return max_restarts + ELASTIC_RESTARTS_PER_NODE * (rendezvous.nodes - rendezvous.min_nodes)


def torchrun_command(
    nproc_per_node: int,
    target: Sequence[str],
    max_restarts: int = 0,
    log_dir: Optional[Path] = None,
    quiet_other_ranks: bool = False,
    rendezvous: Optional[Rendezvous] = None,
) -> List[str]:
    """`python -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=N ... TARGET`.

    target: what each process runs, e.g. ["-m", "partrain.worker", RUN_DIR] or [script, args...].
    quiet_other_ranks: ranks other than 0 write their output to files under log_dir only.
    rendezvous: a multi-node run (c10d rendezvous) instead of the standalone one.
    """
    if rendezvous:
        # torchrun itself, its exit barrier bounded by train.timeout_s (see partrain.runtime.elastic_run).
        # The ranks end together (the run ends with a collective), so a few seconds cover a live peer.
        barrier_s = min(rendezvous.timeout_s, 5)
        cmd = [sys.executable, "-m", "partrain.runtime.elastic_run", f"--exit-barrier-timeout={barrier_s}"]
        cmd += rendezvous.args()
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1"]
    cmd.append(f"--nproc-per-node={nproc_per_node}")
    if max_restarts:
        cmd.append(f"--max-restarts={max_restarts}")
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir)]
    if quiet_other_ranks and nproc_per_node > 1:
        cmd += ["--redirects", ",".join(f"{i}:3" for i in range(1, nproc_per_node))]
    return cmd + [str(part) for part in target]
