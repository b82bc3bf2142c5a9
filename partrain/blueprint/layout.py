"""The rank grid: degrees + axis order -> coordinates of every rank, process groups, node placement.

Pure Python, no torch.distributed: the dry run prints it, the runtime turns it into a DeviceMesh.

Convention (brief section 4): axes listed fastest-varying first, default ``tp, sp, dp, pp``::

    rank = tp_r + tp * (sp_r + sp * (dp_r + dp * pp_r))

Derived axes do not multiply the world size:

- ``ep`` (expert parallel) is carved out of the dp x sp ranks of one (tp, pp) slice: the flattened
  dp x sp index is split into ep (fastest, so an EP group is as compact as possible) x edp.
- ``dp_shard`` / ``dp_replicate`` split dp for hybrid sharding: shard fastest (inside a node),
  replicate across.

Group families (each partitions the world):

- ``tp``, ``sp``, ``dp``, ``pp``: ranks that differ only on that axis.
- ``dp_sp``: ranks that hold the same dense parameters (gradients of dense weights reduce here,
  FSDP shards here).
- ``ep``: ranks that exchange tokens for one MoE layer; ``edp``: ranks holding the same experts.
- ``dp_shard``, ``dp_replicate``: the two levels of hybrid sharding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from partrain.blueprint.config.schema import AXES

GROUP_FAMILIES = ("tp", "sp", "dp", "pp", "ep", "dp_sp", "edp", "dp_shard", "dp_replicate")


@dataclass(frozen=True)
class Layout:
    """A resolved rank grid. All degrees are positive; `order` is a permutation of AXES."""

    tp: int = 1
    sp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1
    dp_shard: int = 1
    order: Tuple[str, ...] = AXES
    devices_per_node: int = 1
    _cache: Dict[str, List[List[int]]] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if sorted(self.order) != sorted(AXES):
            raise ValueError(f"order must be a permutation of {AXES}, got {self.order}")
        for name in ("tp", "sp", "dp", "pp", "ep", "dp_shard", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if (self.dp * self.sp) % self.ep:
            raise ValueError("ep must divide dp * sp")
        if self.dp % self.dp_shard:
            raise ValueError("dp_shard must divide dp")

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def degrees(self) -> Dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "ep": self.ep, "sp": self.sp}

    @property
    def world_size(self) -> int:
        return self.tp * self.sp * self.dp * self.pp

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.devices_per_node)

    # -- coordinates ---------------------------------------------------------------------------
    def base_coords(self, rank: int) -> Dict[str, int]:
        """Coordinates on the four world-size axes."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        coords = {}
        rest = rank
        for axis in self.order:
            size = getattr(self, axis)
            coords[axis] = rest % size
            rest //= size
        return coords

    def rank_of(self, coords: Dict[str, int]) -> int:
        rank, stride = 0, 1
        for axis in self.order:
            rank += coords[axis] * stride
            stride *= getattr(self, axis)
        return rank

    def _dp_sp_index(self, c: Dict[str, int]) -> int:
        # Flatten dp x sp in the same relative order the two axes have in `order`.
        if self.order.index("sp") < self.order.index("dp"):
            return c["sp"] + self.sp * c["dp"]
        return c["dp"] + self.dp * c["sp"]

    def coords(self, rank: int) -> Dict[str, int]:
        """Coordinates on every axis, derived ones included."""
        c = self.base_coords(rank)
        flat = self._dp_sp_index(c)
        c["ep"] = flat % self.ep
        c["edp"] = flat // self.ep
        c["dp_shard"] = c["dp"] % self.dp_shard
        c["dp_replicate"] = c["dp"] // self.dp_shard
        return c

    def node_of(self, rank: int) -> int:
        return rank // self.devices_per_node

    def local_rank_of(self, rank: int) -> int:
        return rank % self.devices_per_node

    # -- groups --------------------------------------------------------------------------------
    def _family_key(self, family: str, c: Dict[str, int]) -> Tuple[Tuple, int]:
        """(what members share, position inside the group) for one rank."""
        pos_on = {
            "tp": c["tp"],
            "sp": c["sp"],
            "dp": c["dp"],
            "pp": c["pp"],
            "dp_sp": self._dp_sp_index(c),
            "ep": c["ep"],
            "edp": c["edp"],
            "dp_shard": c["dp_shard"],
            "dp_replicate": c["dp_replicate"],
        }[family]
        fixed = {
            "tp": ("sp", "dp", "pp"),
            "sp": ("tp", "dp", "pp"),
            "dp": ("tp", "sp", "pp"),
            "pp": ("tp", "sp", "dp"),
            "dp_sp": ("tp", "pp"),
            "ep": ("tp", "pp", "edp"),
            "edp": ("tp", "pp", "ep"),
            "dp_shard": ("tp", "sp", "pp", "dp_replicate"),
            "dp_replicate": ("tp", "sp", "pp", "dp_shard"),
        }[family]
        return tuple(c[a] for a in fixed), pos_on

    def groups(self, family: str) -> List[List[int]]:
        """Members of every group of one family, each group ordered by position, groups by first rank."""
        if family not in GROUP_FAMILIES:
            raise ValueError(f"unknown group family {family!r}; known: {GROUP_FAMILIES}")
        if family in self._cache:
            return self._cache[family]
        buckets: Dict[Tuple, Dict[int, int]] = {}
        for rank in range(self.world_size):
            key, pos = self._family_key(family, self.coords(rank))
            buckets.setdefault(key, {})[pos] = rank
        result = sorted(([b[i] for i in sorted(b)] for b in buckets.values()), key=lambda g: g[0])
        self._cache[family] = result
        return result

    def group_of(self, family: str, rank: int) -> List[int]:
        for group in self.groups(family):
            if rank in group:
                return group
        raise ValueError(f"rank {rank} outside world of {self.world_size}")

    # -- report --------------------------------------------------------------------------------
    def rank_table(self) -> List[dict]:
        rows = []
        for rank in range(self.world_size):
            c = self.coords(rank)
            rows.append(
                {
                    "rank": rank,
                    "node": self.node_of(rank),
                    "local_rank": self.local_rank_of(rank),
                    "coords": {a: c[a] for a in ("dp", "tp", "pp", "sp", "ep")},
                }
            )
        return rows

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "degrees": self.degrees,
            "order": list(self.order),
            "ranks": self.rank_table(),
            "groups": {f: self.groups(f) for f in GROUP_FAMILIES},
        }


def resolve_degrees(degrees: Dict[str, int], world_size: int) -> Dict[str, int]:
    """Replace the one -1 among the world-size axes by what the others leave.

    Assumes validation already checked there is at most one -1 and that it divides evenly.
    """
    out = dict(degrees)
    known = 1
    for axis in AXES:
        if out[axis] != -1:
            known *= out[axis]
    for axis in AXES:
        if out[axis] == -1:
            out[axis] = world_size // known
    return out


def divisors(n: int) -> List[int]:
    """The positive divisors of n in increasing order ([] for n < 1). Up to sqrt(n) trials: a config value
    of 2**31 heads or ranks is answered at once, not after 2**31 trials."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return small + large[::-1]


def factorizations(world_size: int, fixed: Dict[str, int], free: Sequence[str]) -> List[Dict[str, int]]:
    """Every assignment of the `free` axes such that product(all) == world_size (for fix hints)."""
    known = 1
    for v in fixed.values():
        known *= v
    if known == 0 or world_size % known:
        return []
    rest = world_size // known
    results: List[Dict[str, int]] = [{}]
    for i, axis in enumerate(free):
        nxt = []
        for partial in results:
            used = 1
            for v in partial.values():
                used *= v
            remaining = rest // used
            options = [remaining] if i == len(free) - 1 else divisors(remaining)
            for d in options:
                nxt.append({**partial, axis: d})
        results = nxt
    return results
