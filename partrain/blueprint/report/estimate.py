"""Terminal rendering of an estimate and of search candidates (rich tables; JSON stays in the report)."""

from __future__ import annotations

from typing import List

from partrain.blueprint.planner.spec import GIB
from partrain.blueprint.report.notes import note_texts, word_notes


def _gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def _bytes(x: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} B"


def verdict_text(est: dict) -> str:
    """One line for the report's verdict: fits or not, in GiB."""
    total, device = est["memory_bytes"]["total"] / GIB, est["device_memory_bytes"] / GIB
    usable = est["assumptions"]["usable_memory_fraction"]
    if est["fits"]:
        return (
            f"fits in memory: {total:.1f} of {device:.1f} GiB on the worst rank; predicted "
            f"{est['step_time_s']:.3g} s/step, "
            f"MFU {est['mfu']:.0%}"
        )
    return f"does not fit: the worst rank needs {total:.1f} GiB, {device * usable:.1f} of {device:.1f} GiB usable"


STATUS_EXIT_CODES = {"ready": 0, "does_not_fit": 3, "unsupported": 3}
"""Exit codes of `plan --check` / `train --dry-run --check` by report status."""


def conclude(report: dict) -> dict:
    """Give the report one verdict from the layout and its estimate: "ready to launch" only when
    `partrain train` can run the layout, it fits, and the launch's preflight checked everything
    (report["unchecked"] empty); else "layout ready", naming each check that was not made and why.
    Sets "status" and "ready" (the layout's: what was not checked is in the verdict and "unchecked"), and
    words the estimate's notes (report/notes.py)."""
    est = word_notes(report["estimate"])
    if report.get("status") == "unsupported":
        report["verdict"] += "; " + verdict_text(est)
    elif not est["fits"]:
        report["status"] = "does_not_fit"
        report["verdict"] += "; " + verdict_text(est)
    else:
        report["status"] = "ready"
        unchecked = report.get("unchecked") or []
        if unchecked:
            report["verdict"] += "; layout ready: " + verdict_text(est)
            report["verdict"] += "".join(f"; {item['check']} not checked: {item['why']}" for item in unchecked)
        else:
            report["verdict"] += "; ready to launch: " + verdict_text(est)
    report["ready"] = report["status"] == "ready"
    return report


def memory_line(est: dict) -> str:
    """The estimate's memory in one phrase (rich markup): "68.5 GiB of 79.6 GiB (95% usable): fits"."""
    style = "green" if est["fits"] else "red"
    verdict = "fits" if est["fits"] else "does NOT fit"
    return (
        f"[bold {style}]memory:[/bold {style}] {est['memory_bytes']['total'] / GIB:.1f} GiB of "
        f"{est['device_memory_bytes'] / GIB:.1f} GiB ({est['assumptions']['usable_memory_fraction']:.0%} usable): "
        f"{verdict}"
    )


def render_estimate(est: dict, console) -> None:
    """Per-rank memory (GiB), FLOPs, communication (GB, 10**9 bytes), bubble, time, verdict."""
    _render_memory(est, console)
    console.print(_step_table(est))
    console.print(memory_line(est))
    for note in note_texts(est)[1:]:
        console.print(f"[dim]note: {note}[/dim]", highlight=False)  # wrapped: the report keeps to the console


def _render_memory(est: dict, console) -> None:
    from rich.table import Table

    mem = Table(title="estimated memory of the worst rank (GiB = 2**30 bytes)", title_justify="left")
    m = est["memory_bytes"]
    # "process" (a CPU worker's own resident memory) only where it is counted.
    terms = ["params", "grads", "optimizer", "activations", "transient"] + (["process"] if m.get("process") else [])
    for col in (*terms, "total", "device"):
        mem.add_column(col, justify="right")
    mem.add_row(*(_gib(m[k]) for k in (*terms, "total")), _gib(est["device_memory_bytes"]))
    console.print(mem)
    stages = est.get("memory_bytes_per_stage") or []
    if len(stages) > 1:
        per = Table(title="memory per pipeline rank (GiB)", title_justify="left")
        process = any(s.get("process") for s in stages)
        for col in (
            "pp rank",
            "layers",
            "in flight",
            "states",
            "activations",
            "transient",
            *(("process",) * process),
            "total",
        ):
            per.add_column(col, justify="right")
        shown = stages if len(stages) <= 16 else stages[:8] + stages[-8:]
        for s in shown:
            per.add_row(
                str(s["pp_rank"]),
                str(s["layers"]),
                str(s["in_flight_microbatches"]),
                _gib(s["params"] + s["grads"] + s["optimizer"]),
                _gib(s["activations"]),
                _gib(s["transient"]),
                *((_gib(s["process"]),) * process),
                _gib(s["total"]),
            )
        console.print(per)


def _count(n: float) -> str:
    """A parameter count in the unit that reads best: 891,648 -> 0.89 M, 7.2e9 -> 7.2 B."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1e6:.2f} M"


def _step_table(est: dict):
    from rich.table import Table

    perf = Table(title="estimated step", show_header=False, title_justify="left")
    perf.add_column(style="bold")
    perf.add_column()
    perf.add_row("parameters", f"{est['params_total']:,} ({_count(est['params_total'])})")
    perf.add_row(
        "FLOPs per step",
        f"{est['flops_per_step']:.3e} model (3 passes), {est['hardware_flops_per_step']:.3e} with recompute",
    )
    comm = est["comm_bytes_per_step"]
    perf.add_row(
        "communication per rank per step", ", ".join(f"{k} {_bytes(v)}" for k, v in comm.items() if v) or "none"
    )
    perf.add_row("links", ", ".join(f"{k}: {v}" for k, v in est["links"].items()))
    moe = est.get("moe")
    if moe:
        cap = (
            "dropless"
            if moe["capacity_factor"] is None
            else f"capacity {moe['capacity_per_expert']} per expert (cf {moe['capacity_factor']:g})"
        )
        perf.add_row(
            "experts",
            f"{moe['experts_per_rank']} of {moe['experts']} per rank (ep {moe['ep']}, edp {moe['edp']}), "
            f"{moe['expert_params_per_rank']:,} expert parameters per rank of {moe['expert_params_total']:,}; "
            f"{cap}; all-to-all {_bytes(moe['all_to_all_bytes_per_microbatch'])} per microbatch",
        )
    source = est.get("bandwidth_source", "nominal")
    perf.add_row(
        "bandwidths",
        "nominal (cluster.intra_node_gbps / inter_node_gbps)"
        if source == "nominal"
        else f"measured bus bandwidths, {source}",
    )
    compute = est.get("compute_source", "nominal")
    perf.add_row(
        "compute",
        "nominal (cluster.peak_tflops x matmul efficiency)" if compute == "nominal" else f"measured rates, {compute}",
    )
    perf.add_row(
        "pipeline bubble",
        f"{est['pipeline_bubble_fraction']:.1%} of the step idle ({est['pipeline_bubble_overhead']:.1%} over ideal)",
    )
    tb = est["time_breakdown_s"]
    perf.add_row("step time", f"{est['step_time_s']:.4g} s = " + ", ".join(f"{k} {v:.3g}" for k, v in tb.items() if v))
    perf.add_row("throughput", f"{est['tokens_per_s']:,.0f} tokens/s, MFU {est['mfu']:.1%}")
    perf.add_row(
        "assumed",
        f"matmul efficiency {est['assumptions']['matmul_efficiency']:.0%}, "
        f"{est['assumptions']['mixed_precision']} states {est['assumptions']['bytes_per_param']}",
    )
    return perf


SEARCH_COLUMNS = ("#", "dp", "tp", "pp", "sched", "zero", "recomp", "mbs", "GiB", "s/step", "MFU", "auto", "why")
"""The --search table's columns; tokens/s, the full "why" and the rest stay in --json."""


def _sched(lay: dict) -> str:
    if lay["pp"] == 1:
        return "-"
    v = lay["pp_virtual_stages"]
    return "1f1b" if lay["pp_schedule"] == "1f1b" and v == 1 else f"{lay['pp_schedule'].split('-')[0][:5]} v{v}"


def _dp_cell(lay: dict) -> str:
    """dp, with the context- and expert-parallel degrees when there are any (they share its ranks)."""
    return str(lay["dp"]) + (f" sp{lay['sp']}" if lay["sp"] > 1 else "") + (f" ep{lay['ep']}" if lay["ep"] > 1 else "")


def render_candidates(candidates: List[dict], console) -> None:
    """The --search table: one row per candidate, narrow enough for 100 columns; "auto" marks the
    candidates within parallel=auto's memory allowance (auto takes the first of them)."""
    from rich import box
    from rich.table import Table

    if not candidates:
        console.print("[bold red]no layout fits this model on this cluster with this global batch[/bold red]")
        return
    info = candidates[0]["search"]
    table = Table(
        title=f"best layouts by predicted step time ({info['fitting']} fitting of {info['evaluated']} evaluated, "
        f"{info['seconds']:.1f} s)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    for col in SEARCH_COLUMNS:
        left = col in ("sched", "recomp", "why")
        table.add_column(col, justify="left" if left else "right", no_wrap=col != "why", overflow="fold")
    for c in candidates:
        lay, est = c["layout"], c["estimate"]
        tp = str(lay["tp"]) + ("+SP" if lay["tp_sequence_parallel"] else "")
        why = c.get("why_short") or c["why"]
        if c["unsupported"]:
            why = "not trainable yet; " + why
        table.add_row(
            str(c["rank"]),
            _dp_cell(lay),
            tp,
            str(lay["pp"]),
            _sched(lay),
            str(lay["zero_stage"]),
            {"selective": "sel"}.get(lay["recompute"], lay["recompute"]),
            str(lay["micro_batch_size"]),
            f"{est['memory_bytes']['total'] / GIB:.1f}",
            f"{est['step_time_s']:.4g}",
            f"{est['mfu']:.0%}",
            "yes" if c.get("auto_ok") else "-",
            why,
        )
    console.print(table)
    allowed = info.get("auto_memory_bytes")
    if allowed is not None:
        device = candidates[0]["estimate"]["device_memory_bytes"]
        firsts = [c["rank"] for c in candidates if c.get("auto_ok")]
        pick = f"#{firsts[0]}" if firsts else "none of these"
        console.print(
            f"auto: within parallel=auto's memory allowance ({allowed / device:.0%} of {device / GIB:.1f} GiB); "
            f"parallel=auto takes the first: {pick}",
            markup=False,
            highlight=False,
        )
    console.print(
        "apply #1: partrain train ... " + " ".join(candidates[0]["overrides"]),
        markup=False,
        highlight=False,
    )
    console.print("details: --explain N (candidate N's full report), --json (every reason)", markup=False)


def render_simulation(sim: dict, console, all_ranks: bool = False) -> None:
    """`plan --simulate`: per simulated rank, what the real wrappers built next to the planner's count,
    then the parameter shapes (layer index folded) of the first rank (of every rank with all_ranks)."""
    from rich.table import Table

    from partrain.blueprint.planner.simulated import SimulatedParam, grouped_params

    table = Table(
        title=f"simulated ranks: real wrappers on meta, fake process group, world {sim['world_size']}, "
        f"{sim['seconds']:.1f} s (GiB, as the runtime holds them)",
        title_justify="left",
    )
    for col in ("rank", "coords", "chunks", "param elements", "params sim / planner", "states sim / planner", "exact"):
        table.add_column(col, justify="left" if col in ("coords", "chunks") else "right")
    for r in sim["ranks"]:
        s, a, c = r["simulated"], r["analytic"], r["coords"]
        coords = " ".join(f"{k}{c[k]}" for k in ("pp", "tp", "sp", "dp") if k in c)
        table.add_row(
            str(r["rank"]),
            coords,
            ",".join(map(str, r["chunks"])),
            f"{s['param_elements']:,}",
            f"{_gib(s['params'])} / {_gib(a['params'])}",
            f"{_gib(s['total'])} / {_gib(a['total'])}",
            "[green]yes[/green]" if r["exact"] else f"[red]no ({s['param_elements'] - a['param_elements']:+,})[/red]",
        )
    console.print(table)
    for r in sim["ranks"] if all_ranks else sim["ranks"][:1]:
        shapes = Table(title=f"rank {r['rank']}: parameters (global -> local shape)", title_justify="left")
        for col in ("parameter", "x", "global shape", "local shape", "placements", "dtype", "local bytes"):
            shapes.add_column(col, justify="right" if col in ("x", "local bytes") else "left")
        for g in grouped_params([SimulatedParam(**p) for p in r["params"]]):
            shapes.add_row(
                g["name"],
                str(g["count"]),
                str(tuple(g["shape"])),
                str(tuple(g["local_shape"])),
                g["placements"],
                g["dtype"],
                _bytes(g["bytes"]),
            )
        console.print(shapes)
    if len(sim["ranks"]) > 1 and not all_ranks:
        console.print("(other ranks' shapes: --all-ranks, or --json)")
    for note in sim.get("notes", []):
        console.print(f"note: {note}")
