"""Alpha-beta cost of one step's data-parallel gradient sync, per `parallel.dp_sync` strategy.

G = gradient bytes of one rank, N = ranks of the dp group, n = of them per node, k = N / n nodes.
Every step of a ring costs alpha (a message's fixed cost on that link class) and a phase moves its
bytes at the link's bandwidth (beta = 1 / bandwidth); a group that spans nodes runs at the
inter-node link class (`comm.link_of`).

- allreduce (the backend's ring): 2(N-1)/N G per rank; 2(N-1) steps per bucket.
- ring (partrain's, over send/recv): the same bytes and steps, timed with the send/recv link.
- hierarchical: inside a node a reduce-scatter + all-gather, 2(n-1)/n G and 2(n-1) steps on the
  intra-node link; across nodes an all-reduce of the 1/n shard, 2(k-1)/k G/n and 2(k-1) steps on
  the inter-node link. Inter-node bytes fall n-fold against the flat ring.
- parameter-server with S servers (W workers: N co-located, N - S dedicated): a server receives
  W' G/S (push) and sends W' G/S (pull), W' = the workers other than itself, and (co-located) pushes
  the rest of its own gradient, G - G/S; a plain worker sends G and receives G. The busiest rank is
  a server: its bytes grow with W, and its link time bounds the step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import List, Sequence

from partrain.blueprint.planner.comm import link_of
from partrain.blueprint.planner.spec import ClusterSpec

STRATEGIES = ("allreduce", "ring", "hierarchical", "parameter-server")


@dataclass(frozen=True)
class SyncCost:
    strategy: str
    seconds: float
    """Predicted time of one step's gradient sync (no overlap with backward counted)."""
    bytes_per_rank: float
    """Mean bytes one rank sends per step."""
    busiest_bytes: float
    """Bytes the busiest rank sends per step (a parameter server's egress)."""
    inter_node_bytes: float
    """Bytes the busiest rank sends across nodes per step."""

    def to_json(self) -> dict:
        return asdict(self)


def _ring(cluster: ClusterSpec, members: Sequence[int], size: float, buckets: int, op: str) -> tuple:
    n = len(members)
    if n <= 1 or size <= 0:
        return 0.0, 0.0, "intra"
    link = link_of(cluster, members)
    sent = 2 * (n - 1) / n * size
    seconds = buckets * 2 * (n - 1) * cluster.alpha(link, op) + sent / cluster.bw(link, op)
    return seconds, sent, link


def ring_cost(cluster: ClusterSpec, members: Sequence[int], grad_bytes: float, buckets: int, backend: bool) -> SyncCost:
    op = "all_reduce" if backend else "send_recv"
    seconds, sent, link = _ring(cluster, members, grad_bytes, buckets, op)
    return SyncCost("allreduce" if backend else "ring", seconds, sent, sent, sent if link == "inter" else 0.0)


def node_groups(members: Sequence[int], devices_per_node: int) -> List[List[int]]:
    nodes: dict = {}
    for r in members:
        nodes.setdefault(r // devices_per_node, []).append(r)
    return [nodes[k] for k in sorted(nodes)]


def hierarchical_cost(cluster: ClusterSpec, members: Sequence[int], grad_bytes: float, buckets: int) -> SyncCost:
    per_node = node_groups(members, cluster.devices_per_node)
    local, cross = per_node[0], [g[0] for g in per_node]
    t_in, b_in, _ = _ring(cluster, local, grad_bytes, buckets, "send_recv")
    t_x, b_x, link = _ring(cluster, cross, grad_bytes / len(local), buckets, "send_recv")
    return SyncCost("hierarchical", t_in + t_x, b_in + b_x, b_in + b_x, b_x if link == "inter" else 0.0)


def server_cost(
    cluster: ClusterSpec, members: Sequence[int], grad_bytes: float, servers: int, dedicated: bool
) -> SyncCost:
    n = len(members)
    if n <= 1:
        return SyncCost("parameter-server", 0.0, 0.0, 0.0, 0.0)
    shard = grad_bytes / servers
    workers = n - servers if dedicated else n
    peers = workers if dedicated else workers - 1  # workers a server exchanges with
    # A co-located server pushes the other servers' shards of its own gradient; a worker pushes all of it.
    server_out = peers * shard + (0.0 if dedicated else grad_bytes - shard)
    worker_out = grad_bytes
    non_servers = n - servers
    total = servers * server_out + non_servers * worker_out
    link = link_of(cluster, members)
    bw, alpha = cluster.bw(link, "send_recv"), cluster.alpha(link, "send_recv")
    # Push and pull each: the server's ingress (then egress) of peers x shard bounds the phase.
    phase = max(peers * shard, worker_out)
    seconds = 2 * (phase / bw + alpha)
    busiest = max(server_out, worker_out if non_servers else 0.0)
    return SyncCost("parameter-server", seconds, total / n, busiest, busiest if link == "inter" else 0.0)


def sync_cost(
    strategy: str,
    cluster: ClusterSpec,
    members: Sequence[int],
    grad_bytes: float,
    buckets: int = 1,
    servers: int = 1,
    dedicated: bool = False,
) -> SyncCost:
    """The predicted cost of `strategy` over the dp group `members` (global ranks) for one step."""
    if strategy in ("allreduce", "ring"):
        return ring_cost(cluster, members, grad_bytes, buckets, backend=strategy == "allreduce")
    if strategy == "hierarchical":
        return hierarchical_cost(cluster, members, grad_bytes, buckets)
    if strategy == "parameter-server":
        return server_cost(cluster, members, grad_bytes, servers, dedicated)
    raise ValueError(f"unknown dp_sync strategy {strategy!r}; known: {STRATEGIES}")
