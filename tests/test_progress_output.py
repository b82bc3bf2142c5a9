"""Readable output anywhere: plain lines when stdout is not a terminal, one JSON object with --json.

Formatting and the display's choices are checked in-process; one real 2-process `partrain train
--json` run (shared by the tests below it) checks that stdout parses and the log has a line per step.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from partrain.train.display import Display
from partrain.train.metrics import EVENT_PREFIX, Events, LauncherEvents, PlainEvents
from partrain.train.progress_text import human_bytes, human_duration, step_line, summary_lines

STEP = {
    "event": "step",
    "step": 10,
    "total_steps": 100,
    "loss": 4.123456,
    "lr": 0.000123456,
    "grad_norm": 1.23456,
    "tokens_per_s": 12345.678,
    "memory_bytes": 3 * 2**30 + 2**29,
    "eta_s": 3725.4,
}
SUMMARY = {
    "steps": 4,
    "final_loss": 4.69761,
    "eval_loss": 4.65571,
    "tokens_per_s": 4875.2,
    "ranks": [{"rank": 0, "model_state_bytes": 14 * 2**20, "peak_rss_bytes": 458 * 2**20}],
    "run_dir": "runs/x",
}


def test_step_line_rounds_every_figure():
    assert step_line(STEP) == (
        "step 10/100 | loss 4.1235 | lr 1.235e-04 | grad_norm 1.235 | 12,346 tok/s | mem 3.5 GiB | eta 1h02m05s"
    )
    assert human_bytes(512) == "512 B" and human_bytes(3 * 2**20) == "3 MiB" and human_bytes(None) == "?"
    assert [human_duration(s) for s in (0, 59.6, 61, None, float("nan"))] == ["0s", "1m00s", "1m01s", "?", "?"]


def test_plain_events_write_readable_lines_and_launcher_events_json():
    out = io.StringIO()
    plain = PlainEvents(out)
    plain("start", steps=100, first_step=40, world_size=2, tokens_per_step=2048, restart=1)
    plain("step", **{k: v for k, v in STEP.items() if k != "event"})
    plain("eval", step=10, eval_loss=4.5)
    plain("checkpoint", step=10, path="ck/step-10")
    plain("resumed", step=40, path="ck/step-40")
    plain("summary", **SUMMARY)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("restart 1: ") and "steps 41..100, 2 processes, 2,048 tokens/step" in lines[0]
    assert lines[1].startswith("step 10/100 | loss 4.1235")
    assert lines[2:5] == [
        "eval step 10: loss 4.5000",
        "checkpoint saved: step 10 at ck/step-10",
        "resumed from ck/step-40 at step 40",
    ]
    assert lines[5:] == summary_lines(SUMMARY) and "final eval loss 4.6557" in lines[5]
    raw = io.StringIO()
    LauncherEvents(raw)("eval", step=3, eval_loss=1.0)
    assert raw.getvalue() == EVENT_PREFIX + '{"event": "eval", "step": 3, "eval_loss": 1.0}\n'
    Events()("step", step=1)  # other ranks: nothing, no error


def test_display_is_chosen_once_from_json_and_the_terminal():
    assert Display.choose(as_json=False, stdout_is_terminal=True).mode == "rich"
    assert Display.choose(as_json=False, stdout_is_terminal=False).mode == "plain"
    shown = Display.choose(as_json=True, stdout_is_terminal=True)
    assert shown.mode == "json" and shown.console.stderr


def test_plain_display_follows_events_and_passes_other_output_through():
    from rich.console import Console

    text = io.StringIO()
    display = Display("plain", Console(file=text, width=300), out=io.StringIO())
    lines = [
        EVENT_PREFIX
        + json.dumps({"event": "start", "steps": 2, "first_step": 0, "world_size": 1, "tokens_per_step": 8}),
        "a warning from a worker\n",
        EVENT_PREFIX + json.dumps(dict(STEP, step=1, total_steps=2)),
        EVENT_PREFIX + json.dumps({"event": "summary", **SUMMARY}),
    ]
    seen = display.follow(lines)
    assert sorted(seen) == ["start", "summary"]
    shown = text.getvalue().splitlines()
    assert shown[1] == "a warning from a worker" and shown[2].startswith("step 1/2 | loss")
    display.result(0, seen["summary"])
    assert display.out.getvalue() == ""  # only json mode writes the object
    as_json = Display("json", Console(file=io.StringIO()), out=io.StringIO())
    as_json.result(1, None, "training failed: x")
    assert json.loads(as_json.out.getvalue()) == {"exit_code": 1, "message": "training failed: x"}


RUN = ["recipe=gpt-dp", "train.steps=4", "train.log_every=2", "train.eval_every=2", "checkpoint.every_steps=2"]
RUN += ["optim=sgd", "parallel.zero_stage=3", "optim.implementation=foreach", "optim.schedule=wsd"]
RUN += ["optim.warmup_steps=1", "optim.decay_fraction=0.5"]
"""SGD with momentum under FSDP (zero_stage 3), a wsd schedule that changes lr at every step after step 2."""


def _train(folder, *extra, env=None):
    with open(folder / "out.json", "w") as out, open(folder / "log.txt", "w") as err:
        proc = subprocess.run(
            [sys.executable, "-m", "partrain.cli", "train", *RUN, f"train.run_dir={folder / 'run'}", *extra],
            stdout=out,
            stderr=err,
            timeout=400,
            env={**os.environ, "COLUMNS": "80", **(env or {})},
        )
    return proc.returncode, (folder / "out.json").read_text(), (folder / "log.txt").read_text(), folder / "run"


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    """One 2-process run, 4 steps, --json, stdout and stderr to files (not a terminal)."""
    return _train(tmp_path_factory.mktemp("json-run"), "--json")


@pytest.fixture(scope="module")
def resumed_run(json_run, tmp_path_factory):
    """The same run resumed from its step-2 checkpoint in another folder, stdout to a file (plain lines),
    logging to all three trackers: wandb offline, mlflow in a local file store, nothing on the network."""
    step2 = json_run[3] / "checkpoints" / "step-00000002"
    folder = tmp_path_factory.mktemp("resumed-run")
    trackers = ["train.loggers=[tensorboard,wandb,mlflow]", f"train.mlflow_tracking_uri=file:{folder / 'mlruns'}"]
    env = {"WANDB_MODE": "offline", "MLFLOW_ALLOW_FILE_STORE": "true"}  # mlflow 3 keeps file stores opt-in
    env.update({k: str(folder / "wandb-home") for k in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")})
    return _train(folder, f"checkpoint.resume={step2}", *trackers, "train.tracker_run_name=resumed", env=env)


def test_json_stdout_is_one_object_and_the_log_one_line_per_logged_step(json_run):
    code, stdout, log, run_dir = json_run
    assert code == 0, log[-3000:]
    summary = json.loads(stdout)
    assert summary["exit_code"] == 0 and summary["steps"] == 4 and summary["run_dir"] == str(run_dir)
    assert summary == {**json.loads((run_dir / "summary.json").read_text()), "exit_code": 0}
    steps = [line for line in log.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in steps] == ["step 2/4", "step 4/4"], log
    assert all(" | lr " in s and " tok/s | mem " in s and " | eta " in s for s in steps)
    assert "eval step 2: loss " in log and f"checkpoint saved: step 4 at {run_dir / 'checkpoints'}" in log
    assert "@@partrain" not in log and "\x1b[" not in log  # no event JSON, no terminal escapes


def _metrics(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "lr" in r}


def test_a_resumed_run_continues_the_exact_lr_sequence_and_losses(json_run, resumed_run):
    code, stdout, log, run_dir = resumed_run
    assert code == 0, log[-3000:] + stdout[-3000:]
    lines = stdout.splitlines()
    assert lines[1] == f"resumed from {json_run[3] / 'checkpoints' / 'step-00000002'} at step 2", stdout
    assert [ln.split(" |")[0] for ln in lines if ln.startswith("step ")] == ["step 4/4"]
    assert lines[-1].startswith("planned vs measured:") or any(ln.startswith("summary: steps 4") for ln in lines)
    straight, resumed = _metrics(json_run[3]), _metrics(run_dir)
    assert sorted(resumed) == [3, 4]
    assert [straight[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx([0.1, 0.1, 0.055, 0.01])  # wsd: stable, decay
    for step in (3, 4):  # bit-identical: the scheduler state, SGD momentum and data position all resumed
        assert (resumed[step]["lr"], resumed[step]["loss"]) == (straight[step]["lr"], straight[step]["loss"])
    record = json.loads((json_run[3] / "checkpoints" / "step-00000002" / "partrain.json").read_text())
    assert '"lr_schedule"' in json.dumps(record) and '"last_epoch": 3' in json.dumps(record)


def test_trackers_get_namespaced_metrics_and_the_config(resumed_run, monkeypatch):
    code, _, log, run_dir = resumed_run
    assert code == 0, log[-3000:]
    (offline,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = offline.read_bytes()  # wandb's offline record log (protobuf records; no reader ships with wandb)
    for name in (b"train/loss", b"train/lr", b"perf/tokens_per_s", b"memory/peak_bytes", b"optim.name"):
        assert name in data, name
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"file:{run_dir.parent / 'mlruns'}")
    (found,) = client.search_runs([client.get_experiment_by_name("partrain").experiment_id])
    assert found.info.run_name == "resumed" and found.info.status == "FINISHED"
    assert found.data.params["optim.name"] == "sgd" and found.data.params["parallel.zero_stage"] == "3"
    losses = {m.step: m.value for m in client.get_metric_history(found.info.run_id, "train/loss")}
    assert losses == {s: r["loss"] for s, r in _metrics(run_dir).items()}
    assert {"eval/loss", "perf/tokens_per_s", "memory/peak_bytes", "train/lr"} <= set(found.data.metrics)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [s.step for s in events.Scalars("train/loss")] == [3, 4]
    # What the trackers add to rank 0's process (about 130 MiB for these three) is measured apart and
    # subtracted: the memory check speaks of the training only, no false alarm (issue 36).
    summary = json.loads((run_dir / "summary.json").read_text())
    rank0 = next(r for r in summary["ranks"] if r["rank"] == 0)
    assert rank0["tracker_bytes"] > 32 * 2**20, rank0
    assert rank0["measured_memory_bytes"] == rank0["peak_rss_bytes"] - rank0["tracker_bytes"]
    block = summary["planned_vs_measured"]
    assert not [w for w in block["warnings"] if w.startswith("peak memory")], block


def test_namespaced_scalars():
    from partrain.train.trackers import namespaced

    record = {"step": 3, "loss": 2.0, "lr": 0.1, "eval_loss": 1.5, "tokens_per_s": 9.0, "memory_bytes": 7}
    record.update(moe_tokens_per_expert=[4, 5], skipped=False, memory_measured_over_planned=1.1)
    assert namespaced(record) == {
        "train/loss": 2.0,
        "train/lr": 0.1,
        "eval/loss": 1.5,
        "perf/tokens_per_s": 9.0,
        "memory/peak_bytes": 7,
        "moe/tokens_per_expert/0": 4,
        "moe/tokens_per_expert/1": 5,
        "train/skipped": 0.0,
        "plan/memory_measured_over_planned": 1.1,
    }


def test_a_tracker_not_installed_is_refused_before_launch_naming_its_extra(monkeypatch):
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.errors import ConfigError
    from partrain.preflight import check_before_launch
    from partrain.train import trackers

    monkeypatch.setattr(trackers, "module_installed", lambda module: module not in ("wandb", "mlflow"))
    v = validate(compose(["recipe=gpt-dp", "train.loggers=[tensorboard,wandb,mlflow]", "data.max_bytes=100000"]))
    with pytest.raises(ConfigError) as err:
        check_before_launch(v)
    problems = [p for p in err.value.problems if p.key == "train.loggers"]
    assert [p.rule for p in problems] == ["wandb is not installed", "mlflow is not installed"]
    assert "pip install 'partrain[wandb]'" in problems[0].fix and "partrain[mlflow]" in problems[1].fix
    with pytest.raises(ConfigError) as err:
        validate(compose(["recipe=gpt-dp", "train.loggers=[tensorboard,WandB,tensorboard]"]))
    assert [p.fix for p in err.value.problems] == [
        "write wandb instead of WandB",
        "list each tracker once, e.g. train.loggers=[tensorboard,wandb]",
    ]
