"""Communication: bytes each rank moves per collective, which link a group runs at, and time.

Volumes per rank (ring algorithms, the NCCL/gloo bandwidth-optimal ones): all-reduce of X bytes
over n ranks moves 2(n-1)/n X; all-gather and reduce-scatter (n-1)/n X (X = the full, gathered
size); all-to-all (n-1)/n X of the X bytes a rank holds; point-to-point X.

Links: a group whose members all sit in one node talks at the intra-node bandwidth, otherwise at
the inter-node bandwidth (the slowest link it spans; both per device per direction, as the cluster
config states them). Time = volume / bandwidth; latency is ignored (large messages). With
`cluster.comm_profile` the bandwidth is the bus bandwidth `partrain bench comm` measured for that op
(all-reduce, all-gather, reduce-scatter, all-to-all, send/recv) on that link class: nccl-tests
define busbw with the same ring factors as above, so volume / busbw is the measured time.

Group membership is computed from the axis order without listing the world (rank 0's group of
each family; layouts are regular, so every group of a family has the same shape).
"""

from __future__ import annotations

import functools
from typing import Dict, Iterable, List, Sequence, Tuple

from partrain.blueprint.planner.spec import ClusterSpec

COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""The collectives the planner times (and `partrain bench comm` measures)."""


def all_reduce_bytes(size: float, n: int) -> float:
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def all_gather_bytes(size: float, n: int) -> float:
    """Also reduce-scatter; `size` is the full (gathered) tensor."""
    return (n - 1) / n * size if n > 1 else 0.0


def all_to_all_bytes(size: float, n: int) -> float:
    return (n - 1) / n * size if n > 1 else 0.0


def _strides(order: Sequence[str], degrees: Dict[str, int]) -> Dict[str, int]:
    out, stride = {}, 1
    for axis in order:
        out[axis] = stride
        stride *= degrees[axis]
    return out


def group_members(order: Sequence[str], degrees: Dict[str, int], axes: Iterable[str], limit: int = 0) -> List[int]:
    """Ranks of rank 0's group over `axes` (e.g. ("dp", "sp") for dp_sp), in position order
    (first listed axis fastest). `limit` keeps only the first members (0 = all)."""
    strides = _strides(order, degrees)
    members = [0]
    for axis in axes:
        members = [m + k * strides[axis] for k in range(degrees[axis]) for m in members]
        if limit and len(members) >= limit:
            return members[:limit]
    return members


def spans_nodes(members: Sequence[int], devices_per_node: int) -> bool:
    if not members:
        return False
    node = members[0] // devices_per_node
    return any(m // devices_per_node != node for m in members)


def link_of(cluster: ClusterSpec, members: Sequence[int]) -> str:
    """ "inter" when the group spans nodes, else "intra" (the link classes of a comm profile)."""
    return "inter" if spans_nodes(members, cluster.devices_per_node) else "intra"


def bandwidth(cluster: ClusterSpec, members: Sequence[int], op: str = "all_reduce") -> float:
    """Bytes/s of `op` in this group: nominal link speed, or the measured bus bandwidth of that op
    on that link class when the cluster has a comm profile (ClusterSpec.bw)."""
    return cluster.bw(link_of(cluster, members), op)


def family_groups(order: Sequence[str], degrees: Dict[str, int], ep: int, dp_shard: int) -> Dict[str, List[int]]:
    """Rank 0's group of each family the planner times: tp, sp, dp_sp, pp, ep, edp, dp_shard."""
    return _family_groups(tuple(order), tuple(sorted(degrees.items())), ep, dp_shard)


@functools.lru_cache(maxsize=4096)
def _family_groups(order: Tuple[str, ...], degree_items: Tuple, ep: int, dp_shard: int) -> Dict[str, List[int]]:
    d = dict(degree_items)
    dp_sp_axes = ("sp", "dp") if order.index("sp") < order.index("dp") else ("dp", "sp")
    dp_sp = group_members(order, d, dp_sp_axes)
    # Shard group: the dp_shard ranks (the fastest part of dp) x sp, in world strides.
    strides = _strides(order, d)
    shard = [0]
    for axis in dp_sp_axes:
        size = dp_shard if axis == "dp" else d["sp"]
        shard = [m + k * strides[axis] for k in range(size) for m in shard]
    return {
        "tp": group_members(order, d, ("tp",)),
        "sp": group_members(order, d, ("sp",)),
        "dp_sp": dp_sp,
        "pp": group_members(order, d, ("pp",)),
        "ep": dp_sp[:ep],
        "edp": dp_sp[::ep],
        "dp_shard": shard,
    }
