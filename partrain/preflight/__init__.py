"""Checks that need the file system, run before any process, lock or folder exists.

`validate` judges the config alone; `check_before_launch` judges it against what is on disk, so a
config error found here is exit 2 with nothing started, instead of a worker failure after the run
folder was made. `partrain train` runs it before its launch, and `train --dry-run` and
`plan --check` run the same function with `dry_run=True`: the same checks and the same messages,
except that a dry run creates nothing (no data cache entry, no Hub download) and what it cannot
settle offline is returned as "unchecked" instead of fetched. Every problem found is collected
into one ConfigError:

- every path key (train.run_dir, checkpoint.dir, data.cache_dir, model.pretrained, data.source, ...):
  within the file system's NAME_MAX and PATH_MAX, checked first and alone by validation
  (partrain.blueprint.config.path_limits);
- train.run_dir and checkpoint.dir: folders (not files) that this process can write in (checkpoint.dir
  only when the run saves: resuming from a read-only archive is allowed);
- checkpoint.resume: the checkpoint is complete and of the same model (no tensor is read: the
  load itself verifies the files);
- model.pretrained given as a Hub id (resolved to a snapshot folder by `hub.resolve_hub_ids` when
  the config was composed): its safetensors are fetched into the Hub cache (or found there offline);
- model.pretrained: the safetensors headers parse and every parameter is there with its shape;
- the data: tokenized (or found in the cache) and long enough for one global batch, eval included;
  the tokenizer's vocabulary fits model.config.vocab_size;
- train.loggers: the trackers' packages are installed.

The dry run's data check (`partrain.data.probe_tokens`) reuses a valid cache entry, else reads and
tokenizes the source in memory only until one global batch (and the eval split's batch) is certain,
with the readers and tokenizer the launch uses: a bad field, type, file or tokenizer fails with the
launch's own message. Not checked by a dry run, and named in its verdict instead: a data.source
given as a Hub dataset id that is not in the local Hub cache, and a Hub model's weights that are
not there yet (the launch downloads both).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from partrain.blueprint.config.path_limits import DEFAULT_RUNS
from partrain.blueprint.config.saving import saving_keys
from partrain.blueprint.validate import ValidatedRun
from partrain.errors import ConfigError, Problem
from partrain.preflight.float8 import float8_problems
from partrain.preflight.hub import fetch_weights, hub_id, snapshot_of
from partrain.preflight.paths import file_problems, folder_problems
from partrain.preflight.weights import weight_problems

__all__ = ["Unchecked", "check_before_launch", "file_problems", "folder_problems", "weight_problems"]


DATA_NOT_CACHED = "not a local path, and no Hub dataset of that id is in the local Hub cache"
WEIGHTS_NOT_CACHED = "the model's safetensors weights are not in the local Hub cache yet"


@dataclass(frozen=True)
class Unchecked:
    """A check a dry run could not make offline, and why (the report's "unchecked" entries)."""

    check: str
    """What was not checked: data, weights."""
    why: str
    """Why, and who checks it instead (the launch, which downloads what is missing)."""

    def to_json(self) -> dict:
        return {"check": self.check, "why": self.why}


def check_before_launch(v: ValidatedRun, dry_run: bool = False, facts: Optional[dict] = None) -> List[Unchecked]:
    """Raise one ConfigError listing every problem found on disk. The launch (dry_run False) writes
    only the data cache entry (tokenizing is how the data's length is known, and the launch needs it
    anyway) and the Hub cache (a Hub model's weights); a dry run writes nothing at all and returns
    what it could not check offline (empty when everything was checked). facts: filled with what the
    report shows of the data ("fine_tuning": partrain.preflight.fine_tuning.data_facts, for example rows)."""
    run = v.run
    # Path lengths were checked by validate (blueprint.config.path_limits): every path here can be looked up.
    problems: List[Problem] = []
    unchecked: List[Unchecked] = []
    run_dir = Path(run.train.run_dir).expanduser() if run.train.run_dir else None
    problems += folder_problems("train.run_dir", run_dir if run_dir is not None else DEFAULT_RUNS)
    if run.checkpoint.dir and saving_keys(run.checkpoint):
        problems += folder_problems("checkpoint.dir", run.checkpoint.dir)
    elif run.checkpoint.dir and Path(run.checkpoint.dir).expanduser().is_file():  # resuming from a read-only
        problems.append(  # archive without saving is fine, but a file would silently hold no checkpoint
            Problem("checkpoint.dir", run.checkpoint.dir, "is a file; a folder is expected here", "name a folder")
        )
    ckpt_root = Path(run.checkpoint.dir).expanduser() if run.checkpoint.dir else None
    if ckpt_root is None and run_dir is not None:
        ckpt_root = run_dir / "checkpoints"
    resumed: dict = {}  # the checkpoint a resume would load: its data position is checked with the data
    problems += resume_problems(v, ckpt_root, resumed)
    problems += init_from_problems(v)
    if dry_run and _weights_not_cached(run.model.pretrained):
        unchecked.append(_not_cached("weights", "model.pretrained", run.model.pretrained, WEIGHTS_NOT_CACHED))
    else:
        # A Hub model's safetensors are fetched by the launch only (plan and show need its config alone).
        fetched = [] if dry_run else fetch_weights(run)
        problems += fetched or weight_problems(run.model)
    if dry_run and hub_id(run.data.source) is not None:  # left unresolved by compose_run(fetch_data=False)
        unchecked.append(_not_cached("data", "data.source", run.data.source, DATA_NOT_CACHED))
        problems += tokenizer_problems(v)
    else:
        problems += data_problems(v, dry_run, facts, resumed.get("record"))
    problems += tracker_problems(run.train.loggers)
    problems += float8_problems(run)
    if problems:
        raise ConfigError(problems)
    return unchecked


def _not_cached(check: str, key: str, value: str, what: str) -> Unchecked:
    return Unchecked(check, f"{key}={value}: {what} (train fetches it from the Hub)")


def _weights_not_cached(pretrained: Optional[str]) -> bool:
    """A Hub model whose snapshot lacks the safetensors the launch fetches (compose fetched its config
    files only); a local folder is always checked."""
    from partrain.preflight.weights import INDEX_FILE, SINGLE_FILE

    snap = snapshot_of(pretrained)
    if snap is None or snap["repo_type"] != "model":
        return False
    folder = Path(pretrained).expanduser()
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return False  # a damaged index: weight_problems names it
        return not all((folder / name).is_file() for name in files)
    return not (folder / SINGLE_FILE).is_file()


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


def init_from_problems(v: ValidatedRun) -> List[Problem]:
    """checkpoint.init_from: a complete checkpoint of this model (partrain.checkpoint.init_from)."""
    if not v.run.checkpoint.init_from:
        return []
    from partrain.checkpoint.init_from import init_from_problems as problems_on_disk

    return problems_on_disk(v)


def resume_problems(v: ValidatedRun, root: Optional[Path], chosen: Optional[dict] = None) -> List[Problem]:
    """checkpoint.resume: a complete checkpoint (not a .partial, not a folder of them) of this model;
    chosen["record"]: the record of the checkpoint the load would take (when one is found).

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
            if chosen is not None:
                chosen["record"] = record
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


def data_problems(
    v: ValidatedRun, dry_run: bool = False, facts: Optional[dict] = None, resume_record: Optional[dict] = None
) -> List[Problem]:
    """Tokenize (or reuse the cache), then check the vocabulary and that one global batch fits.
    resume_record: the record of the checkpoint to resume; fine-tuning rows are checked against its
    data position by the workers' own check (same template, train_on, packing...), so a resume on other
    data settings is exit 2 here rather than a failure in every worker.
    dry_run: count the tokens in memory only as far as that verdict needs (partrain.data.probe_tokens),
    writing no cache entry. data.streaming: the source opens and holds text, and the tokenizer loads
    (nothing is tokenized ahead, so a corpus too short for one batch is found by the workers)."""
    from partrain.data import batch_problems, prepare_tokens, probe_tokens
    from partrain.data.corpus import cut_note
    from partrain.data.examples import prepare_examples, probe_examples, uses_examples

    t = v.run.train
    with_eval = t.eval_batches > 0
    if note := cut_note(v.run.data):  # a capped read of the user's files: said, not silent
        print(f"note: {note}", file=sys.stderr, flush=True)
        if facts is not None:
            facts["data_cut"] = note
    try:
        if problem := _objective_problem(v):  # data.format=auto: the first row names the format now
            return [problem]
        if v.run.data.streaming:
            from partrain.preflight.fine_tuning import stream_vocab

            streamed = stream_vocab(v, facts)  # fine-tuning rows: the first batches rendered; None for text
            return _vocab_problems(v, streamed if streamed is not None else _streamed_vocab_size(v))
        if uses_examples(v.run.data):  # fine-tuning rows: every row rendered, in memory for a dry run
            # Imported here: the example batches build torch tensors, and text runs stay torch-free.
            from partrain.data.example_packing import example_batch_problems
            from partrain.data.long_examples import long_example_problems, row_note

            examples = probe_examples(v.run.data) if dry_run else prepare_examples(v.run.data)
            if facts is not None:  # the dry run's report: format, template, masked share of the first batches
                from partrain.preflight.fine_tuning import data_facts

                facts["fine_tuning"] = data_facts(v, examples)
            problems = _vocab_problems(v, examples.vocab_size) + long_example_problems(v.run.data, examples, t.seq_len)
            if resume_record is not None:
                problems += _reference_table_problems(v, examples.meta_path)
            if note := row_note(v.run.data, examples, t.seq_len):  # skipped rows, cut examples: said, not silent
                print(f"note: {note}", file=sys.stderr, flush=True)
            long_examples, packing = v.run.data.long_examples, v.run.data.packing
            problems += example_batch_problems(
                examples, t.seq_len, v.global_batch_size, with_eval, long_examples, packing
            )
            if t.epochs > 0 and not problems:
                from partrain.data.example_packing import example_epoch_counts

                counts = example_epoch_counts(examples, t.seq_len, v.global_batch_size, long_examples, packing)
                problems += epoch_problems(v, counts, facts)
            saved = ((resume_record or {}).get("extra") or {}).get("data")
            if saved and not problems:
                from partrain.data.example_packing import resume_position_problems

                problems += resume_position_problems(
                    examples, saved, t.seq_len, v.global_batch_size, t.seed, long_examples, packing
                )
            return problems
        if dry_run:
            # The same rule decides when enough has been read and what the launch would refuse; epochs
            # need the whole count.
            def enough(counted) -> bool:
                return t.epochs <= 0 and not batch_problems(counted, t.seq_len, v.global_batch_size, with_eval)

            packed = probe_tokens(v.run.data, enough)
        else:
            packed = prepare_tokens(v.run.data)
    except ConfigError as err:
        return list(err.problems)
    problems = _vocab_problems(v, packed.vocab_size)
    problems += batch_problems(packed, t.seq_len, v.global_batch_size, with_eval=with_eval)
    if t.epochs > 0 and not problems:
        from partrain.data.batch_check import text_epoch_counts

        problems += epoch_problems(v, text_epoch_counts(packed, t.seq_len, v.global_batch_size), facts)
    return problems


def _reference_table_problems(v: ValidatedRun, meta_path: Path) -> List[Problem]:
    """A resumed dpo run whose reference is the table (train.preference_reference): the table its first
    launch wrote must still be there, since trained weights cannot give the starting model's numbers back."""
    from partrain.blueprint.validate_objective import reference_kind

    if reference_kind(v.run.train, v.run.peft.method) != "table":
        return []
    from partrain.train.reference_logps import table_is_readable, table_paths

    if table_is_readable(v, meta_path):
        return []
    array_path, _ = table_paths(v, meta_path)
    copy = (
        " or train.preference_reference=copy (the starting model rebuilt beside the policy)" if v.layout.pp == 1 else ""
    )
    return [
        Problem(
            "train.preference_reference",
            v.run.train.preference_reference,
            f"the resumed run's reference log-probabilities ({array_path}) are gone or damaged, and trained weights "
            "cannot give the starting model's back",
            f"restore the file, start a new run (another train.run_dir){copy if v.layout.pp == 1 else ''}",
        )
    ]


def _objective_problem(v: ValidatedRun) -> Optional[Problem]:
    """train.objective against the format data.format=auto resolves to (validate checked the named ones)."""
    from partrain.blueprint.validate_objective import objective_format_problem
    from partrain.data.examples import resolve_format

    if v.run.data.format != "auto":
        return None
    problem = objective_format_problem(resolve_format(v.run.data), v.run.train.objective)
    return Problem(*problem) if problem else None


def epoch_problems(v: ValidatedRun, counts: Optional[tuple], facts: Optional[dict]) -> List[Problem]:
    """train.epochs: the steps it comes to (facts["epochs"] for the dry run's report), and the problems
    of the run at that length (a warmup or profiler window longer than the run), before any process."""
    from partrain.blueprint.epochs import with_epochs_as_steps
    from partrain.blueprint.validate import validate

    if counts is None:  # the batches would not open: their own problem is reported
        return []
    unit, per_epoch, steps_per_epoch = counts
    resolved = with_epochs_as_steps(v, steps_per_epoch)
    if facts is not None:
        facts["epochs"] = {
            "epochs": v.run.train.epochs,
            "unit": unit,
            "per_epoch": per_epoch,
            "steps_per_epoch": steps_per_epoch,
            "steps": resolved.run.train.steps,
        }
    try:
        validate(resolved.run)
    except ConfigError as err:
        note = f" (train.epochs={v.run.train.epochs} comes to train.steps={resolved.run.train.steps})"
        return [dataclasses.replace(p, rule=p.rule + note) for p in err.problems]
    return []


def tokenizer_problems(v: ValidatedRun) -> List[Problem]:
    """The tokenizer loads and its vocabulary fits the model (for a dry run whose data is not checked)."""
    from partrain.data.tokenizer import load_tokenizer

    try:
        return _vocab_problems(v, load_tokenizer(v.run.data.tokenizer).vocab_size)
    except ConfigError as err:
        return list(err.problems)


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
