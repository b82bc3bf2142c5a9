"""The checkpoint manager over a dict of parts (partrain.checkpoint.manager), in one process.

The on-disk "extra" must stay what checkpoints have always held ({"data": {..., "step"},
"loss_scale", "lr_schedule", "layout", "layout_changes"}), every part must come back from it, a part
a checkpoint lacks keeps its state or is brought forward by `load_absent`, and the save policy
(every_steps, a stop, resume specs) must be the worker's. Multi-process resumes, resharding and
elastic re-layouts are covered by test_resume.py, test_elastic.py and test_checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from partrain.blueprint.config.schema import CheckpointConfig, OptimConfig
from partrain.checkpoint.manager import DATA, CheckpointManager, ScheduleState
from partrain.train.loss_scale import DynamicLossScale
from partrain.train.lr_schedule import LRSchedule

META = {"model": {"arch": "linear"}}
"""run_meta's model section as check_model reads it: an arch and no HF config to compare."""


class Position:
    """A data position as the loaders keep it (partrain.data.loader.DataPosition's interface)."""

    def __init__(self, seed: int = 0) -> None:
        self.step, self.seed, self.extra_field = 0, seed, []

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.seed, "extra_field": self.extra_field}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.seed, self.extra_field = int(state["step"]), state["seed"], list(state["extra_field"])


class History:
    """The layout history's interface (partrain.train.relayout.LayoutHistory)."""

    def __init__(self, layout: dict) -> None:
        self.current, self.changes = layout, []

    def extra(self) -> dict:
        return {"layout": self.current, "layout_changes": self.changes}


class Engine:
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model_parts = [nn.Linear(4, 3)]
        self.optimizer = torch.optim.AdamW(self.model_parts[0].parameters(), lr=1e-2)

    def step(self) -> None:
        self.model_parts[0](torch.ones(2, 4)).sum().backward()
        self.optimizer.step()


def _manager(root: Path, seed: int, resume: str = "none", every: int = 2, final: bool = True, **parts):
    cfg = CheckpointConfig(every_steps=every, resume=resume, keep_last=0, save_final=final)
    events = []
    engine = Engine(seed)
    schedule = LRSchedule(OptimConfig(lr=1e-2, schedule="cosine", warmup_steps=2), 10)
    loss_scale = DynamicLossScale(scale=1024.0, window=100)
    default = {DATA: Position(seed), "loss_scale": loss_scale, "lr_schedule": ScheduleState(schedule)}
    manager = CheckpointManager(
        cfg, root, root, engine, {**default, **parts}, META, resume, events=lambda *a, **k: events.append((a, k))
    )
    return manager, engine, schedule, events


def test_parts_saved_in_the_checkpoint_format_and_resumed_exactly(tmp_path):
    manager, engine, schedule, events = _manager(tmp_path, seed=1)
    manager.history = History({"dp": 2, "world_size": 2})
    position, loss_scale = manager.parts[DATA], manager.parts["loss_scale"]
    for step in (1, 2, 3):
        engine.step()
        schedule.step()
        position.step += 1
        position.extra_field.append(step)  # state a data feature adds travels with the position
        manager.maybe_save(step)  # every_steps=2: only step 2
    loss_scale.scale = 512.0
    assert manager.last == (2, tmp_path / "step-00000002")
    assert manager.save_at_stop(3) == tmp_path / "step-00000003"
    assert manager.save_at_stop(3) == tmp_path / "step-00000003"  # saved already: not again
    extra = json.loads((manager.last[1] / "partrain.json").read_text())["extra"]
    assert extra[DATA] == {"step": 3, "seed": 1, "extra_field": [1, 2, 3]}
    assert extra["loss_scale"]["scale"] == 512.0 and extra["lr_schedule"] == schedule.state_dict()
    assert extra["layout"] == {"dp": 2, "world_size": 2} and extra["layout_changes"] == []
    assert [a[0] for a, _ in events] == ["checkpoint", "checkpoint"]

    again, fresh, fresh_schedule, events = _manager(tmp_path, seed=1, resume="auto")
    again.history = History({"dp": 1, "world_size": 1})
    assert again.resume() == 3 and again.last == (3, manager.last[1])
    assert again.resumed_extra == extra and events[-1][1]["step"] == 3
    assert again.parts[DATA].state_dict() == extra[DATA] and again.parts["loss_scale"].scale == 512.0
    assert fresh_schedule.lr() == schedule.lr()
    for mine, saved in zip(fresh.model_parts[0].parameters(), engine.model_parts[0].parameters()):
        assert torch.equal(mine, saved)
        assert torch.equal(fresh.optimizer.state[mine]["exp_avg"], engine.optimizer.state[saved]["exp_avg"])


def test_a_part_the_checkpoint_lacks_keeps_its_state_or_is_brought_forward(tmp_path):
    manager, engine, schedule, _ = _manager(tmp_path, seed=1, every=1)
    del manager.parts["lr_schedule"], manager.parts["loss_scale"]  # saved before either existed
    for step in (1, 2):
        engine.step()
        schedule.step()
        manager.parts[DATA].step += 1
        manager.maybe_save(step)
    again, _, fresh_schedule, _ = _manager(tmp_path, seed=1, resume=str(manager.last[1]), newer=Position())
    assert again.resume() == 2
    assert fresh_schedule.lr() == schedule.lr()  # stepped forward to step 2 by load_absent
    assert again.parts["loss_scale"].scale == 1024.0 and again.parts["newer"].step == 0


def test_no_checkpoint_means_a_fresh_start(tmp_path):
    manager, *_ = _manager(tmp_path, seed=1, resume="auto")
    assert manager.resume() == 0 and manager.last == (0, None) and manager.resumed_extra == {}
    off, *_ = _manager(tmp_path, seed=1, every=0, final=False)
    assert off.save_at_stop(5) is None and off.at_end(5, stopped=15) == (None, None)
    assert off.at_end(5, stopped=None) == (None, None)


def test_the_last_step_is_kept_by_default_once(tmp_path):
    """checkpoint.save_final: a finished or stopped run saves its last step, unless every_steps just did."""
    final, engine, _, events = _manager(tmp_path / "a", seed=1, every=0)
    engine.step()
    saved, hf_dir = final.at_end(3, stopped=None)
    assert saved == tmp_path / "a" / "step-00000003" and (saved / "partrain.json").is_file() and hf_dir is None
    stopped, engine, _, _ = _manager(tmp_path / "b", seed=1, every=0)
    assert stopped.at_end(4, stopped=15)[0] == tmp_path / "b" / "step-00000004"
    periodic, engine, _, events = _manager(tmp_path / "c", seed=1, every=2)
    periodic.maybe_save(2)
    assert periodic.at_end(2, stopped=None)[0] == tmp_path / "c" / "step-00000002"
    assert [k["step"] for a, k in events if a[0] == "checkpoint"] == [2]  # saved once
    nothing, *_ = _manager(tmp_path / "d", seed=1, every=0)
    assert nothing.at_end(0, stopped=None) == (None, None)  # no step trained: nothing to keep
