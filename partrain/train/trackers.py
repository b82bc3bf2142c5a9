"""Experiment trackers rank 0 logs to (`train.loggers`): TensorBoard, Weights & Biases, MLflow.

Every tracker gets the same namespaced scalars (`namespaced`) and the resolved config as
hyperparameters. metrics.jsonl keeps the flat record with full values whatever trackers are chosen.
wandb and mlflow are optional extras; `missing_trackers` lets the launcher refuse a run that asks for
one that is not installed (exit 2, before any process starts).

What the trackers add to rank 0's resident memory (their modules, threads, buffers) is measured apart
(`TrackerMemory`), so the plan check compares the planner's figure with the training's own memory.
"""

from __future__ import annotations

import importlib
import importlib.util
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from partrain.blueprint.config.docs import flat_values

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""tracker -> (the module it needs, the pip extra of partrain that installs it)."""

MODULES = {"tensorboard": "torch.utils.tensorboard", "wandb": "wandb", "mlflow": "mlflow.tracking"}
"""tracker -> the module its class imports first (imported early to measure what it adds)."""

_NAMESPACE = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "skipped": "train/skipped",
    "eval_loss": "eval/loss",
    "tokens_per_s": "perf/tokens_per_s",
    "step_time_s": "perf/step_time_s",
    "memory_bytes": "memory/peak_bytes",
    "measured_memory_bytes": "memory/measured_bytes",
    "plan_memory_bytes": "plan/memory_bytes",
    "memory_measured_over_planned": "plan/memory_measured_over_planned",
    "plan_tokens_per_s": "plan/tokens_per_s",
    "measured_tokens_per_s": "perf/steady_tokens_per_s",
    "tokens_per_s_measured_over_planned": "plan/tokens_per_s_measured_over_planned",
}


def module_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing_trackers(loggers: Sequence[str], installed: Optional[Callable[[str], bool]] = None) -> List[tuple]:
    """(tracker, pip extra) for each requested tracker whose package is not importable."""
    installed = installed or module_installed
    return [(name, EXTRAS[name][1]) for name in loggers if name in EXTRAS and not installed(EXTRAS[name][0])]


def namespaced(record: dict) -> Dict[str, float]:
    """The scalars of a metrics record under tracker names (train/loss, eval/loss, perf/tokens_per_s,
    memory/peak_bytes, moe/..., plan/...); list values (one per expert) become name/0, name/1, ..."""
    out: Dict[str, float] = {}
    for key, value in record.items():
        if key == "step":
            continue
        name = _NAMESPACE.get(key) or (f"moe/{key[4:]}" if key.startswith("moe_") else f"train/{key}")
        if isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, (int, float)):
                    out[f"{name}/{i}"] = item
    return out


def _config_yaml(run_dir: Path, run) -> str:
    """The run folder's config.yaml (the resolved config the workers read), or the config as YAML where a run
    has none: writing it again took 0.2 s of every run's start."""
    saved = run_dir / "config.yaml"
    if saved.is_file():
        return saved.read_text()
    from partrain.blueprint.config.compose import to_yaml

    return to_yaml(run)


class TensorBoard:
    def __init__(self, run_dir: Path, run) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        # TensorBoard's hparams plugin wants one value per key and a run of its own: the YAML as text reads better.
        self.writer.add_text("config", "```\n" + _config_yaml(run_dir, run) + "```", 0)

    def log(self, metrics: Dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        self.writer.close()


class Wandb:
    """wandb's own settings (WANDB_MODE=offline, WANDB_API_KEY, ...) apply as usual; files go to RUN_DIR/wandb."""

    def __init__(self, run_dir: Path, run, project: str, name: str) -> None:
        import wandb

        self.run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            config=flat_values(run),
            settings=wandb.Settings(console="off", quiet=True),
        )

    def log(self, metrics: Dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Mlflow:
    """One MLflow run through an explicit client (no global active run)."""

    def __init__(self, run, uri: str, project: str, name: str) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri or None)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        # MLflow caps a parameter value's length; a long model.config entry is cut, not refused.
        params = [Param(k, str(v)[:500]) for k, v in flat_values(run).items()]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 parameters per call
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, metrics: Dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


@dataclass
class TrackerMemory:
    """The resident memory the trackers add to rank 0's process, in bytes, by phase: the growth of the
    resident set across importing their modules, starting them and every logging call (each phase
    counted from zero up: memory a phase frees is the training's, not the trackers').

    The planner plans the training; a tracker's threads and buffers landing in the same process are not
    part of it, so the plan check subtracts `total` from the measured peak (plan_check.measured_memory).
    Only tracker code runs inside each measured phase, so the growth is the trackers' own."""

    imports: int = 0
    start: int = 0
    logging: int = 0

    @property
    def total(self) -> int:
        return self.imports + self.start + self.logging

    def to_json(self) -> Dict[str, int]:
        return {"imports": self.imports, "start": self.start, "logging": self.logging, "total": self.total}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the resident set's growth across the block to the phase `name`."""
        from partrain.runtime.resident import current_rss_bytes

        before = current_rss_bytes()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + max(0, current_rss_bytes() - before))


def import_tracker_modules(loggers: Sequence[str], memory: Optional[TrackerMemory] = None) -> None:
    """Import the trackers' modules now (a missing one is skipped: the launcher refused it already),
    counting what they add to the resident set in memory.imports."""
    memory = memory or TrackerMemory()
    with memory.phase("imports"):
        for logger in loggers:
            try:
                importlib.import_module(MODULES.get(logger, logger))
            except ImportError:
                pass


class _Measured:
    """A tracker whose logging calls count their resident growth in a TrackerMemory."""

    def __init__(self, tracker, memory: TrackerMemory) -> None:
        self.tracker, self.memory = tracker, memory

    def log(self, metrics: Dict[str, float], step: int) -> None:
        with self.memory.phase("logging"):
            self.tracker.log(metrics, step)

    def close(self) -> None:
        self.tracker.close()


def open_trackers(run_dir: Path, run, memory: Optional[TrackerMemory] = None) -> List[object]:
    """The trackers of train.loggers, started (rank 0 only); with `memory`, what starting them and
    each of their logging calls adds to the resident set is counted there."""
    t = run.train
    name = t.tracker_run_name or Path(run_dir).name
    made: Dict[str, Callable[[], object]] = {
        "tensorboard": lambda: TensorBoard(run_dir, run),
        "wandb": lambda: Wandb(run_dir, run, t.tracker_project, name),
        "mlflow": lambda: Mlflow(run, t.mlflow_tracking_uri, t.tracker_project, name),
    }
    if memory is None:
        return [made[logger]() for logger in t.loggers]
    with memory.phase("start"):
        started = [made[logger]() for logger in t.loggers]
    return [_Measured(tracker, memory) for tracker in started]


def close_all(trackers: Optional[List[object]]) -> None:
    for tracker in trackers or []:
        tracker.close()
