"""The pipeline schedule simulator: one row per pipeline rank, one column per time unit.

Pure Python and cheap (no torch at import or call time), so the dry run can draw it
(`partrain.blueprint.report.schedule` renders the grid as text or SVG); the runtime uses its
action orders too.

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
from typing import Dict, List, Optional, Sequence, Tuple

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
            "schedule": self.schedule,
            "pp": self.pp,
            "virtual_stages": self.v,
            "microbatches": self.n_microbatches,
            "makespan_units": self.makespan,
            "bubble_fraction": self.bubble_fraction,
            "formula_bubble_fraction": formula_bubble(self.schedule, self.pp, self.v, self.n_microbatches),
            "placement": self.placement,
            "note": self.note,
            "rows": [" ".join(cell_label(c, self.v) if c is not None else "." for c in row) for row in self.rows],
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


def simulate(
    orders: Sequence[Sequence[Action]], n_stages: int, duration: Optional[Dict[str, int]] = None
) -> List[List[Optional[Tuple[Action, bool]]]]:
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


def schedule_grid(
    schedule: str, pp: int, v: int, n_microbatches: int, orders: Optional[Sequence[Sequence[Action]]] = None
) -> ScheduleGrid:
    """Simulate `schedule` (see module docstring). `orders` overrides the built-in per-rank orders,
    e.g. ones read from torch (`partrain.parallel.pipeline.torch_orders.torch_rank_orders`)."""
    given = orders
    orders = [list(o) for o in orders] if orders is not None else rank_orders(schedule, pp, v, n_microbatches)
    owned = placement(schedule, pp, v)
    chunk_of = {s: k for chunks in owned for k, s in enumerate(chunks)}
    raw = simulate(orders, pp * v)
    rows = [
        [None if c is None else Cell(c[0].kind, c[0].mb, c[0].stage, chunk_of.get(c[0].stage, 0), c[1]) for c in row]
        for row in raw
    ]
    note = APPROXIMATE.get(schedule, "") if given is None else ""
    return ScheduleGrid(schedule, pp, v, n_microbatches, rows, owned, note, orders)


_CHUNK_MARK = "abcdefghijklmnopqrstuvwxyz"


def cell_label(cell: Cell, v: int) -> str:
    return f"{cell.kind}{cell.mb}" + (_CHUNK_MARK[cell.chunk % 26] if v > 1 else "")
