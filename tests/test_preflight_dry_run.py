"""One preflight (issue 36 item 1): `train --dry-run`, `--dry-run --check` and `plan --check` run the
launch's own checks (partrain.preflight.check_before_launch), so a run `train` would refuse before
starting a process is refused by the dry run too, with the same problems and exit 2, and a run the
dry run accepts gets past train's preflight to its first process start.

Each case is a pair: the dry run, then `train` itself, both in-process through the real CLI and
launcher with every process start refused and recorded (as in test_faults_config.py). The dry run
must create nothing (not even the data cache); train may fill the cache, so the dry run goes first.
"""

from __future__ import annotations

import json
import struct
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest
from conftest import refuse_process_starts

BASE = ["cluster.devices_per_node=1", "train.seq_len=32", "train.eval_every=0"]
"""One process, a global batch of 8 windows of 33 tokens: 257 tokens per split."""
GOOD_DOCS = [f"document {i}: the cat sat on the mat, and the dog ran to the park. {i % 13}" for i in range(300)]
"""About 22k byte tokens: one global batch in the train split and in the 2% eval split."""


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    spawned: List[str]
    created: List[str]
    """Files and folders that appeared in the run's working folder and HOME."""

    def errors(self) -> List[dict]:
        """The problems of a `--json` run that exited 2: [{key, value, rule, fix, message}]."""
        assert self.code == 2, (self.code, self.stdout, self.stderr)
        return json.loads(self.stdout)["errors"]


@pytest.fixture
def partrain(tmp_path, monkeypatch):
    """The real CLI and launcher in-process, each call in a fresh empty folder with an empty HOME."""
    from typer.testing import CliRunner

    from partrain.cli import app

    spawned, _ = refuse_process_starts(monkeypatch)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "PARTRAIN_RECIPES"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", "250")
    calls = iter(range(1000))

    def run(*args: str) -> Ran:
        base = tmp_path / f"call-{next(calls)}"
        cwd, home = base / "cwd", base / "home"
        cwd.mkdir(parents=True)
        home.mkdir()
        monkeypatch.chdir(cwd)
        monkeypatch.setenv("HOME", str(home))
        before = len(spawned)
        result = CliRunner().invoke(app, list(args), catch_exceptions=True)
        stderr = result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            stderr += "".join(traceback.format_exception(result.exception))
        created = sorted(str(p) for d in (cwd, home) for p in d.rglob("*"))
        return Ran(result.exit_code, result.stdout, stderr, spawned[before:], created)

    return run


def _pair(partrain, cache: Path, *overrides: str):
    """(dry run, train) of the same overrides, sharing one data cache folder."""
    args = [*BASE, f"data.cache_dir={cache}", *overrides]
    dry = partrain("train", *args, "--dry-run", "--json")
    assert dry.created == [] and dry.spawned == [], (dry.created, dry.spawned)
    assert not cache.exists(), "the dry run wrote the data cache"
    return dry, partrain("train", *args, "--json")


def _same_refusal(dry: Ran, real: Ran) -> List[dict]:
    """Both exit 2 with the same problems, before any process start."""
    assert real.spawned == [], real.spawned
    assert dry.errors() == real.errors()
    return dry.errors()


def _jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _parquet(path: Path, columns: dict) -> Path:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def _no_text_field(d: Path):
    return [f"data.source={_jsonl(d / 'a.jsonl', [{'body': t, 'id': 1} for t in GOOD_DOCS])}"], "fields: ['body', 'id']"


def _list_valued(d: Path):
    return [f"data.source={_jsonl(d / 'a.jsonl', [{'text': [t, t]} for t in GOOD_DOCS])}"], "is a list, not a string"


def _parquet_other_column(d: Path):
    path = _parquet(d / "a.parquet", {"content": GOOD_DOCS})
    return [f"data.source={path}"], "no column 'text' (columns: ['content'])"


def _all_null(d: Path):
    pa = pytest.importorskip("pyarrow")
    path = _parquet(d / "a.parquet", {"text": pa.array([None] * 50, type=pa.string())})
    return [f"data.source={path}"], "holds no text"


def _empty_folder(d: Path):
    (d / "empty").mkdir()
    return [f"data.source={d / 'empty'}"], "the folder holds no"


def _too_small(d: Path):
    path = _jsonl(d / "a.jsonl", [{"text": "tiny"}] * 20)
    return [f"data.source={path}", "train.eval_batches=0"], "fewer than one batch"


def _too_little_eval(d: Path):
    # 22k tokens: plenty to train on, but 2% of them is 440 tokens, and 16 windows of 33 need 513.
    path = _jsonl(d / "a.jsonl", [{"text": t} for t in GOOD_DOCS])
    return [f"data.source={path}", "train.global_batch_size=16"], "eval.bin holds"


def _bad_line_first(d: Path):
    (d / "a.jsonl").write_text("{not json\n" + "".join(json.dumps({"text": t}) + "\n" for t in GOOD_DOCS))
    return [f"data.source={d / 'a.jsonl'}"], "line 1 is not valid JSON"


def _datasets_other_column(d: Path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"content": GOOD_DOCS[:20]}).save_to_disk(str(d / "saved"))
    return [f"data.source={d / 'saved'}"], "the dataset has no column 'text'"


def _tokenizer_larger_than_vocab(d: Path):
    _word_tokenizer(d / "tok")  # about 40 words and 2 special tokens
    return [f"data.tokenizer={d / 'tok'}", "model.config.vocab_size=16"], "smaller than the tokenizer's vocabulary"


def _weights_of_another_shape(d: Path):
    folder = d / "pretrained"
    folder.mkdir()
    config = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 256}
    (folder / "config.json").write_text(json.dumps(config))
    header = {"transformer.wte.weight": {"dtype": "F32", "shape": [256, 32], "data_offsets": [0, 256 * 32 * 4]}}
    _safetensors(folder / "model.safetensors", header, 256 * 32 * 4)
    return [f"model.pretrained={folder}"], "has shape (256, 32) in the weight files"


def _resume_missing(d: Path):
    return [f"checkpoint.resume={d / 'runs' / 'step-00000010'}"], "checkpoint.resume"


def _run_dir_is_a_file(d: Path):
    (d / "taken").write_text("a file")
    return [f"train.run_dir={d / 'taken'}"], "is a file; a folder is expected here"


def _tracker_missing(d: Path):
    return ["train.loggers=[wandb]"], "wandb is not installed"  # made missing by the test


REFUSED: dict = {
    "jsonl without the text field": _no_text_field,
    "list-valued field": _list_valued,
    "parquet with another column": _parquet_other_column,
    "all-null rows": _all_null,
    "empty folder": _empty_folder,
    "too small for one global batch": _too_small,
    "too little eval data": _too_little_eval,
    "a line that is not JSON": _bad_line_first,
    "datasets folder with another column": _datasets_other_column,
    "tokenizer larger than the model's vocabulary": _tokenizer_larger_than_vocab,
    "pretrained weights of another shape": _weights_of_another_shape,
    "checkpoint to resume is missing": _resume_missing,
    "run folder is a file": _run_dir_is_a_file,
    "tracker not installed": _tracker_missing,
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_the_dry_run_refuses_what_train_refuses(case, partrain, tmp_path, monkeypatch):
    import partrain.train.trackers as trackers

    # Whether or not wandb is installed here: the preflight asks missing_trackers.
    monkeypatch.setattr(
        trackers, "missing_trackers", lambda loggers, installed=None: [("wandb", "wandb")][: "wandb" in loggers]
    )
    data = tmp_path / "data"
    data.mkdir()
    overrides, words = REFUSED[case](data)
    dry, real = _pair(partrain, tmp_path / "cache", *overrides)
    problems = _same_refusal(dry, real)
    assert any(words in p["message"] for p in problems), problems


def test_check_and_plan_check_refuse_with_the_same_problems(partrain, tmp_path):
    overrides, _ = _no_text_field(tmp_path)
    args = [*BASE, *overrides, "--json"]
    expected = partrain("train", *args).errors()
    assert partrain("train", *args, "--dry-run", "--check").errors() == expected
    assert partrain("plan", *args, "--check").errors() == expected
    # Without --json: one message per problem on stderr, nothing printed as ready.
    ran = partrain("train", *BASE, *overrides, "--dry-run")
    assert ran.code == 2 and "fields: ['body', 'id']" in " ".join(ran.stderr.split()) and "ready" not in ran.stdout


ACCEPTED: dict = {
    "jsonl": lambda d: [f"data.source={_jsonl(d / 'a.jsonl', [{'text': t, 'id': 3} for t in GOOD_DOCS])}"],
    "parquet with nulls among the rows": lambda d: [
        f"data.source={_parquet(d / 'a.parquet', {'text': [t if i % 5 else None for i, t in enumerate(GOOD_DOCS)]})}"
    ],
    "txt folder": lambda d: [f"data.source={_txt_folder(d)}", "train.eval_batches=0"],
}


def _txt_folder(d: Path) -> Path:
    (d / "txt" / "sub").mkdir(parents=True)
    for i in range(3):
        (d / "txt" / "sub" / f"{i}.txt").write_text(" ".join(GOOD_DOCS[i * 30 : i * 30 + 30]))
    return d / "txt"


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_what_the_dry_run_accepts_train_takes_to_its_launch(case, partrain, tmp_path):
    (tmp_path / "data").mkdir()
    dry, real = _pair(partrain, tmp_path / "cache", *ACCEPTED[case](tmp_path / "data"))
    assert dry.code == 0, dry.stdout + dry.stderr
    report = json.loads(dry.stdout)
    assert report["unchecked"] == [] and "ready to launch" in report["verdict"]
    assert real.spawned, real.stdout + real.stderr  # past the preflight: torchrun was about to start


def test_the_dry_run_reads_only_what_the_verdict_needs(partrain, tmp_path):
    """A corpus far larger than one batch: the dry run stops reading once both splits hold a batch,
    so a bad record after that point is left to train's full read (the documented limit)."""
    from partrain.blueprint.config.schema import DataConfig
    from partrain.data import batch_problems, probe_tokens

    path = _jsonl(tmp_path / "big.jsonl", [{"text": t} for t in GOOD_DOCS * 20])
    with open(path, "a") as f:
        f.write('{"body": "no text"}\n')
    cfg = DataConfig(source=str(path), cache_dir=str(tmp_path / "cache"))
    needed = probe_tokens(cfg, lambda packed: not batch_problems(packed, 32, 8, with_eval=True))
    assert not batch_problems(needed, 32, 8, with_eval=True)
    assert needed.n_train_tokens + needed.n_eval_tokens < 25_000  # of about 440k
    assert not (tmp_path / "cache").exists()
    dry, real = _pair(partrain, tmp_path / "cache", f"data.source={path}")
    assert dry.code == 0 and real.errors()[0]["key"] == "data.text_field"


def test_a_hub_dataset_not_in_the_cache_is_named_not_checked(run_partrain, tmp_path):
    """Offline, with an empty Hub cache: the dry run and plan --check say what they did not check
    (valid JSON, exit 0); train itself needs the dataset and refuses."""
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    args = [*BASE, "data.source=org/not-downloaded"]
    for command in (["train", *args, "--dry-run", "--check"], ["plan", *args, "--check"]):
        ran = run_partrain(*command, "--json", env=env)
        assert ran.code == 0, ran.stdout + ran.stderr
        report = json.loads(ran.stdout)
        assert [u["check"] for u in report["unchecked"]] == ["data"], report["unchecked"]
        assert "layout ready" in report["verdict"] and "ready to launch" not in report["verdict"]
        assert "data not checked: data.source=org/not-downloaded" in report["verdict"]
        assert ran.created() == [] and not (tmp_path / "hf").exists()
    ran = run_partrain("train", *args, env=env)
    assert ran.code == 2 and "data.source" in ran.stderr and ran.spawned == []


def test_plan_without_check_says_it_read_no_files(partrain, tmp_path):
    overrides, _ = _no_text_field(tmp_path)
    ran = partrain("plan", *BASE, *overrides, "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    report = json.loads(ran.stdout)
    assert [u["check"] for u in report["unchecked"]] == ["files"] and "ready to launch" not in report["verdict"]


def test_the_default_dry_run_checks_the_builtin_data_in_memory(run_partrain):
    """The console script as a user runs it: an empty HOME (no data cache), nothing created, the
    builtin corpus counted in memory."""
    ran = run_partrain("train", "recipe=gpt-dp", "--dry-run", "--json")
    assert ran.code == 0 and ran.created() == [] and ran.spawned == [], ran.stderr
    report = json.loads(ran.stdout)
    assert report["unchecked"] == [] and "ready to launch" in report["verdict"]


def _safetensors(path: Path, header: dict, n_bytes: int) -> None:
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + bytes(n_bytes))


def _word_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(GOOD_DOCS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="[UNK]").save_pretrained(folder)


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "train"])
def test_over_long_paths_exit_2_naming_the_key_and_the_limit(run_partrain, tmp_path, dry_run):
    """A 300-byte folder name (over NAME_MAX) in each written folder, and a path over PATH_MAX: exit 2
    before anything is written or started, each key named with its limit, no traceback."""
    long_name = tmp_path / ("a" * 300)
    deep = tmp_path / "/".join(["b" * 200] * 21)  # 4221 bytes in all: every name fits, the path does not
    args = [f"train.run_dir={long_name}", f"checkpoint.dir={deep}", f"data.cache_dir={long_name}/cache"]
    ran = run_partrain("train", "recipe=gpt-dp", "checkpoint.every_steps=5", *args, *(["--dry-run"] * dry_run))
    assert ran.code == 2, ran.stdout + ran.stderr
    assert "Traceback" not in ran.stderr and ran.spawned == [] and ran.created() == []
    assert "train.run_dir=" in ran.stderr and "data.cache_dir=" in ran.stderr and "(NAME_MAX)" in ran.stderr
    assert "checkpoint.dir=" in ran.stderr and "(PATH_MAX)" in ran.stderr
    ran = run_partrain("train", "recipe=gpt-dp", f"train.run_id={'c' * 300}", *(["--dry-run"] * dry_run))
    assert ran.code == 2 and "train.run_id=" in ran.stderr and "(NAME_MAX)" in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr and ran.created() == []
