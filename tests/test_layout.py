"""The rank grid: the brief's worked example (Layout and `partrain plan --json`), and properties over
random degrees and axis orders (hypothesis)."""

from __future__ import annotations

import json
import math
from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partrain.blueprint.config.schema import AXES
from partrain.blueprint.layout import (
    GROUP_FAMILIES,
    Layout,
    divisors,
    factorizations,
    resolve_degrees,
)

WORKED = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "dp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "sp": [[r] for r in range(16)],
    "ep": [[r] for r in range(16)],
}


def test_worked_example_of_the_brief():
    layout = Layout(tp=2, dp=4, pp=2, devices_per_node=8)
    assert layout.world_size == 16
    for family, groups in WORKED.items():
        assert layout.groups(family) == groups, family
    assert layout.base_coords(13) == {"tp": 1, "sp": 0, "dp": 2, "pp": 1}
    assert [layout.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]


@pytest.mark.parametrize(
    "cluster", [["cluster.devices_per_node=16"], ["cluster.nodes=2", "cluster.devices_per_node=8"]], ids=["1x16", "2x8"]
)
def test_worked_example_through_plan_json(run_partrain, cluster):
    ran = run_partrain(
        "plan",
        "recipe=gpt-3d",
        *cluster,
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.dp=4",
        "train.global_batch_size=16",
        "--json",
    )
    assert ran.code == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["world_size"] == 16 and report["degrees"] == {"dp": 4, "tp": 2, "pp": 2, "ep": 1, "sp": 1}
    assert {f: report["groups"][f] for f in WORKED} == WORKED
    nodes = int(cluster[0].split("=")[1]) if len(cluster) == 2 else 1
    assert report["nodes"] == nodes and [r["node"] for r in report["ranks"]] == [r // (16 // nodes) for r in range(16)]
    assert ran.created() == [] and ran.spawned == []


def test_default_order_formula_of_the_brief():
    layout = Layout(tp=2, sp=3, dp=2, pp=2)
    for rank in range(layout.world_size):
        c = layout.base_coords(rank)
        assert rank == c["tp"] + 2 * (c["sp"] + 3 * (c["dp"] + 2 * c["pp"]))


@pytest.mark.parametrize(
    "kwargs",
    [dict(tp=0), dict(dp=2, ep=3), dict(dp=4, dp_shard=3), dict(order=("tp", "dp", "pp")), dict(devices_per_node=0)],
)
def test_layout_refuses_inconsistent_degrees(kwargs):
    with pytest.raises(ValueError):
        Layout(**kwargs)


def test_resolve_and_factorizations():
    assert resolve_degrees({"tp": 2, "sp": 1, "dp": -1, "pp": 2}, 16) == {"tp": 2, "sp": 1, "dp": 4, "pp": 2}
    found = factorizations(12, {}, AXES)
    assert all(math.prod(d.values()) == 12 for d in found)
    expected = [d for d in product(divisors(12), repeat=4) if math.prod(d) == 12]
    assert sorted(tuple(d[a] for a in AXES) for d in found) == sorted(expected)


# --- properties ---------------------------------------------------------------------------------


@st.composite
def layouts(draw):
    tp, dp = draw(st.sampled_from([1, 2, 3, 4, 6])), draw(st.sampled_from([1, 2, 3, 4, 6]))
    sp, pp = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 4]))
    world = tp * sp * dp * pp
    return Layout(
        tp=tp,
        sp=sp,
        dp=dp,
        pp=pp,
        ep=draw(st.sampled_from(divisors(dp * sp))),
        dp_shard=draw(st.sampled_from(divisors(dp))),
        order=tuple(draw(st.permutations(AXES))),
        devices_per_node=draw(st.one_of(st.sampled_from(divisors(world)), st.integers(1, 16))),
    )


def _sizes(layout: Layout) -> dict:
    dp_sp = layout.dp * layout.sp
    return {
        "tp": layout.tp,
        "sp": layout.sp,
        "dp": layout.dp,
        "pp": layout.pp,
        "ep": layout.ep,
        "dp_sp": dp_sp,
        "edp": dp_sp // layout.ep,
        "dp_shard": layout.dp_shard,
        "dp_replicate": layout.dp // layout.dp_shard,
    }


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_every_family_partitions_the_world_into_groups_of_its_degree(layout):
    world = set(range(layout.world_size))
    for family in GROUP_FAMILIES:
        groups = layout.groups(family)
        members = [r for g in groups for r in g]
        assert sorted(members) == sorted(world), f"{family}: every rank exactly once"
        assert {len(g) for g in groups} == {_sizes(layout)[family]}, family
        for g in groups:
            assert g == sorted(g), f"{family}: position in the group follows the rank order"
            assert all(layout.group_of(family, r) == g for r in g)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_members_of_an_axis_group_differ_only_on_that_axis_in_order(layout):
    for axis in AXES:
        for g in layout.groups(axis):
            coords = [layout.base_coords(r) for r in g]
            assert [c[axis] for c in coords] == list(range(getattr(layout, axis)))
            assert all(
                {a: c[a] for a in AXES if a != axis} == {a: coords[0][a] for a in AXES if a != axis} for c in coords
            )


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_coordinates_round_trip_and_place_ranks_on_nodes(layout):
    for rank, row in enumerate(layout.rank_table()):
        c = layout.base_coords(rank)
        assert layout.rank_of(c) == rank
        assert all(0 <= c[a] < getattr(layout, a) for a in AXES)
        assert row["rank"] == rank and row["node"] * layout.devices_per_node + row["local_rank"] == rank
        assert 0 <= row["local_rank"] < layout.devices_per_node and 0 <= row["coords"]["ep"] < layout.ep
    assert layout.nodes == -(-layout.world_size // layout.devices_per_node)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_derived_groups_are_carved_out_of_their_parents(layout):
    def inside(child: str, parent: str) -> bool:
        return all(set(g) <= set(layout.group_of(parent, g[0])) for g in layout.groups(child))

    assert inside("ep", "dp_sp") and inside("edp", "dp_sp") and inside("dp", "dp_sp") and inside("sp", "dp_sp")
    assert inside("dp_shard", "dp") and inside("dp_replicate", "dp")
    for ep_group in layout.groups("ep"):  # an ep group meets each edp group of its dp x sp slice once
        for edp_group in layout.groups("edp"):
            if set(edp_group) <= set(layout.group_of("dp_sp", ep_group[0])):
                assert len(set(ep_group) & set(edp_group)) == 1


@settings(max_examples=150, deadline=None)
@given(layouts(), st.data())
def test_tp_groups_stay_inside_a_node_when_tp_is_fastest(layout, data):
    devices = data.draw(st.sampled_from([layout.tp * k for k in (1, 2, 3)]))
    layout = Layout(
        tp=layout.tp,
        sp=layout.sp,
        dp=layout.dp,
        pp=layout.pp,
        ep=layout.ep,
        dp_shard=layout.dp_shard,
        order=("tp",) + tuple(a for a in layout.order if a != "tp"),
        devices_per_node=devices,
    )
    for g in layout.groups("tp"):
        assert len({layout.node_of(r) for r in g}) == 1
