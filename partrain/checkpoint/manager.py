"""A run's checkpoints: when to save, what to resume from, and the parts saved and resumed together.

A checkpoint holds two kinds of state:

- the tensors of `tensors` (anything with `model_parts` and `optimizer`, the training engine): the
  model's parameters (LoRA adapters included: they are parameters of the model) and the optimizer
  state, written by DCP as each rank's shards, plus each rank's RNG state (`rng/rank-R.pt`); see
  partrain.checkpoint.save and .load, which reshard them into any layout;
- the run's parts (`parts`: name -> an object with `state_dict()` and `load_state_dict(state)`):
  the data position ("data"), fp16's loss scale ("loss_scale"), the LR schedule ("lr_schedule"),
  the layout history ("layout"), and whatever a feature adds. Each part's state is JSON, stored
  under its name in the "extra" of partrain.json (from rank 0; every rank restores it). A part
  named in TOP_LEVEL keeps its keys at the top of "extra" instead (the layout history's "layout"
  and "layout_changes", as checkpoints have always stored them) and loads from the whole of it.

The step a checkpoint continues after is extra["data"]["step"]: the data section has carried it since
the first checkpoint format, so the manager writes the trainer's step there. A part a checkpoint
lacks (saved before the part existed) keeps its fresh state, or is brought to the resumed step by
its `load_absent(step)` when it has one (the LR schedule steps forward).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Protocol, Tuple

log = logging.getLogger("partrain")

DATA = "data"
"""The part holding the data position; its section also carries the step (module docstring)."""

LAYOUT = "layout"
"""The layout history's part (partrain.train.relayout.LayoutHistory)."""

TOP_LEVEL = frozenset({LAYOUT})
"""Parts whose state is several top-level keys of "extra" (see the module docstring)."""


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


class ScheduleState:
    """The LR schedule (partrain.train.lr_schedule.LRSchedule) as a part."""

    def __init__(self, schedule) -> None:
        self.schedule = schedule

    def state_dict(self) -> dict:
        return self.schedule.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load(state, 0)

    def load_absent(self, step: int) -> None:
        """A checkpoint saved before schedules were: step the fresh schedule forward to `step`."""
        self.schedule.load(None, step)


class LayoutState:
    """The layout history as a part: saved with every checkpoint; what a resume found in the
    checkpoint is compared by partrain.train.relayout.resume (it needs the folder and the step)."""

    def __init__(self, history) -> None:
        self.history = history

    def state_dict(self) -> dict:
        return self.history.extra()

    def load_state_dict(self, state: dict) -> None:
        """Nothing to set: relayout.resume reads the resumed extra (CheckpointManager.resumed_extra)."""


class CheckpointManager:
    """When to save (checkpoint.every_steps, at a stop, before an HF export) and what to resume from
    (checkpoint.resume); the DCP mechanics live in partrain.checkpoint.save and .load."""

    def __init__(
        self,
        cfg,
        root: Path,
        run_dir: Path,
        tensors,
        parts: Dict[str, Optional[Stateful]],
        meta: Dict[str, Any],
        resume_spec: str,
        ranks_per_node: int = 1,
        events: Optional[Callable[..., None]] = None,
    ) -> None:
        self.cfg = cfg
        """The run's CheckpointConfig (partrain.blueprint.config.schema)."""
        self.root = root
        self.run_dir = run_dir
        self.tensors = tensors
        self.parts: Dict[str, Stateful] = {name: part for name, part in parts.items() if part is not None}
        """Name -> part (module docstring); a None part (fp16's loss scale in an fp32 run) is left out."""
        self.meta = meta
        self.resume_spec = resume_spec
        self.ranks_per_node = ranks_per_node
        """Consecutive global ranks per node (brief section 4): names a node whose checkpoints differ."""
        self.events = events or (lambda *args, **kwargs: None)
        """Rank 0 says each save and resume in the log (the other ranks' Events drop it)."""
        self.last: Tuple[int, Optional[Path]] = (0, None)
        """(step, folder) of the newest checkpoint this run saved or resumed from."""
        self.resumed_extra: dict = {}
        """The "extra" of the checkpoint resumed from ({} for a fresh start)."""

    @classmethod
    def for_run(cls, v, run_dir: Path, tensors, parts, restarted: bool, events=None) -> "CheckpointManager":
        """The manager of a validated run: its folder, meta and resume spec. After torchrun's elastic
        agent restarted the job (restarted), always continue from the newest checkpoint."""
        from partrain.blueprint.config.saving import kept_checkpoint
        from partrain.checkpoint.record import run_meta

        cfg = kept_checkpoint(v.run)
        root = Path(cfg.dir).expanduser() if cfg.dir else run_dir / "checkpoints"
        spec = "auto" if restarted and cfg.resume == "none" else cfg.resume
        return cls(cfg, root, run_dir, tensors, parts, run_meta(v), spec, v.run.cluster.devices_per_node, events)

    @property
    def history(self):
        """The run's LayoutHistory (partrain.train.relayout), saved with every checkpoint; None = not saved."""
        part = self.parts.get(LAYOUT)
        return part.history if isinstance(part, LayoutState) else None

    @history.setter
    def history(self, history) -> None:
        self.parts[LAYOUT] = LayoutState(history)

    # ---- saving --------------------------------------------------------------------------------

    def state_extra(self, step: int) -> dict:
        """Every part's state as partrain.json's "extra", with the step in the data section."""
        extra: dict = {}
        for name, part in self.parts.items():
            if name in TOP_LEVEL:
                extra.update(part.state_dict())
            else:
                extra[name] = part.state_dict()
        extra[DATA] = {**extra.get(DATA, {}), "step": step}
        return extra

    def maybe_save(self, step: int) -> None:
        """The trainer's step end: save every checkpoint.every_steps steps."""
        every = self.cfg.every_steps
        if every and step % every == 0:
            self.save(step)

    def save(self, step: int) -> Path:
        """Save every part at `step` (collective); the folder (being written when async_save)."""
        from partrain.checkpoint.save import save_checkpoint

        path = save_checkpoint(
            self.root,
            step,
            self.tensors.model_parts,
            self.tensors.optimizer,
            self.state_extra(step),
            self.meta,
            self.cfg.keep_last,
            self.cfg.async_save,
        )
        # A sync save returns once every rank sees the committed folder; an async one is still writing.
        log.info("%s checkpoint %s", "saving (in the background)" if self.cfg.async_save else "saved", path)
        self.events("checkpoint", step=step, path=str(path))
        self.last = (step, Path(path))
        return Path(path)

    def saves_at_end(self) -> bool:
        """Whether the run's last step is saved when it ends (checkpoint.save_final, or a stopped run
        with periodic checkpoints, which has always kept its last step)."""
        return bool(self.cfg.save_final or self.cfg.every_steps)

    def save_last(self, step: int) -> Optional[Path]:
        """Save `step` unless it is saved already (collective); the folder holding it, None at step 0."""
        if step == 0:
            return None
        if step == self.last[0] and self.last[1] is not None:
            return self.last[1]
        return self.save(step)

    def save_at_stop(self, step: int) -> Optional[Path]:
        """A run stopped early: save its last step (collective); the folder holding that step (None when
        the run saves nothing at its end, or nothing was ever trained or saved)."""
        if not self.saves_at_end():
            return None
        return self.save_last(step) or self.last[1]

    def export_at_end(self, step: int, saved: Optional[Path]) -> Optional[Path]:
        """checkpoint.export_hf: every rank writes its shard of <run_dir>/hf from the last step's
        checkpoint `saved` (saved for it when the run keeps no final checkpoint; collective). The folder,
        or None when off."""
        from partrain.checkpoint.hf_export import export_hf_collective
        from partrain.checkpoint.save import wait_pending_save

        if not self.cfg.export_hf or step == 0:
            return None
        path = saved or self.save_last(step)
        wait_pending_save()  # an async save must be on disk before it is read back
        out = self.run_dir / "hf"
        export_hf_collective(path, out, self.cfg.export_dtype)
        log.info("exported the step-%d weights as an HF folder: %s", step, out)
        return out

    def at_end(self, step: int, stopped) -> Tuple[Optional[Path], Optional[Path]]:
        """After the loop (collective): (the newest checkpoint the run kept, its last step unless
        checkpoint.save_final=false, None when it kept none; the HF folder of a finished run's export);
        then waits for a background save."""
        if stopped:
            saved = self.save_at_stop(step)
            hf_dir = None
        else:
            final = self.save_last(step) if self.cfg.save_final else None
            hf_dir = self.export_at_end(step, final)
            saved = final or self.last[1]  # without save_final: the newest periodic (or exported) one
        self.finish()
        return saved, hf_dir

    def finish(self) -> None:
        """Before the process group goes: wait for a background save (collective)."""
        from partrain.checkpoint.save import wait_pending_save

        wait_pending_save()

    # ---- resuming ------------------------------------------------------------------------------

    def _find_and_load(self) -> Tuple[Optional[Path], dict]:
        """(folder, extra) of the checkpoint checkpoint.resume names, its tensors loaded; (None, {})."""
        from partrain.checkpoint.folders import find_resume
        from partrain.checkpoint.load import load_checkpoint, load_with_fallback

        parts, optimizer = self.tensors.model_parts, self.tensors.optimizer
        if self.resume_spec == "auto":
            return load_with_fallback(self.root, parts, optimizer, self.meta, self.ranks_per_node)
        path = find_resume(self.root, self.resume_spec)
        return path, (load_checkpoint(path, parts, optimizer, self.meta)["extra"] if path else {})

    def resume(self) -> int:
        """Load the checkpoint to resume from, if any, into the tensors and every part (collective);
        the step to continue after (0 for a fresh start)."""
        if self.resume_spec == "none":
            return 0
        path, extra = self._find_and_load()
        if path is None:
            return 0
        step = int(extra[DATA]["step"])
        for name, part in self.parts.items():
            if name in TOP_LEVEL:
                part.load_state_dict(extra)
            elif name in extra:
                part.load_state_dict(extra[name])
            elif hasattr(part, "load_absent"):
                part.load_absent(step)
        log.info("resumed from %s at step %d", path, step)
        self.events("resumed", step=step, path=str(path))
        self.resumed_extra = extra
        self.last = (step, Path(path))
        return step
