"""Who talks to whom: the data-parallel group of a rank, split by node for the hierarchical
all-reduce, and the server ranks of the parameter server. Pure layout arithmetic (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from partrain.blueprint.layout import Layout


@dataclass(frozen=True)
class DpGroups:
    """This rank's data-parallel group (global ranks) and its node structure."""

    members: List[int]
    """The dp x sp group this rank reduces dense gradients with, in group order."""
    me: int
    """This rank's index in members."""
    local: List[int]
    """Members on this rank's node (the intra-node ring of the hierarchical all-reduce)."""
    cross: List[int]
    """Members with this rank's position inside their node, one per node (the inter-node ring)."""


def node_split(layout: Layout, members: List[int]) -> List[List[int]]:
    """Members grouped by node, nodes in order, each in group order."""
    nodes: dict = {}
    for r in members:
        nodes.setdefault(layout.node_of(r), []).append(r)
    return [nodes[n] for n in sorted(nodes)]


def dp_groups(layout: Layout, rank: int) -> DpGroups:
    members = layout.group_of("dp_sp", rank)
    per_node = node_split(layout, members)
    local = next(g for g in per_node if rank in g)
    pos = local.index(rank)
    if len({len(g) for g in per_node}) != 1:  # the blueprint refuses such layouts for `hierarchical`
        raise ValueError(f"dp group {members} has different member counts per node: {per_node}")
    cross = [g[pos] for g in per_node]
    return DpGroups(members, members.index(rank), local, cross)


def server_indices(dp: int, servers: int, dedicated: bool) -> List[int]:
    """Positions in the dp group of the parameter-server ranks. Co-located: spread evenly over the
    group (so with several nodes the servers sit on different nodes); dedicated: the last ones."""
    if dedicated:
        return list(range(dp - servers, dp))
    return [i * dp // servers for i in range(servers)]
