"""The pipeline schedule picture: simulated grids, bubble fractions against the published formulas,
torch's own per-rank orders, text and SVG output, and that the dry run can afford it."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from fractions import Fraction

import pytest

from partrain.blueprint.report.schedule import render_plain, render_text, to_svg
from partrain.blueprint.schedule_sim import (
    DURATION,
    Action,
    formula_bubble,
    rank_orders,
    schedule_grid,
    simulate,
)


def _exact_bubble(grid) -> Fraction:
    total = grid.pp * grid.makespan
    return Fraction(total - sum(grid.busy_units), total)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_equals_formula_exactly(schedule):
    for p in range(1, 9):
        for m in range(p if schedule == "1f1b" else 1, 33):
            grid = schedule_grid(schedule, p, 1, m)
            assert _exact_bubble(grid) == Fraction(p - 1, m + p - 1), (p, m)
            assert grid.makespan == 3 * (m + p - 1)  # F = 1, B = 2 units
            assert grid.bubble_fraction == pytest.approx(formula_bubble(schedule, p, 1, m), abs=1e-12)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs"])
def test_interleaved_bubble_equals_narayanan_formula_as_share_of_step(schedule):
    for p in range(2, 7):
        for v in (2, 3, 4):
            for m in range(p, 4 * p + 1):
                try:
                    grid = schedule_grid(schedule, p, v, m)
                except ValueError:  # m not a multiple of torch's rounds
                    continue
                # Narayanan et al.: bubble / ideal = (p-1)/(v m); as a share of the step (p-1)/(v m + p-1)
                assert _exact_bubble(grid) == Fraction(p - 1, v * m + p - 1), (p, v, m)


def test_zero_bubble_schedules_beat_1f1b():
    for p, m in [(2, 4), (4, 8), (4, 16)]:
        one = schedule_grid("1f1b", p, 1, m).bubble_fraction
        for schedule in ("interleaved-zero-bubble", "zbv", "dualpipev"):
            if schedule == "dualpipev" and m < 2 * p:
                continue
            assert schedule_grid(schedule, p, 2, m).bubble_fraction < one / 2, (schedule, p, m)
    assert formula_bubble("zbv", 4, 2, 8) is None
    assert schedule_grid("dualpipev", 2, 2, 4).note  # says it is an approximation


@pytest.mark.parametrize(
    "schedule,p,v,m",
    [
        ("gpipe", 3, 1, 5),
        ("1f1b", 4, 1, 6),
        ("interleaved-1f1b", 2, 2, 4),
        ("looped-bfs", 3, 2, 6),
        ("interleaved-zero-bubble", 4, 2, 8),
        ("zbv", 3, 2, 7),
        ("dualpipev", 2, 2, 4),
    ],
)
def test_grid_shape_and_every_action_once(schedule, p, v, m):
    grid = schedule_grid(schedule, p, v, m)
    assert len(grid.rows) == p and all(len(row) == grid.makespan for row in grid.rows)
    assert grid.busy_units == [3 * m * v] * p  # every microbatch, every chunk: 3 units of work
    starts = Counter((c.kind, c.mb, c.stage) for row in grid.rows for c in row if c is not None and c.start)
    kinds = ("F", "I", "W") if schedule in ("interleaved-zero-bubble", "zbv", "dualpipev") else ("F", "B")
    assert set(starts.values()) == {1}
    assert set(starts) == {(k, mb, s) for k in kinds for mb in range(m) for s in range(p * v)}
    for r, row in enumerate(grid.rows):  # a rank only runs its own chunks
        assert {c.stage for c in row if c is not None} == set(grid.placement[r])
    # dependencies: a chunk's forward starts after the previous chunk's forward ended
    start = {}
    for row in grid.rows:
        for t, c in enumerate(row):
            if c is not None and c.start:
                start[(c.kind, c.mb, c.stage)] = t
    for (kind, mb, stage), t in start.items():
        if kind == "F" and stage > 0:
            assert t >= start[("F", mb, stage - 1)] + DURATION["F"]
    json_rows = grid.to_json()["rows"]
    assert len(json_rows) == p and grid.to_json()["bubble_fraction"] == grid.bubble_fraction


def test_orders_match_torch():
    pytest.importorskip("torch")
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    names = {
        "gpipe": "GPipe",
        "interleaved-1f1b": "Interleaved1F1B",
        "looped-bfs": "LoopedBFS",
        "interleaved-zero-bubble": "InterleavedZeroBubble",
        "zbv": "ZBVZeroBubble",
    }
    checked = 0
    for schedule, name in names.items():
        for p in (2, 3, 4):
            for m in (2, 4, 6, 8):
                v = 1 if schedule == "gpipe" else 2
                try:
                    ops = get_schedule_ops(name, p, m, None if v == 1 else v)
                except ValueError:
                    continue
                theirs = [
                    [
                        (a.computation_type.value, a.microbatch_index, a.stage_index)
                        for a in row
                        if a is not None and a.computation_type.value in "FBIW"
                    ]
                    for row in ops
                ]
                ours = [[(a.kind, a.mb, a.stage) for a in row] for row in rank_orders(schedule, p, v, m)]
                assert ours == theirs, (schedule, p, m)
                checked += 1
    assert checked >= 40


def test_deadlocking_order_is_reported():
    orders = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(orders, 2)
    with pytest.raises(ValueError):
        schedule_grid("1f1b", 4, 1, 2)  # torch needs microbatches >= pp
    with pytest.raises(ValueError):
        schedule_grid("nonsense", 2, 1, 2)


def test_render_text_and_plain():
    grid = schedule_grid("1f1b", 2, 1, 3)
    plain = render_plain(grid)
    lines = plain.splitlines()
    assert lines[0].startswith("rank 0") and lines[1].startswith("rank 1")
    assert "." in lines[1] and "F0" in lines[0] and "B2" in lines[0]
    assert "33.3%" not in plain and "25.0%" in plain  # (p-1)/(m+p-1) = 1/4
    text = render_text(grid)
    assert text.plain.splitlines()[:2] == lines[:2]
    assert len(text.spans) > 0  # coloured
    wide = schedule_grid("gpipe", 2, 1, 40)
    assert "(+" in render_plain(wide, max_slots=20).splitlines()[0]
    inter = render_plain(schedule_grid("interleaved-1f1b", 2, 2, 4))
    assert "F0a" in inter and "F0b" in inter


def test_svg_is_well_formed(tmp_path):
    path = tmp_path / "schedule.svg"
    grid = schedule_grid("interleaved-zero-bubble", 2, 2, 4)
    svg = to_svg(grid, path)
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert svg == path.read_text()
    ns = {"s": "http://www.w3.org/2000/svg"}
    busy_rects = [r for r in root.findall("s:rect", ns) if r.find("s:title", ns) is not None]
    assert len(busy_rects) == 3 * 4 * 2 * 2  # F, I, W x 4 microbatches x 4 chunks
    assert int(root.get("width")) > grid.makespan * 10


def test_no_torch_and_fast_enough_for_the_dry_run():
    """Asserted on the child's CPU time, which other load on the machine does not inflate (its wall time
    was 4.2 s beside the suite's other workers)."""
    code = (
        "import sys, time; t = time.process_time();"
        "from partrain.blueprint.schedule_sim import schedule_grid; from partrain.blueprint.report.schedule import "
        "render_text, to_svg;"
        "g = schedule_grid('interleaved-1f1b', 16, 4, 128); render_text(g); to_svg(g);"
        "g = schedule_grid('zbv', 16, 2, 128); render_text(g);"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "print(time.process_time() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert float(out.stdout.strip()) < 2.0
