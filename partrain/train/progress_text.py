"""Plain one-line texts for a run's events: what a log file, a SLURM output or a pipe shows.

The same lines come from the launcher (events read from rank 0, stdout not a terminal) and from rank 0
itself when it runs without partrain's launcher (srun, the user's torchrun). Numbers are rounded for
reading; metrics.jsonl keeps the full values.
"""

from __future__ import annotations

from typing import Optional

from partrain.blueprint.planner.relayout import layout_change_text


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "?"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{1 if unit == 'GiB' else 0}f} {unit}"
    return f"{n:.0f} B"


def human_duration(seconds: Optional[float]) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def step_line(e: dict) -> str:
    parts = [
        f"step {e['step']}/{e.get('total_steps', '?')}",
        f"loss {e['loss']:.4f}",
    ]
    if e.get("rewards/accuracies") is not None:  # dpo / simpo: how often the chosen answer wins, and by how much
        parts.append(f"reward acc {e['rewards/accuracies']:.2f} margin {e['rewards/margins']:.3f}")
    parts += [
        f"lr {e['lr']:.3e}",
        f"grad_norm {e['grad_norm']:.3f}",
        f"{e['tokens_per_s']:,.0f} tok/s",
    ]
    if e.get("memory_bytes") is not None:
        parts.append(f"mem {human_bytes(e['memory_bytes'])}")
    if e.get("skipped"):
        parts.append("skipped (fp16 overflow)")
    parts.append(f"eta {human_duration(e.get('eta_s'))}")
    return " | ".join(parts)


def start_line(e: dict) -> str:
    text = f"training: steps {e.get('first_step', 0) + 1}..{e['steps']}, {e['world_size']} processes, "
    text += f"{e['tokens_per_step']:,} tokens/step"
    if e.get("restart"):
        text = f"restart {e['restart']}: the workers were started again; " + text
    return text


def event_line(e: dict) -> Optional[str]:
    """The line for one event, or None for events that have no line of their own."""
    kind = e.get("event")
    if kind == "step":
        return step_line(e)
    if kind == "start":
        return start_line(e)
    if kind == "eval":
        return f"eval step {e['step']}: loss {e['eval_loss']:.4f}"
    if kind == "checkpoint":
        return f"checkpoint saved: step {e['step']} at {e['path']}"
    if kind == "reference" and e.get("cached"):
        return f"reference log-probs: {e['rows']} rows read from {e['cached']}"
    if kind == "reference":
        return f"reference log-probs: {e['done']:,}/{e['total']:,} rows scored by the starting model"
    if kind == "resumed":
        return f"resumed from {e['path']} at step {e['step']}"
    if kind in ("stopped",):
        return e.get("message")
    return None


def _files_text(paths: list) -> str:
    """A list of per-rank files in a few words: the first path in full, the last one's name."""
    if len(paths) == 1:
        return paths[0]
    return f"{len(paths)} files, {paths[0]} .. {paths[-1].rsplit('/', 1)[-1]}"


def profiling_rows(s: dict) -> list:
    """(label, text) of the summary's profiler traces and memory snapshots, when the run wrote any."""
    rows = []
    profile = s.get("profile")
    if profile and profile.get("traces"):
        first, last = profile["steps"]
        rows.append((f"profiler traces (steps {first}-{last})", _files_text(profile["traces"])))
    if s.get("memory_snapshots"):
        rows.append(("memory snapshots (pytorch.org/memory_viz)", _files_text(s["memory_snapshots"])))
    return rows


def data_rows_text(rows: dict) -> str:
    """The summary's "data_rows": skipped malformed rows per rule, truncated or skipped long examples."""
    parts = []
    if rows.get("skipped_rows"):
        counts = rows["skipped_rows"]
        per_rule = ", ".join(f"{rule} {n}" for rule, n in sorted(counts.items()))
        parts.append(f"{sum(counts.values())} malformed rows skipped ({per_rule})")
    if rows.get("long_examples"):
        long = rows["long_examples"]
        parts.append(f"{long['count']} long examples {'truncated' if long['mode'] == 'truncate' else 'skipped'}")
    return "; ".join(parts)


def packing_text(p: dict) -> str:
    """The summary's "packing": how the examples filled the rows (data.packing) and the padding share."""
    how = "packed into" if p["packed"] else "padded, one per row:"
    cut = f", {p['truncated']} truncated" if p.get("truncated") else ""
    return f"{p['examples']} {how} {p['rows']} rows, {100 * p['padding_share']:.1f}% padding{cut}"


def summary_lines(s: dict) -> list:
    """The run summary as `key: value` lines (the terminal shows a table of the same)."""
    lines = [f"summary: steps {s['steps']}, final train loss {s['final_loss']:.4f}"]
    if s.get("eval_loss") is not None:
        lines[0] += f", final eval loss {s['eval_loss']:.4f}"
    lines[0] += f", {s['tokens_per_s']:,.0f} tokens/s"
    if s.get("skipped_steps"):
        lines.append(f"summary: skipped steps {s['skipped_steps']} (fp16 overflow)")
    for r in s.get("ranks") or []:
        lines.append(
            f"summary: rank {r['rank']} model state {human_bytes(r['model_state_bytes'])}, "
            f"peak RSS {human_bytes(r['peak_rss_bytes'])}"
        )
    for change in s.get("layout_changes") or []:
        lines.append(f"summary: layout change at step {change['step']}: {layout_change_text(change)}")
    if s.get("data_rows"):
        lines.append(f"summary: data rows: {data_rows_text(s['data_rows'])}")
    if s.get("packing"):
        lines.append(f"summary: examples: {packing_text(s['packing'])}")
    lines.extend(f"summary: {label}: {text}" for label, text in profiling_rows(s))
    lines.append(f"summary: run folder {s['run_dir']}")
    if s.get("hf_export"):
        lines.append(f"summary: HF folder {s['hf_export']}")
    lines.extend(kept_lines(s))
    return lines


def kept_lines(s: dict) -> list:
    """What the run kept: its checkpoint and the commands that export it (or that it kept nothing)."""
    if s.get("checkpoint"):
        commands = [f"summary: export: {c}" for c in s.get("export_commands", [])]
        return [f"summary: checkpoint {s['checkpoint']}", *commands]
    return [f"summary: {s['saved_nothing']}"] if s.get("saved_nothing") else []
