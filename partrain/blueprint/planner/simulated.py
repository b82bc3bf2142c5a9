"""What `partrain plan --simulate` reports, as plain data: each simulated rank's parameters (global
and local shapes, placements, bytes) next to the planner's count, which ranks to simulate by
default, and the folding of layer indices for the terminal. The simulation itself imports torch
and lives in `partrain.simulate.fake_world`."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Sequence


@dataclass
class SimulatedParam:
    name: str
    """Fully qualified parameter name, as in the HF model (pipeline stages keep full names)."""
    shape: List[int]
    """Global (logical) shape."""
    local_shape: List[int]
    """Shape of this rank's shard."""
    placements: str
    """How the DTensor is laid out over its mesh (empty for a plain tensor)."""
    dtype: str
    bytes: int
    """Bytes of the local shard."""


@dataclass
class SimulatedRank:
    rank: int
    coords: Dict[str, int]
    chunks: List[int]
    """Pipeline chunks (virtual stages) this rank runs; [0] without pipeline parallelism."""
    params: List[SimulatedParam]
    simulated: Dict[str, int]
    """Elements and bytes the wrappers produced: param_elements, params, grads, optimizer, total."""
    analytic: Dict[str, int]
    """The planner's count for the same rank, same keys."""
    seconds: float
    """Wall time to build and shard this rank's model on meta."""

    @property
    def exact(self) -> bool:
        return self.simulated["param_elements"] == self.analytic["param_elements"]


@dataclass
class Simulation:
    world_size: int
    ranks: List[SimulatedRank] = field(default_factory=list)
    seconds: float = 0.0
    notes: List[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return all(r.exact for r in self.ranks)

    def to_json(self) -> dict:
        return {
            "world_size": self.world_size,
            "seconds": self.seconds,
            "exact": self.exact,
            "accounting": "runtime: fp32 parameters and gradients, AdamW m and v in fp32",
            "notes": list(self.notes),
            "ranks": [{**asdict(r), "exact": r.exact} for r in self.ranks],
        }


def default_ranks(layout) -> List[int]:
    """The distinct rank roles: for each pipeline stage its first rank (tp, sp, dp coordinates 0:
    the largest FSDP shards) and its last (every coordinate at its maximum: the smallest shards
    when rows do not divide evenly, the last TP slice)."""
    out: List[int] = []
    for k in range(layout.pp):
        first = layout.rank_of({"tp": 0, "sp": 0, "dp": 0, "pp": k})
        last = layout.rank_of({"tp": layout.tp - 1, "sp": layout.sp - 1, "dp": layout.dp - 1, "pp": k})
        out += [first] if first == last else [first, last]
    return out


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def grouped_params(params: Sequence[SimulatedParam]) -> List[dict]:
    """Parameters with the layer index folded (`layers.*.mlp.up_proj.weight` x 20) when every
    folded tensor has the same local shape: what a terminal table can show for an 80-layer model."""
    groups: Dict[tuple, dict] = {}
    for p in params:
        key = (_LAYER_INDEX.sub(".*.", p.name, count=1), tuple(p.shape), tuple(p.local_shape), p.placements, p.dtype)
        g = groups.setdefault(
            key,
            {
                "name": key[0],
                "shape": p.shape,
                "local_shape": p.local_shape,
                "placements": p.placements,
                "dtype": p.dtype,
                "count": 0,
                "bytes": 0,
            },
        )
        g["count"] += 1
        g["bytes"] += p.bytes
    return list(groups.values())
