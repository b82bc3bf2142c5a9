"""How `partrain train` shows a run it launched: a live progress bar on a terminal, one plain line per
event when stdout is a file or a pipe (SLURM output, CI, `| tee`), or nothing but one JSON object on
stdout with `--json` (the human lines then go to stderr).

The CLI decides the mode once (`Display.choose`); the launcher hands every line of rank 0's stdout
to `Display.follow`, which returns the events that decide the outcome.
"""

from __future__ import annotations

import json
import sys
from typing import Iterable, List, Optional

from rich.console import Console

from partrain.blueprint.planner.relayout import layout_change_text
from partrain.train.metrics import parse_event
from partrain.train.progress_text import data_rows_text, event_line, packing_text, profiling_rows, summary_lines

MODES = ("rich", "plain", "json")
OUTCOME_EVENTS = ("start", "summary", "stopped", "refused")


class Display:
    def __init__(self, mode: str, console: Console, out=None) -> None:
        if mode not in MODES:
            raise ValueError(f"display mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.console = console
        """Where human text goes: stdout, or stderr in json mode."""
        self.out = out
        """json mode: the stream the one JSON object is written to (default sys.stdout)."""

    @classmethod
    def choose(cls, as_json: bool, stdout_is_terminal: bool) -> "Display":
        if as_json:
            return cls("json", Console(stderr=True, highlight=False))
        return cls("rich" if stdout_is_terminal else "plain", Console(highlight=False))

    @property
    def plain(self) -> bool:
        return self.mode != "rich"

    def say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def follow(self, lines: Iterable[str], signals: Optional[List[int]] = None) -> dict:
        """Show rank 0's events; pass its other output through. Returns {"start": ..., "summary": ...,
        "stopped": ..., "refused": ...} as seen. signals: the stop signals received so far (said once each)."""
        if self.mode == "rich":
            return _follow_rich(lines, self.console, signals if signals is not None else [])
        seen: dict = {}
        signals = signals if signals is not None else []
        announced = 0
        for line in lines:
            if len(signals) > announced:
                announced = len(signals)
                self.say(stopping_text(signals))
            event = parse_event(line)
            if event is None:
                self.say(line.rstrip("\n"))
                continue
            _note_outcome(seen, event)
            text = event_line(event) if event["event"] != "stopped" else None  # the outcome says it
            if text:
                self.say(text)
        return seen

    def summary(self, summary: dict) -> None:
        if self.plain:
            for line in summary_lines(summary):
                self.say(line)
        else:
            self.console.print(summary_table(summary))

    def result(self, code: int, summary: Optional[dict] = None, message: Optional[str] = None) -> None:
        """json mode: the one JSON object on stdout (the run summary, or why there is none)."""
        if self.mode != "json":
            return
        body = {k: v for k, v in (summary or {}).items() if k != "event"}
        body.update(exit_code=code)
        if message:
            body["message"] = message
        out = self.out or sys.stdout
        out.write(json.dumps(body, default=str) + "\n")
        out.flush()


def _note_outcome(seen: dict, event: dict) -> None:
    """Keep the events that decide the outcome. A second start means torchrun started the workers
    again (a restart, or an elastic run after a node left or joined): the earlier attempt's stop or
    summary no longer decides."""
    kind = event["event"]
    if kind == "start" and "start" in seen:
        seen.pop("stopped", None)
        seen.pop("summary", None)
    if kind in OUTCOME_EVENTS:
        seen[kind] = event


def stopping_text(signals: List[int]) -> str:
    from partrain.runtime.signals import signal_name

    name = signal_name(signals[-1])
    if len(signals) == 1:
        return f"{name}: stopping after the current step (again to stop at once, without saving)"
    return f"{name} again: stopping at once"


def _follow_rich(lines: Iterable[str], console: Console, signals: List[int]) -> dict:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    seen: dict = {}
    announced = 0
    progress = Progress(
        TextColumn("step {task.completed}/{task.total}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
        auto_refresh=False,  # no refresh thread: see partrain.runtime.signals on the parent-death signal
    )
    task = None
    with progress:
        for line in lines:
            if len(signals) > announced:
                announced = len(signals)
                progress.console.print(stopping_text(signals), markup=False, highlight=False)
            event = parse_event(line)
            if event is None:
                progress.console.print(line.rstrip("\n"), highlight=False, markup=False)
                continue
            kind = event["event"]
            _note_outcome(seen, event)
            if kind == "start":
                if event.get("restart"):
                    progress.console.print(event_line(event), markup=False, highlight=False)
                task = progress.add_task(
                    "train", total=event["steps"], completed=event.get("first_step", 0), info="starting"
                )
            elif kind == "step" and task is not None:
                info = f"loss {event['loss']:.4f}  lr {event['lr']:.2e}  {event['tokens_per_s']:,.0f} tok/s"
                progress.update(task, completed=event["step"], info=info, refresh=True)
            elif kind in ("eval", "checkpoint", "resumed", "reference"):
                progress.console.print(event_line(event), markup=False, highlight=False)
    return seen


def summary_table(summary: dict):
    from rich.table import Table

    table = Table(title="run summary", show_header=False, title_justify="left")
    table.add_row("steps", str(summary["steps"]))
    table.add_row("final train loss", f"{summary['final_loss']:.4f}")
    if summary.get("eval_loss") is not None:
        table.add_row("final eval loss", f"{summary['eval_loss']:.4f}")
    table.add_row("throughput", f"{summary['tokens_per_s']:,.0f} tokens/s")
    if summary.get("skipped_steps"):
        table.add_row("skipped steps", f"{summary['skipped_steps']} (fp16 overflow)")
    for r in summary["ranks"]:
        experts = f", expert params {r['expert_param_bytes'] / 2**20:.2f} MiB" if "expert_param_bytes" in r else ""
        table.add_row(
            f"rank {r['rank']} memory",
            f"model state {r['model_state_bytes'] / 2**20:.2f} MiB{experts}, peak RSS "
            f"{r['peak_rss_bytes'] / 2**20:.0f} MiB",
        )
    for change in summary.get("layout_changes") or []:
        table.add_row(f"layout change at step {change['step']}", layout_change_text(change))
    if summary.get("data_rows"):
        table.add_row("data rows", data_rows_text(summary["data_rows"]))
    if summary.get("packing"):
        table.add_row("examples", packing_text(summary["packing"]))
    for label, text in profiling_rows(summary):
        table.add_row(label, text)
    table.add_row("run folder", summary["run_dir"])
    if summary.get("hf_export"):
        table.add_row("HF folder", summary["hf_export"])
    if summary.get("checkpoint"):
        table.add_row("checkpoint", summary["checkpoint"])
        for command in summary.get("export_commands", []):
            table.add_row("export", command)
    elif summary.get("saved_nothing"):
        table.add_row("checkpoint", f"[bold yellow]{summary['saved_nothing']}[/bold yellow]")
    return table
