"""Checks that need the file system, run by the launcher before any process, lock or folder exists.

`validate` judges the config alone; `check_before_launch` judges it against what is on disk, so a
config error found here is exit 2 with nothing started, instead of a worker failure after the run
folder was made. Every problem found is collected into one ConfigError:

- train.run_dir and checkpoint.dir: folders (not files) that this process can write in (checkpoint.dir
  only when the run saves: resuming from a read-only archive is allowed);
- checkpoint.resume: the checkpoint is complete and of the same model (no tensor is read: the
  load itself verifies the files);
- model.pretrained given as a Hub id (resolved to a snapshot folder by `hub.resolve_hub_ids` when
  the config was composed): its safetensors are fetched into the Hub cache (or found there offline);
- model.pretrained: the safetensors headers parse and every parameter is there with its shape;
- the data: tokenized (or found in the cache) and long enough for one global batch, eval included;
- train.loggers: the trackers' packages are installed.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from partrain.blueprint.validate import ValidatedRun
from partrain.errors import ConfigError, Problem
from partrain.preflight.hub import fetch_weights
from partrain.preflight.paths import file_problems, folder_problems
from partrain.preflight.weights import weight_problems

DEFAULT_RUNS = Path("runs")
"""Where run folders go when train.run_dir is unset (see partrain.launch.default_run_dir)."""

__all__ = ["check_before_launch", "file_problems", "folder_problems", "weight_problems"]


def check_before_launch(v: ValidatedRun) -> None:
    """Raise one ConfigError listing every problem found on disk; creates nothing (a data cache
    entry aside: tokenizing is how the data's length is known, and the launch needs it anyway)."""
    run = v.run
    problems: List[Problem] = []
    run_dir = Path(run.train.run_dir).expanduser() if run.train.run_dir else None
    problems += folder_problems("train.run_dir", run_dir if run_dir is not None else DEFAULT_RUNS)
    if run.checkpoint.dir and run.checkpoint.every_steps > 0:
        problems += folder_problems("checkpoint.dir", run.checkpoint.dir)
    elif run.checkpoint.dir and Path(run.checkpoint.dir).expanduser().is_file():  # resuming from a read-only
        problems.append(  # archive without saving is fine, but a file would silently hold no checkpoint
            Problem("checkpoint.dir", run.checkpoint.dir, "is a file; a folder is expected here", "name a folder")
        )
    ckpt_root = Path(run.checkpoint.dir).expanduser() if run.checkpoint.dir else None
    if ckpt_root is None and run_dir is not None:
        ckpt_root = run_dir / "checkpoints"
    problems += resume_problems(v, ckpt_root)
    fetched = fetch_weights(run)  # a Hub model's safetensors (train only: plan and show need its config alone)
    problems += fetched or weight_problems(run.model)
    problems += data_problems(v)
    problems += tracker_problems(run.train.loggers)
    if problems:
        raise ConfigError(problems)


def tracker_problems(loggers, installed=None) -> List[Problem]:
    """train.loggers: each tracker's package is installed (wandb and mlflow are optional extras)."""
    from partrain.train.trackers import missing_trackers

    return [
        Problem(
            "train.loggers",
            list(loggers),
            f"{name} is not installed",
            f"pip install 'partrain[{extra}]' (or {extra}), or remove {name} from train.loggers",
        )
        for name, extra in missing_trackers(loggers, installed)
    ]


def resume_problems(v: ValidatedRun, root: Optional[Path]) -> List[Problem]:
    """checkpoint.resume: a complete checkpoint (not a .partial, not a folder of them) of this model.

    resume=auto looks at the newest checkpoint whose partrain.json reads, as the load's fallback
    does (a damaged one is skipped there, so it is not an error here unless all are damaged)."""
    from partrain.checkpoint import CorruptCheckpoint, complete_checkpoints, find_resume, run_meta
    from partrain.checkpoint.folders import RECORD_FILE
    from partrain.checkpoint.record import check_model, read_record

    spec = v.run.checkpoint.resume
    try:
        if spec == "none":
            return []
        if spec == "auto":
            candidates = [p for _, p in reversed(complete_checkpoints(root))] if root is not None else []
        else:
            candidates = [find_resume(root or Path("."), spec)]
        damaged: List[Problem] = []
        for path in candidates:
            try:
                record = read_record(path)
            except CorruptCheckpoint as err:
                if spec != "auto":
                    raise
                damaged += err.problems  # the load falls back past it, with a warning
                continue
            check_model(record, run_meta(v), path / RECORD_FILE)
            if spec != "auto":  # a named checkpoint has no fallback: a lost or cut file stops here (sizes only;
                # the SHA-256 is checked when the ranks load it, one read of the checkpoint in all)
                return _missing_or_cut(path, record)
            return []
        return damaged  # every checkpoint damaged: the load would stop too (nothing to resume is not silent)
    except ConfigError as err:
        return list(err.problems)


def _missing_or_cut(path: Path, record: dict) -> List[Problem]:
    from partrain.checkpoint.checksums import mismatch
    from partrain.checkpoint.record import corrupt

    found = ((path / rel, mismatch(path, rel, int(size), None)) for rel, size in record["files"].items())
    return [corrupt(file, why).problems[0] for file, why in found if why]


def data_problems(v: ValidatedRun) -> List[Problem]:
    """Tokenize (or reuse the cache), then check the vocabulary and that one global batch fits.
    data.streaming: the source opens and holds text, and the tokenizer loads (nothing is tokenized
    ahead, so a corpus too short for one batch is found by the workers)."""
    from partrain.data import batch_problems, prepare_tokens

    t = v.run.train
    try:
        if v.run.data.streaming:
            return _vocab_problems(v, _streamed_vocab_size(v))
        packed = prepare_tokens(v.run.data)
    except ConfigError as err:
        return list(err.problems)
    problems = _vocab_problems(v, packed.vocab_size)
    return problems + batch_problems(packed, t.seq_len, v.global_batch_size, with_eval=t.eval_batches > 0)


def _streamed_vocab_size(v: ValidatedRun) -> int:
    from partrain.data.corpus import Corpus
    from partrain.data.tokenizer import load_tokenizer

    next(iter(Corpus.from_config(v.run.data).documents()))  # a source without text raises ConfigError
    return load_tokenizer(v.run.data.tokenizer).vocab_size


def _vocab_problems(v: ValidatedRun, vocab_size: int) -> List[Problem]:
    if vocab_size <= v.facts.vocab:
        return []
    return [
        Problem(
            "model.config.vocab_size",
            v.facts.vocab,
            f"smaller than the tokenizer's vocabulary ({vocab_size})",
            f"set model.config.vocab_size={vocab_size} or more",
        )
    ]
