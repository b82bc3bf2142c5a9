"""The expert-load table `partrain train` prints after an MoE run (torch-free: the CLI process).

Reads the "moe" entry of summary.json (written by the worker from expert_parallel.MoERuntime):
routed token copies per layer and expert over the whole run, summed over every rank.
"""

from __future__ import annotations


def expert_load_table(moe: dict):
    """A rich Table: one row per MoE layer, one column per expert, then max/mean."""
    from rich.table import Table

    experts = moe["num_experts"]
    caption = f"token copies routed (top-{moe['top_k']}), all ranks and steps"
    if moe.get("capacity_factor") is not None:
        caption += f"; capacity factor {moe['capacity_factor']}: {100 * moe.get('dropped_share', 0.0):.2f}% dropped"
    table = Table(title="expert load", caption=caption, title_justify="left", caption_justify="left")
    table.add_column("layer")
    for e in range(experts):
        table.add_column(f"e{e}", justify="right")
    table.add_column("max/mean", justify="right")
    for i, (row, imbalance) in enumerate(zip(moe["tokens_per_expert"], moe["imbalance_per_layer"])):
        table.add_row(str(i), *(f"{v:,}" for v in row), f"{imbalance:.2f}")
    return table
