"""Turn the pure-Python Layout into a torch DeviceMesh where every axis exists (size 1 if unused).

Mesh dimensions are the layout's axes outermost first, with dp split into (dp_replicate, dp_shard)
for hybrid sharding, e.g. for the default order tp, sp, dp, pp:

    ("pp", "dp_replicate", "dp_shard", "sp", "tp")

Row-major rank numbering of this mesh equals the layout's rank formula, so mesh groups and the
groups the dry run prints are the same (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from partrain.blueprint.layout import Layout


def mesh_dims(layout: Layout) -> List[Tuple[str, int]]:
    dims: List[Tuple[str, int]] = []
    for axis in reversed(layout.order):
        if axis == "dp":
            dims += [("dp_replicate", layout.dp // layout.dp_shard), ("dp_shard", layout.dp_shard)]
        else:
            dims.append((axis, getattr(layout, axis)))
    return dims


@dataclass
class ParallelMesh:
    """The world mesh plus the flattened sub-meshes the parallel wrappers need."""

    world: DeviceMesh
    layout: Layout
    flat: Dict[str, DeviceMesh]

    def __getitem__(self, name: str) -> DeviceMesh:
        if name in self.flat:
            return self.flat[name]
        return self.world[name]

    def size(self, name: str) -> int:
        return self[name].size()

    def local(self, name: str) -> int:
        """This rank's coordinate on a (possibly flattened) axis."""
        return self[name].get_local_rank()


def _flatten(world: DeviceMesh, names: Tuple[str, ...], as_name: str) -> DeviceMesh:
    if len(names) == 1:
        return world[names[0]]
    return world[names]._flatten(as_name)


def mesh_key(layout: Layout) -> tuple:
    """What build_mesh's process groups depend on: two layouts with one key get the same groups."""
    return (tuple(mesh_dims(layout)), layout.ep, layout.sp > 1 and layout.dp_shard < layout.dp)


def build_mesh(layout: Layout, device_type: str) -> ParallelMesh:
    dims = mesh_dims(layout)
    world = init_device_mesh(
        device_type, tuple(size for _, size in dims), mesh_dim_names=tuple(name for name, _ in dims)
    )
    order = [name for name, _ in dims]

    def in_mesh_order(*names: str) -> Tuple[str, ...]:
        return tuple(sorted(names, key=order.index))

    flat = {
        "dp": _flatten(world, in_mesh_order("dp_replicate", "dp_shard"), "dp"),
        "dp_sp": _flatten(world, in_mesh_order("dp_replicate", "dp_shard", "sp"), "dp_sp"),
    }
    # Expert parallelism splits the flattened dp x sp index into ep (fastest) x edp, as layout.py does.
    expert = flat["dp_sp"]._unflatten(0, (flat["dp_sp"].size() // layout.ep, layout.ep), ("edp", "ep"))
    flat.update(ep=expert["ep"], edp=expert["edp"], edp_ep=expert)
    if layout.sp > 1 and layout.dp_shard < layout.dp:
        # Hybrid FSDP with sequence parallelism shards over dp_shard x sp (data_parallel.fsdp_mesh).
        flat["dp_shard_sp"] = _flatten(world, in_mesh_order("dp_shard", "sp"), "dp_shard_sp")
    return ParallelMesh(world=world, layout=layout, flat=flat)
