"""The layout report of a dry run / plan: one JSON-able dict, and its rendering with rich.

JSON keys (documented contract, see README):
  valid, recipe, world_size, nodes, devices_per_node, degrees, order, zero_stage, dp_shard,
  model (facts), batch (global_batch_size, micro_batch_size, microbatches, seq_len, tokens_per_step),
  ranks [{rank, node, local_rank, coords}], groups {family: [[ranks]]}, verdict, notes,
  status ("ready" | "does_not_fit" | "unsupported"), ready (bool; with the estimate).
On a bad config: {"valid": false, "errors": [{key, value, rule, fix, message}]}.
"""

from __future__ import annotations

from typing import List

from partrain.blueprint.trainable import unsupported_features
from partrain.blueprint.validate import ValidatedRun
from partrain.errors import ConfigError

MAX_ROWS = 64
"""Rows of the per-rank table shown in the terminal before it is cut (the JSON has all)."""


def layout_report(v: ValidatedRun) -> dict:
    run, layout = v.run, v.layout
    notes = unsupported_features(v)
    report = {
        "valid": True,
        "recipe": run.recipe,
        "model_name": run.model.name or run.model.arch,
        "cluster_name": run.cluster.name,
        "nodes": layout.nodes,
        "devices_per_node": run.cluster.devices_per_node,
        **layout.to_json(),
        "zero_stage": run.parallel.zero_stage,
        "dp_shard": layout.dp_shard,
        "pp_schedule": run.parallel.pp_schedule if layout.pp > 1 else None,
        "pp_virtual_stages": run.parallel.pp_virtual_stages,
        "model": v.facts.to_json(),
        "batch": {
            "global_batch_size": v.global_batch_size,
            "micro_batch_size": run.train.micro_batch_size,
            "microbatches": v.microbatches,
            "seq_len": run.train.seq_len,
            "tokens_per_step": v.tokens_per_step,
        },
        "notes": notes,
        "verdict": _verdict(v, notes),
        # "ready" until the estimate says otherwise (report.estimate.conclude): one verdict in the end.
        "status": "unsupported" if notes else "ready",
    }
    if layout.pp > 1:
        report["pipeline"] = pipeline_summary(v)
    return report


SCHEDULE_PICTURE_LIMIT = 4096
"""Largest pp x virtual stages x microbatches drawn by the dry run (bigger ones report numbers only)."""


def schedule_grid_of(v: ValidatedRun):
    from partrain.blueprint.schedule_sim import schedule_grid

    p = v.run.parallel
    return schedule_grid(p.pp_schedule, v.layout.pp, p.pp_virtual_stages, v.microbatches)


def pipeline_summary(v: ValidatedRun) -> dict:
    """Schedule facts for the report: formula bubble, simulated bubble (unit costs) when cheap to draw."""
    from partrain.blueprint.schedule_sim import formula_bubble

    p = v.run.parallel
    out = {
        "schedule": p.pp_schedule,
        "pp": v.layout.pp,
        "virtual_stages": p.pp_virtual_stages,
        "microbatches": v.microbatches,
        "bubble_fraction_formula": formula_bubble(p.pp_schedule, v.layout.pp, p.pp_virtual_stages, v.microbatches),
    }
    if v.layout.pp * p.pp_virtual_stages * v.microbatches <= SCHEDULE_PICTURE_LIMIT:
        out["bubble_fraction_simulated"] = schedule_grid_of(v).bubble_fraction
    return out


def _verdict(v: ValidatedRun, notes: List[str]) -> str:
    head = f"valid layout: {v.world_size} ranks = " + " x ".join(
        f"{a}{getattr(v.layout, a)}" for a in ("dp", "tp", "pp", "sp")
    )
    if v.layout.ep > 1:
        head += f" (ep{v.layout.ep} inside dp x sp)"
    if notes:
        return head + "; this version cannot train it yet: " + "; ".join(notes)
    return head


def error_report(err: ConfigError) -> dict:
    return {"valid": False, "errors": [p.to_json() for p in err.problems]}


def render_layout(report: dict, console, all_ranks: bool = False, picture=None) -> None:
    from rich.table import Table

    deg = report["degrees"]
    summary = Table(title=f"partrain layout: {report['recipe'] or 'default'}", show_header=False, title_justify="left")
    summary.add_column(style="bold")
    summary.add_column()
    m, b = report["model"], report["batch"]
    summary.add_row(
        "model",
        f"{report['model_name']} ({m['arch']}: {m['n_layers']} layers, hidden {m['hidden']}, heads "
        f"{m['heads']}/{m['kv_heads']} kv, "
        f"ffn {m['ffn']}, vocab {m['vocab']}"
        + (f", {m['n_experts']} experts top-{m['experts_per_token']}" if m["n_experts"] else "")
        + ")",
    )
    summary.add_row(
        "cluster", f"{report['cluster_name']}: {report['nodes']} node(s) x {report['devices_per_node']} devices"
    )
    summary.add_row("world size", str(report["world_size"]))
    summary.add_row(
        "degrees",
        "  ".join(f"{k}={v}" for k, v in deg.items()) + f"   order (fastest first): {', '.join(report['order'])}",
    )
    summary.add_row("data parallel", f"zero_stage={report['zero_stage']}, dp_shard={report['dp_shard']}")
    if report["pp_schedule"]:
        summary.add_row(
            "pipeline",
            f"{report['pp_schedule']}, {report['pp_virtual_stages']} virtual stage(s) per rank, "
            f"{b['microbatches']} microbatches",
        )
    summary.add_row(
        "batch",
        f"global {b['global_batch_size']} = micro {b['micro_batch_size']} x {b['microbatches']} microbatches x dp "
        f"{deg['dp']}; "
        f"seq_len {b['seq_len']}; {b['tokens_per_step']} tokens/step",
    )
    console.print(summary)

    ranks = Table(title="ranks", title_justify="left")
    for col in ("rank", "node", "local", "dp", "tp", "pp", "sp", "ep"):
        ranks.add_column(col, justify="right")
    rows = report["ranks"] if all_ranks else report["ranks"][:MAX_ROWS]
    for r in rows:
        c = r["coords"]
        ranks.add_row(*map(str, (r["rank"], r["node"], r["local_rank"], c["dp"], c["tp"], c["pp"], c["sp"], c["ep"])))
    console.print(ranks)
    if len(rows) < len(report["ranks"]):
        console.print(
            f"[dim]... {len(report['ranks']) - len(rows)} more ranks (--all-ranks or --json shows them)[/dim]"
        )

    groups = Table(title="process groups", title_justify="left")
    groups.add_column("family")
    groups.add_column("groups", justify="right")
    groups.add_column("members")
    for family, members in report["groups"].items():
        shown = members if all_ranks else members[:8]
        text = " ".join(
            "["
            + ",".join(map(str, g if all_ranks else g[:16]))
            + (",..." if len(g) > 16 and not all_ranks else "")
            + "]"
            for g in shown
        )
        if len(shown) < len(members):
            text += f" ... ({len(members) - len(shown)} more)"
        groups.add_row(family, str(len(members)), text)
    console.print(groups)
    if "pipeline" in report:
        pipe = report["pipeline"]
        line = f"pipeline schedule {pipe['schedule']}: formula bubble {pipe['bubble_fraction_formula']:.3f}"
        if "bubble_fraction_simulated" in pipe:
            line += f", simulated {pipe['bubble_fraction_simulated']:.3f} of the step (unit costs F=1, B=2)"
        console.print(line, markup=False)
        if picture is not None:
            console.print(picture)
    style = {"ready": "green", "unsupported": "yellow"}.get(report.get("status", "ready"), "red")
    console.print(f"[bold {style}]verdict:[/bold {style}] {report['verdict']}")


def render_errors(err: ConfigError, console) -> None:
    for p in err.problems:
        console.print(f"[bold red]error:[/bold red] {p.message}", highlight=False, soft_wrap=True)
