"""The schedule grid drawn for people: plain text, rich text for the terminal, and SVG."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Optional, Tuple, Union

from partrain.blueprint.schedule_sim import Cell, ScheduleGrid, cell_label, formula_bubble
from partrain.blueprint.stage_split import ZERO_BUBBLE_SCHEDULES

_PALETTE = [
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
    "#1f77b4",
    "#8c564b",
]
_RICH_COLORS = [
    "blue",
    "dark_orange",
    "green",
    "red",
    "cyan",
    "yellow",
    "magenta",
    "pink1",
    "tan",
    "grey62",
    "deep_sky_blue1",
    "orange4",
]


def _legend(grid: ScheduleGrid) -> str:
    f = formula_bubble(grid.schedule, grid.pp, grid.v, grid.n_microbatches)
    parts = [
        f"{grid.schedule}: pp={grid.pp} v={grid.v} microbatches={grid.n_microbatches}",
        f"simulated bubble {grid.bubble_fraction:.1%} of the step",
    ]
    if f is not None:
        parts.append(f"formula {f:.1%}")
    text = ", ".join(parts)
    kinds = (
        "F forward (1 unit), B backward (2 units)"
        if grid.schedule not in ZERO_BUBBLE_SCHEDULES
        else "F forward, I input-grad backward, W weight-grad backward (1 unit each)"
    )
    text += f"\n{kinds}; digits = microbatch"
    if grid.v > 1:
        text += "; letter = rank's chunk (a = first)"
    text += "; . idle"
    if grid.note:
        text += f"\nnote: {grid.note}"
    return text


def _cells_text(grid: ScheduleGrid, max_slots: Optional[int], line_width: Optional[int] = None) -> Tuple[int, int]:
    """(characters per cell, slots drawn): at most max_slots, and with line_width as many as keep a
    rank's line within it (its "rank N | " prefix and " ... (+N)" tail included), so a terminal
    never wraps one rank over several lines."""
    width = max((len(cell_label(c, grid.v)) for row in grid.rows for c in row if c is not None), default=1)
    slots = grid.makespan if max_slots is None else min(grid.makespan, max_slots)
    if line_width is not None and _line_length(grid, width, slots) > line_width:
        fitting = (line_width - len(f"rank {grid.pp - 1:<3}| ") - len(f" ... (+{grid.makespan})") + 1) // (width + 1)
        slots = max(1, min(slots, fitting))
    return width, slots


def _line_length(grid: ScheduleGrid, width: int, slots: int) -> int:
    tail = len(f" ... (+{grid.makespan - slots})") if slots < grid.makespan else 0
    return len(f"rank {grid.pp - 1:<3}| ") + slots * (width + 1) - 1 + tail


def render_plain(grid: ScheduleGrid, max_slots: Optional[int] = None, line_width: Optional[int] = None) -> str:
    """The grid as plain text, one line per rank ("." idle); a B's second unit shows as "=".
    line_width: the longest a rank's line may be (later slots are cut, "... (+N)")."""
    width, slots = _cells_text(grid, max_slots, line_width)
    lines = []
    for r, row in enumerate(grid.rows):
        cells = []
        for c in row[:slots]:
            if c is None:
                cells.append(".".ljust(width))
            elif c.start:
                cells.append(cell_label(c, grid.v).ljust(width))
            else:
                cells.append("=".ljust(width))
        more = f" ... (+{grid.makespan - slots})" if slots < grid.makespan else ""
        lines.append(f"rank {r:<3}| " + " ".join(cells) + more)
    return "\n".join(lines + [_legend(grid)])


def render_text(grid: ScheduleGrid, max_slots: Optional[int] = None, line_width: Optional[int] = None):
    """The grid as a `rich.text.Text` coloured per microbatch (F light, B/I/W bold); str without rich.
    line_width: the longest a rank's line may be (the console's width; later slots are cut)."""
    try:
        from rich.text import Text
    except ImportError:  # pragma: no cover - rich is a dependency
        return render_plain(grid, max_slots, line_width)
    width, slots = _cells_text(grid, max_slots, line_width)
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
            style = (
                color if c.kind == "F" else f"bold {color} reverse" if c.kind in ("B", "I") else f"{color} underline"
            )
            text.append((cell_label(c, grid.v) if c.start else "=").ljust(width), style=style)
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
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="monospace" font-size="10">',
        f"<title>{escape(grid.schedule)} pipeline schedule</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
    ]
    for t in range(0, grid.makespan + 1, 5):
        x = left + t * unit
        out.append(f'<text x="{x}" y="{top - 10}" fill="#666">{t}</text>')
    for r, row in enumerate(grid.rows):
        y = top + r * row_height
        out.append(f'<text x="4" y="{y + row_height // 2 + 4}" font-size="12">rank {r}</text>')
        out.append(
            f'<rect x="{left}" y="{y}" width="{grid.makespan * unit}" height="{row_height - 4}" '
            f'fill="#f3f3f3" stroke="#ddd"/>'
        )
        t = 0
        while t < len(row):
            c = row[t]
            if c is None or not c.start:
                t += 1
                continue
            span = 1
            while (
                t + span < len(row)
                and row[t + span] is not None
                and not row[t + span].start
                and row[t + span].kind == c.kind
                and row[t + span].mb == c.mb
            ):
                span += 1
            color = _PALETTE[c.mb % len(_PALETTE)]
            opacity = {"F": 0.45, "B": 1.0, "I": 1.0, "W": 0.75}.get(c.kind, 1.0)
            x = left + t * unit
            out.append(
                f'<rect x="{x + 1}" y="{y + 1}" width="{span * unit - 2}" height="{row_height - 6}" '
                f'fill="{color}" fill-opacity="{opacity}" stroke="#333" stroke-width="0.5">'
                f"<title>{escape(_describe(c))}</title></rect>"
            )
            out.append(
                f'<text x="{x + span * unit / 2:.1f}" y="{y + row_height // 2 + 2}" text-anchor="middle">'
                f"{escape(cell_label(c, grid.v))}</text>"
            )
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
