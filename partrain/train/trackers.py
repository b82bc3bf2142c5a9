"""Experiment trackers rank 0 logs to (`train.loggers`): TensorBoard, Weights & Biases, MLflow.

Every tracker gets the same namespaced scalars (`namespaced`) and the resolved config as
hyperparameters. metrics.jsonl keeps the flat record with full values whatever trackers are chosen.
wandb and mlflow are optional extras; `missing_trackers` lets the launcher refuse a run that asks for
one that is not installed (exit 2, before any process starts).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from partrain.blueprint.config.docs import flat_values

EXTRAS = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}
"""tracker -> (the module it needs, the pip extra of partrain that installs it)."""

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


class TensorBoard:
    def __init__(self, run_dir: Path, run) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        from partrain.blueprint.config.compose import to_yaml

        # TensorBoard's hparams plugin wants one value per key and a run of its own: the YAML as text reads better.
        self.writer.add_text("config", "```\n" + to_yaml(run) + "```", 0)

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


def open_trackers(run_dir: Path, run) -> List[object]:
    """The trackers of train.loggers, started (rank 0 only)."""
    t = run.train
    name = t.tracker_run_name or Path(run_dir).name
    made: Dict[str, Callable[[], object]] = {
        "tensorboard": lambda: TensorBoard(run_dir, run),
        "wandb": lambda: Wandb(run_dir, run, t.tracker_project, name),
        "mlflow": lambda: Mlflow(run, t.mlflow_tracking_uri, t.tracker_project, name),
    }
    return [made[logger]() for logger in t.loggers]


def close_all(trackers: Optional[List[object]]) -> None:
    for tracker in trackers or []:
        tracker.close()
