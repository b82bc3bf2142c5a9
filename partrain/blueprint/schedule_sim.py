"""A picture of a pipeline schedule: one row per pipeline rank, one column per time unit.

Pure Python and cheap (no torch at import or call time), so the dry run can draw it.

How the grid is made
--------------------
1. Each rank's *order* of actions is generated the way torch.distributed.pipelining 2.13 builds it
   (a test compares these orders with torch's own `pipeline_order`):
   - gpipe: all forwards F0..F(m-1), then all backwards B0..B(m-1).
   - 1f1b: p - r - 1 warm-up forwards on rank r, then alternate F and B, then the remaining Bs.
   - interleaved-1f1b (Narayanan et al. 2021): microbatches go in rounds of g = m // max(1, m // p);
     the k-th forward runs chunk (k // g) % v, the k-th backward chunk v - 1 - (k // g) % v;
     (v - 1) g + 2 (p - 1 - r) warm-up forwards, then 1F1B, then cool-down backwards.
   - looped-bfs: every microbatch through chunk 0, then chunk 1, ...; backwards in reverse.
   - interleaved-zero-bubble: the interleaved order with 1 instead of 2 warm-up forwards per hop,
     each B split into I (input gradient) and W (weight gradient), W lagging r backwards behind.
   - zbv: the V-shaped ZB schedule (rank r runs chunks r and 2p-1-r) in torch's order.
   - dualpipev: APPROXIMATED by the zbv order. DualPipeV's overlapped forward+backward pairs
     (compute of one microbatch hiding the communication of another) are not modelled.
2. A simulation runs those orders with unit costs: F = 1, B = 2 (or I = 1 and W = 1), no
   communication time, each action starting as soon as its rank is free and its inputs exist
   (F of a chunk needs F of the previous chunk; B/I needs the next chunk's B/I; W needs its I).
   Gaps are bubbles.

With unit costs the simulated bubble of gpipe and 1f1b is exactly (p - 1) / (m + p - 1) of the
step, and that of interleaved-1f1b and looped-bfs exactly (p - 1) / (v m + p - 1) whenever m >= p
(see `formula_bubble`; the tests check both).
Real costs differ (the last stage also runs the head and the loss; backward is not exactly 2x
forward; sends take time), so measured bubbles are somewhat larger.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

from partrain.blueprint.stage_split import (
    ZERO_BUBBLE_SCHEDULES,
    chunk_placement,
    schedule_problems,
    schedule_style,
)

_V_STYLE = ("zbv", "dualpipev")
_ZERO_BUBBLE = ZERO_BUBBLE_SCHEDULES
APPROXIMATE = {"dualpipev": "DualPipeV drawn with the ZBV order; its overlapped F+B pairs are not modelled"}

DURATION = {"F": 1, "B": 2, "I": 1, "W": 1}
"""Time units of each action kind in the simulation."""


@dataclass(frozen=True)
class Action:
    kind: str
    """F (forward), B (full backward), I (backward for inputs), W (backward for weights)."""
    mb: int
    """Microbatch index."""
    stage: int
    """Global chunk (torch stage) index."""


@dataclass(frozen=True)
class Cell:
    """One time unit of one rank that is busy."""

    kind: str
    mb: int
    stage: int
    chunk: int
    """Position of the stage among the rank's chunks (0 .. v-1)."""
    start: bool
    """First time unit of the action (a B spans two cells)."""


@dataclass
class ScheduleGrid:
    schedule: str
    pp: int
    v: int
    n_microbatches: int
    rows: List[List[Optional[Cell]]]
    """rows[rank][t]: the action rank runs in time unit t, None when idle."""
    placement: List[List[int]]
    """Chunks (global stage indices) each rank owns."""
    note: str = ""
    """Set when the picture is an approximation."""
    orders: List[List[Action]] = field(default_factory=list, repr=False)

    @property
    def makespan(self) -> int:
        return max((len(r) for r in self.rows), default=0)

    @property
    def busy_units(self) -> List[int]:
        return [sum(c is not None for c in row) for row in self.rows]

    @property
    def bubble_fraction(self) -> float:
        """Share of the step (pp x makespan rank-time units) that ranks spend idle."""
        total = self.pp * self.makespan
        return 0.0 if total == 0 else 1.0 - sum(self.busy_units) / total

    def to_json(self) -> dict:
        return {
            "schedule": self.schedule, "pp": self.pp, "virtual_stages": self.v, "microbatches": self.n_microbatches,
            "makespan_units": self.makespan, "bubble_fraction": self.bubble_fraction,
            "formula_bubble_fraction": formula_bubble(self.schedule, self.pp, self.v, self.n_microbatches),
            "placement": self.placement, "note": self.note,
            "rows": [" ".join(_label(c, self.v) if c is not None else "." for c in row) for row in self.rows],
        }


def formula_bubble(schedule: str, pp: int, v: int, m: int) -> Optional[float]:
    """Published bubble as a share of the step, or None where there is no closed form.

    GPipe (Huang et al. 2019): (K - 1) / (M + K - 1). 1F1B has the same bubble (it only lowers
    memory). Narayanan et al. 2021 state the bubble relative to the ideal time, (p - 1) / m and
    (p - 1) / (v m) interleaved; as a share of the whole step b / (1 + b) that is
    (p - 1) / (m + p - 1) and (p - 1) / (v m + p - 1). Looped BFS has the interleaved bubble
    too (its fill and drain run chunks of 1/v of the work). Zero-bubble schedules: None.
    """
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if schedule in ("interleaved-1f1b", "looped-bfs"):
        return (pp - 1) / (v * m + pp - 1)
    return None


# ---- per-rank orders ----------------------------------------------------------------------------

def placement(schedule: str, pp: int, v: int) -> List[List[int]]:
    """Chunks (global stage indices) each rank owns under `schedule`."""
    return chunk_placement(pp, v, schedule_style(schedule))


def rank_orders(schedule: str, pp: int, v: int, m: int) -> List[List[Action]]:
    """The order in which each rank runs its actions (see module docstring).

    Raises ValueError for combinations torch rejects (`stage_split.schedule_problems`); some of
    them (interleaved with m not a multiple of the rounds) would deadlock."""
    problems = schedule_problems(schedule, pp, v, m)
    if problems:
        raise ValueError("; ".join(problems))
    out = []
    for r in range(pp):
        if schedule == "gpipe":
            out.append([Action("F", i, r) for i in range(m)] + [Action("B", i, r) for i in range(m)])
        elif schedule == "1f1b":
            out.append(_one_f_one_b(r, pp, m))
        elif schedule == "interleaved-1f1b":
            out.append(_interleaved(r, pp, v, m, zero_bubble=False))
        elif schedule == "interleaved-zero-bubble":
            out.append(_interleaved(r, pp, v, m, zero_bubble=True))
        elif schedule == "looped-bfs":
            stages = [r + k * pp for k in range(v)]
            order = [Action("F", i, s) for s in stages for i in range(m)]
            order += [Action("B", i, s) for s in reversed(stages) for i in reversed(range(m))]
            out.append(order)
        else:  # zbv, dualpipev (approximated)
            out.append(_zbv(r, pp, m))
    return out


def _one_f_one_b(r: int, p: int, m: int) -> List[Action]:
    warmup = min(p - r - 1, m)
    order = [Action("F", i, r) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Action("F", warmup + i, r), Action("B", i, r)]
    order += [Action("B", i, r) for i in range(m - warmup, m)]
    return order


def _interleaved(r: int, p: int, v: int, m: int, zero_bubble: bool) -> List[Action]:
    g = m // max(1, m // p)  # microbatches per round (torch: microbatches_per_round)
    total = m * v
    warmup = min((v - 1) * g + (1 if zero_bubble else 2) * (p - 1 - r), total)
    f_count: Dict[int, int] = {}
    b_count: Dict[int, int] = {}
    w_count: Dict[int, int] = {}
    b_stages: List[int] = []
    order: List[Action] = []
    lag = r  # zero bubble: W trails I by `r` backwards (torch: num_1f1b_microbatches = rank)

    def fwd(k: int) -> None:
        s = ((k // g) % v) * p + r
        order.append(Action("F", f_count.get(s, 0), s))
        f_count[s] = f_count.get(s, 0) + 1

    def bwd(k: int) -> None:
        s = (v - 1 - (k // g) % v) * p + r
        order.append(Action("I" if zero_bubble else "B", b_count.get(s, 0), s))
        b_count[s] = b_count.get(s, 0) + 1
        b_stages.append(s)
        if zero_bubble and k >= lag:
            wgt(b_stages[len(order_w)])

    order_w: List[int] = []

    def wgt(s: int) -> None:
        order.append(Action("W", w_count.get(s, 0), s))
        w_count[s] = w_count.get(s, 0) + 1
        order_w.append(s)

    for op in range(total + warmup):
        if op < warmup:
            fwd(op)
        elif op < total:
            fwd(op)
            bwd(op - warmup)
        else:
            bwd(op - warmup)
    while zero_bubble and len(order_w) < len(b_stages):
        wgt(b_stages[len(order_w)])
    return order


def _zbv(r: int, p: int, m: int) -> List[Action]:
    n = max(2 * p - 1, m)
    s0, s1 = r, 2 * p - 1 - r
    cnt = {"f0": 0, "f1": 0, "b0": 0, "b1": 0}
    order: List[Action] = []

    def add(kind: str, stage: int, key: Optional[str], mb: Optional[int] = None) -> None:
        if mb is None:
            mb = cnt[key]
            cnt[key] += 1
        order.append(Action(kind, mb, stage))

    for _ in range(2 * (p - r) - 1):
        add("F", s0, "f0")
    for _ in range(r):
        add("F", s1, "f1")
        add("F", s0, "f0")
    for _ in range(p - r):
        add("F", s1, "f1")
        add("I", s1, None, cnt["b1"])
        add("W", s1, "b1")
    while cnt["f1"] < cnt["f0"] or cnt["f0"] < n:
        if cnt["f0"] < n:
            add("F", s0, "f0")
        add("I", s0, None, cnt["b0"])
        add("W", s0, "b0")
        add("F", s1, "f1")
        add("I", s1, None, cnt["b1"])
        add("W", s1, "b1")
    w0, w1 = cnt["b0"], cnt["b1"]
    for _ in range(r):
        add("I", s0, "b0")
        add("I", s1, "b1")
    for _ in range(p - r):
        add("I", s0, "b0")
        order.append(Action("W", w0, s0))
        w0 += 1
    while w1 < cnt["b1"]:
        order.append(Action("W", w1, s1))
        w1 += 1
    while w0 < cnt["b0"]:
        order.append(Action("W", w0, s0))
        w0 += 1
    return [a for a in order if a.mb < m]


# ---- simulation ---------------------------------------------------------------------------------

def simulate(orders: Sequence[Sequence[Action]], n_stages: int,
             duration: Optional[Dict[str, int]] = None) -> List[List[Optional[Tuple[Action, bool]]]]:
    """Run per-rank orders with unit costs; rows[rank][t] = (action, first unit) or None."""
    dur = dict(DURATION, **(duration or {}))
    end: Dict[Tuple[str, int, int], int] = {}
    pos = [0] * len(orders)
    free = [0] * len(orders)
    rows: List[List[Optional[Tuple[Action, bool]]]] = [[] for _ in orders]
    remaining = sum(len(o) for o in orders)

    def deps(a: Action) -> List[Tuple[str, int, int]]:
        if a.kind == "F":
            return [("F", a.mb, a.stage - 1)] if a.stage > 0 else []
        if a.kind in ("B", "I"):
            d = [("F", a.mb, a.stage)]
            if a.stage < n_stages - 1:
                d.append(("BI", a.mb, a.stage + 1))
            return d
        if a.kind == "W":
            return [("BI", a.mb, a.stage)]
        raise ValueError(f"unknown action kind {a.kind!r}")

    while remaining:
        progressed = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                a = order[pos[r]]
                ready = 0
                for key in deps(a):
                    if key not in end:
                        break
                    ready = max(ready, end[key])
                else:
                    start = max(free[r], ready)
                    rows[r].extend([None] * (start - len(rows[r])))
                    d = dur[a.kind]
                    rows[r].extend([(a, i == 0) for i in range(d)])
                    free[r] = start + d
                    end[("BI" if a.kind in ("B", "I") else a.kind, a.mb, a.stage)] = start + d
                    pos[r] += 1
                    remaining -= 1
                    progressed = True
                    continue
                break
        if not progressed:
            stuck = {r: str(o[pos[r]]) for r, o in enumerate(orders) if pos[r] < len(o)}
            raise RuntimeError(f"schedule deadlocks in simulation; waiting actions: {stuck}")
    makespan = max(free, default=0)
    for row in rows:
        row.extend([None] * (makespan - len(row)))
    return rows


def schedule_grid(schedule: str, pp: int, v: int, n_microbatches: int,
                  orders: Optional[Sequence[Sequence[Action]]] = None) -> ScheduleGrid:
    """Simulate `schedule` (see module docstring). `orders` overrides the built-in per-rank orders,
    e.g. ones read from torch (`partrain.parallel.pipeline.torch_orders.torch_rank_orders`)."""
    given = orders
    orders = [list(o) for o in orders] if orders is not None else rank_orders(schedule, pp, v, n_microbatches)
    owned = placement(schedule, pp, v)
    chunk_of = {s: k for chunks in owned for k, s in enumerate(chunks)}
    raw = simulate(orders, pp * v)
    rows = [[None if c is None else Cell(c[0].kind, c[0].mb, c[0].stage, chunk_of.get(c[0].stage, 0), c[1]) for c in row]
            for row in raw]
    note = APPROXIMATE.get(schedule, "") if given is None else ""
    return ScheduleGrid(schedule, pp, v, n_microbatches, rows, owned, note, orders)


# ---- rendering ----------------------------------------------------------------------------------

_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
            "#9c755f", "#bab0ac", "#1f77b4", "#8c564b"]
_RICH_COLORS = ["blue", "dark_orange", "green", "red", "cyan", "yellow", "magenta", "pink1", "tan", "grey62",
                "deep_sky_blue1", "orange4"]
_CHUNK_MARK = "abcdefghijklmnopqrstuvwxyz"


def _label(cell: Cell, v: int) -> str:
    return f"{cell.kind}{cell.mb}" + (_CHUNK_MARK[cell.chunk % 26] if v > 1 else "")


def _legend(grid: ScheduleGrid) -> str:
    f = formula_bubble(grid.schedule, grid.pp, grid.v, grid.n_microbatches)
    parts = [f"{grid.schedule}: pp={grid.pp} v={grid.v} microbatches={grid.n_microbatches}",
             f"simulated bubble {grid.bubble_fraction:.1%} of the step"]
    if f is not None:
        parts.append(f"formula {f:.1%}")
    text = ", ".join(parts)
    kinds = "F forward (1 unit), B backward (2 units)" if grid.schedule not in _ZERO_BUBBLE else \
        "F forward, I input-grad backward, W weight-grad backward (1 unit each)"
    text += f"\n{kinds}; digits = microbatch"
    if grid.v > 1:
        text += "; letter = rank's chunk (a = first)"
    text += "; . idle"
    if grid.note:
        text += f"\nnote: {grid.note}"
    return text


def _cells_text(grid: ScheduleGrid, max_slots: Optional[int]) -> Tuple[int, int]:
    width = max((len(_label(c, grid.v)) for row in grid.rows for c in row if c is not None), default=1)
    slots = grid.makespan if max_slots is None else min(grid.makespan, max_slots)
    return width, slots


def render_plain(grid: ScheduleGrid, max_slots: Optional[int] = None) -> str:
    """The grid as plain text, one line per rank ("." idle); a B's second unit shows as "="."""
    width, slots = _cells_text(grid, max_slots)
    lines = []
    for r, row in enumerate(grid.rows):
        cells = []
        for c in row[:slots]:
            if c is None:
                cells.append(".".ljust(width))
            elif c.start:
                cells.append(_label(c, grid.v).ljust(width))
            else:
                cells.append("=".ljust(width))
        more = f" ... (+{grid.makespan - slots})" if slots < grid.makespan else ""
        lines.append(f"rank {r:<3}| " + " ".join(cells) + more)
    return "\n".join(lines + [_legend(grid)])


def render_text(grid: ScheduleGrid, max_slots: Optional[int] = None):
    """The grid as a `rich.text.Text` coloured per microbatch (F light, B/I/W bold); str without rich."""
    try:
        from rich.text import Text
    except ImportError:  # pragma: no cover - rich is a dependency
        return render_plain(grid, max_slots)
    width, slots = _cells_text(grid, max_slots)
    text = Text()
    for r, row in enumerate(grid.rows):
        text.append(f"rank {r:<3}| ", style="bold")
        for i, c in enumerate(row[:slots]):
            if i:
                text.append(" ")
            if c is None:
                text.append(".".ljust(width), style="dim")
                continue
            color = _RICH_COLORS[c.mb % len(_RICH_COLORS)]
            style = color if c.kind == "F" else f"bold {color} reverse" if c.kind in ("B", "I") else f"{color} underline"
            text.append((_label(c, grid.v) if c.start else "=").ljust(width), style=style)
        if slots < grid.makespan:
            text.append(f" ... (+{grid.makespan - slots})", style="dim")
        text.append("\n")
    text.append(_legend(grid), style="italic")
    return text


def to_svg(grid: ScheduleGrid, path: Union[str, Path, None] = None, unit: int = 22, row_height: int = 26) -> str:
    """A standalone SVG of the grid (no external resources); written to `path` when given."""
    left, top = 70, 28
    width = left + grid.makespan * unit + 10
    legend_lines = _legend(grid).split("\n")
    height = top + grid.pp * row_height + 16 + 16 * len(legend_lines)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="10">',
           f'<title>{escape(grid.schedule)} pipeline schedule</title>',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>']
    for t in range(0, grid.makespan + 1, 5):
        x = left + t * unit
        out.append(f'<text x="{x}" y="{top - 10}" fill="#666">{t}</text>')
    for r, row in enumerate(grid.rows):
        y = top + r * row_height
        out.append(f'<text x="4" y="{y + row_height // 2 + 4}" font-size="12">rank {r}</text>')
        out.append(f'<rect x="{left}" y="{y}" width="{grid.makespan * unit}" height="{row_height - 4}" '
                   f'fill="#f3f3f3" stroke="#ddd"/>')
        t = 0
        while t < len(row):
            c = row[t]
            if c is None or not c.start:
                t += 1
                continue
            span = 1
            while t + span < len(row) and row[t + span] is not None and not row[t + span].start \
                    and row[t + span].kind == c.kind and row[t + span].mb == c.mb:
                span += 1
            color = _PALETTE[c.mb % len(_PALETTE)]
            opacity = {"F": 0.45, "B": 1.0, "I": 1.0, "W": 0.75}.get(c.kind, 1.0)
            x = left + t * unit
            out.append(f'<rect x="{x + 1}" y="{y + 1}" width="{span * unit - 2}" height="{row_height - 6}" '
                       f'fill="{color}" fill-opacity="{opacity}" stroke="#333" stroke-width="0.5">'
                       f'<title>{escape(_describe(c))}</title></rect>')
            out.append(f'<text x="{x + span * unit / 2:.1f}" y="{y + row_height // 2 + 2}" text-anchor="middle">'
                       f'{escape(_label(c, grid.v))}</text>')
            t += span
    y = top + grid.pp * row_height + 14
    for line in legend_lines:
        out.append(f'<text x="4" y="{y}" fill="#333">{escape(line)}</text>')
        y += 16
    out.append("</svg>")
    svg = "\n".join(out) + "\n"
    if path is not None:
        Path(path).write_text(svg)
    return svg


def _describe(c: Cell) -> str:
    names = {"F": "forward", "B": "backward", "I": "backward (input grads)", "W": "backward (weight grads)"}
    return f"{names.get(c.kind, c.kind)} of microbatch {c.mb} on stage {c.stage}"
