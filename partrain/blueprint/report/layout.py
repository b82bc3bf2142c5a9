"""The layout report of a dry run / plan: one JSON-able dict, and its rendering with rich.

JSON keys (documented contract, see docs/planner.md#the-dry-run-plan-json):
  valid, recipe, world_size, nodes, devices_per_node, degrees, order, zero_stage, dp_shard,
  model (facts), batch (global_batch_size, micro_batch_size, microbatches, seq_len, tokens_per_step),
  ranks [{rank, node, local_rank, coords}], groups {family: [[ranks]]}, rank_kinds (see `rank_kinds`),
  pretrained ({folder, config_overrides, tokenizer} with model.pretrained, else null),
  train_steps, train_epochs (the config's train.steps and train.epochs),
  epochs ({epochs, unit, per_epoch, steps_per_epoch, steps}: train.epochs counted in steps from the data,
  in a dry run whose data was read; else null),
  saves ({keys, folder, every_steps, final, hf_export, nothing}: what the run keeps, see
  blueprint.config.saving; `nothing` is the warning of a run that keeps nothing, else null),
  fine_tuning ({data, adapters}: see report.fine_tuning; null for a text run without peft),
  verdict, notes, status ("ready" | "does_not_fit" | "unsupported"), ready (bool; with the estimate),
  unchecked [{check, why}] (what the launch's preflight checks and this report did not: `plan`
  without --check reads no files; a dry run names a Hub dataset or Hub weights not in the local
  cache; empty when all was checked, and only then does the verdict say "ready to launch").
On a bad config: {"valid": false, "errors": [{key, value, rule, fix, message}]}.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from partrain.blueprint.config.saving import saving_line, saving_plan
from partrain.blueprint.report.family_support import family_line, family_support
from partrain.blueprint.report.fine_tuning import fine_tuning_lines, fine_tuning_section
from partrain.blueprint.trainable import unsupported_features
from partrain.blueprint.validate import ValidatedRun
from partrain.errors import ConfigError

MEMBERS_SHOWN = 4
"""Groups listed per family in the terminal's groups table before "... (N more)" (all with --all-ranks)."""


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
        "family": family_support(v),
        "batch": {
            "global_batch_size": v.global_batch_size,
            "micro_batch_size": run.train.micro_batch_size,
            "microbatches": v.microbatches,
            "seq_len": run.train.seq_len,
            "tokens_per_step": v.tokens_per_step,
        },
        "rank_kinds": rank_kinds(v),
        "pretrained": _pretrained(run),
        # peft's adapters here; a dry run adds what its preflight measured of the data (cli.layout_view)
        "fine_tuning": fine_tuning_section(v, None),
        "train_steps": run.train.steps,
        "train_epochs": run.train.epochs,
        "epochs": None,
        "saves": saving_plan(run),
        "notes": notes,
        "verdict": _verdict(v, notes),
        # "ready" until the estimate says otherwise (report.estimate.conclude): one verdict in the end.
        "status": "unsupported" if notes else "ready",
    }
    if layout.pp > 1:
        report["pipeline"] = pipeline_summary(v)
    return report


def rank_kinds(v: ValidatedRun) -> List[dict]:
    """The kinds of rank: one entry per distinct set of model parts a rank holds, with its ranks.

    Grouping rule: a rank's kind is its (pp rank, ep rank). The pipeline rank decides the layers it
    holds (its chunks under an interleaved or V-shaped schedule) and whether it holds the embedding
    (chunk 0) and the head (the last chunk); the ep rank decides its slice of the experts. Ranks of
    one kind differ only in their tp shard, dp replica or ZeRO shard and sp part of the sequence:
    equal pieces of the same tensors, so every per-rank figure of the plan is the same for them.

    Each entry: pp_rank, ep_rank, layers [[first, end) per chunk], embedding, head, experts
    [first, end) (None without experts), count, ranks and nodes (exact, compact: "0-7, 16-23").
    """
    layout, facts = v.layout, v.facts
    p = v.run.parallel
    chunks_of_stage: List[List[Tuple[int, int]]] = [[(0, facts.n_layers)]]
    first_chunk, last_chunk = [True], [True]
    if layout.pp > 1:
        from partrain.blueprint.stage_split import plan_chunks

        plan = plan_chunks(
            facts, layout.pp, p.pp_virtual_stages, p.pp_schedule, v.run.train.seq_len, p.pp_layers_per_stage
        )
        chunks_of_stage = [[(plan["ranges"][c].start, plan["ranges"][c].stop) for c in cs] for cs in plan["placement"]]
        first_chunk = [0 in cs for cs in plan["placement"]]
        last_chunk = [len(plan["ranges"]) - 1 in cs for cs in plan["placement"]]
    members: Dict[Tuple[int, int], List[int]] = {}
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        members.setdefault((c["pp"], c["ep"] if layout.ep > 1 else 0), []).append(rank)
    per_slice = facts.n_experts // layout.ep if facts.n_experts else 0
    kinds = []
    for (pp_rank, ep_rank), ranks in sorted(members.items(), key=lambda kv: kv[1][0]):
        kinds.append(
            {
                "pp_rank": pp_rank,
                "ep_rank": ep_rank,
                "layers": [list(r) for r in chunks_of_stage[pp_rank]],
                "embedding": bool(first_chunk[pp_rank]),
                "head": bool(last_chunk[pp_rank]),
                "experts": [ep_rank * per_slice, (ep_rank + 1) * per_slice] if per_slice else None,
                "count": len(ranks),
                "ranks": compact_ranges(ranks),
                "nodes": compact_ranges(sorted({layout.node_of(r) for r in ranks})),
            }
        )
    return kinds


def compact_ranges(ids: Sequence[int], budget: Optional[int] = None) -> str:
    """Sorted integers as runs: [0..7, 16..23] -> "0-7, 16-23"; five or more runs of one length at
    one stride -> "0-7, 16-23, ..., 64-71" (exact). Past `budget` characters the list is cut and
    ends with "... (+N)", N the integers not shown."""
    runs: List[List[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    parts = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    strides = {runs[k + 1][0] - runs[k][0] for k in range(len(runs) - 1)}
    if len(runs) >= 5 and len(strides) == 1 and len({b - a for a, b in runs}) == 1:
        parts = [parts[0], parts[1], "...", parts[-1]]
    text = ", ".join(parts)
    if budget is None or len(text) <= budget:
        return text
    shown, width, counted = [], 0, 0
    for (a, b), part in zip(runs, parts):
        if width + len(part) + 2 > budget - 12 and shown:
            break
        shown.append(part)
        width += len(part) + 2
        counted += b - a + 1
    return ", ".join(shown) + f", ... (+{len(ids) - counted})"


def _holds(kind: dict, n_experts: int) -> str:
    """What one kind of rank holds, in words: "layers 0-9, 40-49 + embedding; experts 0-3 of 8"."""
    layers = ", ".join(f"{a}" if b - a == 1 else f"{a}-{b - 1}" for a, b in kind["layers"])
    text = f"layer{'s' if sum(b - a for a, b in kind['layers']) > 1 else ''} {layers}"
    text += "".join(f" + {part}" for part in ("embedding", "head") if kind[part])
    if kind["experts"]:
        a, b = kind["experts"]
        text += f"; experts {a}-{b - 1} of {n_experts}" if b - a > 1 else f"; expert {a} of {n_experts}"
    return text


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


def _pretrained(run) -> dict | None:
    """model.pretrained's folder and the model.config keys that override its config.json (with a
    pretrained model the config holds only those: partrain.blueprint.config.pretrained), and the
    tokenizer the run uses; None without a pretrained model."""
    if not run.model.pretrained:
        return None
    return {
        "folder": run.model.pretrained,
        "config_overrides": dict(run.model.config),
        "tokenizer": run.data.tokenizer,
    }


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
    summary.add_row("family", family_line(report["family"]))
    pre = report.get("pretrained")
    if pre:
        over = ", ".join(f"{k}={v}" for k, v in pre["config_overrides"].items())
        tok = "its own" if pre["tokenizer"] == pre["folder"] else pre["tokenizer"]
        summary.add_row(
            "pretrained",
            f"{pre['folder']}: its config.json"
            + (f", overridden here: {over}" if over else ", as it is")
            + f"; tokenizer: {tok}",
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
    for label, text in fine_tuning_lines(report.get("fine_tuning")):
        summary.add_row(label, text)
    summary.add_row("length", _length_line(report))
    if report.get("saves"):
        saves = report["saves"]
        text = saving_line(saves)
        summary.add_row("checkpoints", f"[bold yellow]{text}[/bold yellow]" if saves["nothing"] else text)
    console.print(summary)

    width = console.width
    console.print(_rank_table(report, width) if all_ranks else _kinds_table(report, width))
    console.print(_groups_table(report, width, all_ranks))
    if "pipeline" in report:
        pipe = report["pipeline"]
        formula = pipe["bubble_fraction_formula"]
        # The zero-bubble schedules have no published closed form (schedule_sim.formula_bubble): the simulation says.
        line = f"pipeline schedule {pipe['schedule']}: " + (
            f"formula bubble {formula:.3f}" if formula is not None else "no formula bubble"
        )
        if "bubble_fraction_simulated" in pipe:
            line += f", simulated {pipe['bubble_fraction_simulated']:.3f} of the step (unit costs F=1, B=2)"
        console.print(line, markup=False)
        if picture is not None:
            console.print(picture)
    style = {"ready": "green", "unsupported": "yellow"}.get(report.get("status", "ready"), "red")
    console.print(f"[bold {style}]verdict:[/bold {style}] {report['verdict']}")


def _length_line(report: dict) -> str:
    """The run's length: its steps, or train.epochs and the steps they come to."""
    epochs = report.get("epochs")
    if epochs:
        return (
            f"train.epochs={epochs['epochs']:g}: {epochs['per_epoch']:,} {epochs['unit']} a pass, "
            f"{epochs['steps_per_epoch']:,} steps a pass (global batch {report['batch']['global_batch_size']}), "
            f"{epochs['steps']:,} steps"
        )
    if report.get("train_epochs"):
        return f"train.epochs={report['train_epochs']:g}: steps counted once the data is read (train --dry-run)"
    return f"{report['train_steps']:,} steps"


def _rank_table(report: dict, width: int):
    """Every rank, one row each (--all-ranks)."""
    from rich.table import Table

    ranks = Table(title="ranks", title_justify="left")
    for col in ("rank", "node", "local", "dp", "tp", "pp", "sp", "ep"):
        ranks.add_column(col, justify="right")
    for r in report["ranks"]:
        c = r["coords"]
        ranks.add_row(*map(str, (r["rank"], r["node"], r["local_rank"], c["dp"], c["tp"], c["pp"], c["sp"], c["ep"])))
    return ranks


def _kinds_table(report: dict, width: int):
    """One row per kind of rank (`rank_kinds`): its count, what it holds, its ranks and nodes."""
    from rich.table import Table

    kinds = report["rank_kinds"]
    with_ep = report["degrees"]["ep"] > 1
    rows = []
    for k in kinds:
        head = [str(k["count"]), str(k["pp_rank"])] + ([str(k["ep_rank"])] if with_ep else [])
        rows.append((head, _holds(k, report["model"]["n_experts"]), k["nodes"], k))
    table = Table(
        title=f"ranks: {report['world_size']} in {len(kinds)} kind(s) by what they hold (--all-ranks lists each)",
        title_justify="left",
    )
    for col in ("ranks", "pp", *(("ep",) if with_ep else ()), "holds", "nodes", "rank ids"):
        table.add_column(col, justify="right" if col in ("ranks", "pp", "ep") else "left", overflow="fold")
    # The rank ids take what the other columns leave of the console (3 characters of rule per column).
    used = sum(max(len(cells) for cells in column) for column in zip(*(r[0] + [r[1], r[2]] for r in rows)))
    budget = max(20, width - used - 3 * (len(rows[0][0]) + 3) - 1)
    for head, holds, nodes, k in rows:
        ids = k["ranks"] if len(k["ranks"]) <= budget else _cut(k["ranks"], budget)
        table.add_row(*head, holds, nodes, ids)
    return table


def _cut(text: str, budget: int) -> str:
    """A compact rank list cut at a comma to fit `budget` characters ("..." marks the cut)."""
    room = text.rfind(", ", 0, budget - 5)
    return (text[:room] if room > 0 else text[: budget - 5]) + ", ..."


def _groups_table(report: dict, width: int, all_ranks: bool):
    """Each family's group count and size and its first groups (all with all_ranks); size-1 families
    say so in words: they carry no traffic."""
    from rich.table import Table

    groups = Table(title="process groups", title_justify="left")
    groups.add_column("family")
    groups.add_column("groups", justify="right")
    groups.add_column("size", justify="right")
    groups.add_column("members", overflow="fold")
    budget = max(30, width - 12 - 6 - 4 - 3 * 4 - 1)
    for family, members in report["groups"].items():
        sizes = sorted({len(g) for g in members})
        size = "/".join(map(str, sizes))
        if sizes == [1]:
            groups.add_row(family, str(len(members)), size, "each rank alone (no communication)")
            continue
        if all_ranks:
            text = " ".join("[" + ",".join(map(str, g)) + "]" for g in members)
            groups.add_row(family, str(len(members)), size, text)
            continue
        text, shown = "", 0
        for g in members[:MEMBERS_SHOWN]:
            part = "[" + compact_ranges(g, budget=budget // 2) + "]"
            if shown and len(text) + len(part) + 1 > budget - 14:
                break
            text, shown = (text + " " + part).strip(), shown + 1
        if shown < len(members):
            text += f" ... ({len(members) - shown} more)"
        groups.add_row(family, str(len(members)), size, text)
    return groups


def render_errors(err: ConfigError, console) -> None:
    for p in err.problems:
        console.print(f"[bold red]error:[/bold red] {p.message}", highlight=False, soft_wrap=True)
