"""data.eval_split / data.eval_source (issue 37 item 2): a dataset's own split, or a second file, is the
eval set instead of the held-out tail, for text and for fine-tuning examples; a split that does not
exist is exit 2 naming the ones that do, in the dry run as in train. No process is started here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError

CHATS = [
    {"messages": [{"role": "user", "content": f"What is {i} + 1?"}, {"role": "assistant", "content": str(i + 1)}]}
    for i in range(40)
]
TEXTS = [{"text": f"document {i}: the cat sat on the mat. {i % 7}"} for i in range(60)]


def _write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def chat_dict(tmp_path_factory) -> Path:
    """A save_to_disk DatasetDict of chat rows: train (30 rows) and validation (10 rows)."""
    datasets = pytest.importorskip("datasets")
    folder = tmp_path_factory.mktemp("chat-dict") / "chats"
    splits = {"train": CHATS[:30], "validation": CHATS[30:]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(folder))
    return folder


def _data(overrides):
    return compose(["data.chat_template=chatml", "data.packing=false", *overrides]).data


def _key_and_message(err: ConfigError):
    (problem,) = err.problems
    return problem.key, problem.message


def test_a_datasets_split_is_the_eval_set_of_examples(chat_dict, tmp_path):
    from partrain.data.examples import prepare_examples, probe_examples

    data = _data([f"data.source={chat_dict}", "data.eval_split=validation", f"data.cache_dir={tmp_path}"])
    probed = probe_examples(data)
    examples = prepare_examples(data)
    for got in (probed, examples):
        assert (got.n_train, got.n_examples) == (30, 40), "every train row trains, the 10 validation rows evaluate"
    first_eval = bytes(examples.ids[examples.offsets[30] : examples.offsets[31]].tolist()).decode()  # byte ids
    assert "What is 30 + 1?" in first_eval
    tail = prepare_examples(_data([f"data.source={chat_dict}", f"data.cache_dir={tmp_path}"]))
    assert (tail.n_train, tail.n_examples) == (29, 30), "without it: the held-out 2% tail of the train split"


def test_a_missing_split_names_the_key_and_the_splits_there_are(chat_dict, tmp_path):
    from partrain.data.examples import probe_examples

    with pytest.raises(ConfigError) as err:
        probe_examples(_data([f"data.source={chat_dict}", "data.eval_split=test", f"data.cache_dir={tmp_path}"]))
    key, message = _key_and_message(err.value)
    assert key == "data.eval_split" and "train, validation" in message and "'test'" in message


def test_eval_split_needs_a_datasets_source_and_another_split(tmp_path):
    from partrain.data.examples import probe_examples

    chats = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    with pytest.raises(ConfigError) as err:
        probe_examples(_data([f"data.source={chats}", "data.eval_split=validation"]))
    key, message = _key_and_message(err.value)
    assert key == "data.eval_split" and "no splits" in message and "data.eval_source" in message
    with pytest.raises(ConfigError) as err:
        probe_examples(_data([f"data.source={chats}", "data.eval_split=train", f"data.eval_source={chats}"]))
    assert "no splits" in _key_and_message(err.value)[1]


def test_an_eval_file_for_examples_and_for_text(tmp_path):
    from partrain.data.examples import prepare_examples
    from partrain.data.packing import prepare_tokens, probe_tokens

    train, held = _write_jsonl(tmp_path / "train.jsonl", CHATS[:30]), _write_jsonl(tmp_path / "eval.jsonl", CHATS[30:])
    got = prepare_examples(_data([f"data.source={train}", f"data.eval_source={held}", f"data.cache_dir={tmp_path}"]))
    assert (got.n_train, got.n_examples) == (30, 40)

    docs, eval_docs = _write_jsonl(tmp_path / "docs.jsonl", TEXTS), _write_jsonl(tmp_path / "held.jsonl", TEXTS[:5])
    text = compose([f"data.source={docs}", f"data.eval_source={eval_docs}", f"data.cache_dir={tmp_path}"]).data
    packed = prepare_tokens(text)
    # byte tokens: each document's UTF-8 bytes and its end-of-document token
    assert packed.n_train_tokens == sum(len(r["text"]) + 1 for r in TEXTS)
    assert packed.n_eval_tokens == sum(len(r["text"]) + 1 for r in TEXTS[:5])
    probed = probe_tokens(compose([f"data.source={docs}", f"data.eval_source={eval_docs}"]).data, lambda p: False)
    assert (probed.n_train_tokens, probed.n_eval_tokens) == (packed.n_train_tokens, packed.n_eval_tokens)
    changed = _write_jsonl(tmp_path / "held.jsonl", TEXTS[:6])
    assert prepare_tokens(text).n_eval_tokens > packed.n_eval_tokens, f"{changed} changed: a new cache entry"


def test_streaming_with_an_eval_split_is_refused_by_validation(chat_dict):
    with pytest.raises(ConfigError) as err:
        validate(compose([f"data.source={chat_dict}", "data.streaming=true", "data.eval_split=validation"]))
    assert [p.key for p in err.value.problems] == ["data.eval_split"]


def test_the_dry_run_refuses_a_missing_split_before_any_process(chat_dict, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from partrain.cli import app

    monkeypatch.setenv("HOME", str(tmp_path))
    args = [f"data.source={chat_dict}", "data.eval_split=dev", "data.chat_template=chatml", "data.packing=false"]
    args += ["cluster.devices_per_node=1", f"data.cache_dir={tmp_path / 'cache'}", f"train.run_dir={tmp_path / 'run'}"]
    for command in (["train", "--dry-run", "--json"], ["train", "--dry-run", "--check", "--json"]):
        result = CliRunner().invoke(app, [*command, *args])
        assert result.exit_code == 2, result.output
        errors = json.loads(result.stdout)["errors"]
        assert [e["key"] for e in errors] == ["data.eval_split"] and "validation" in errors[0]["message"]
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_a_missing_eval_source_names_its_key(tmp_path):
    from partrain.data.examples import probe_examples

    chats = _write_jsonl(tmp_path / "chats.jsonl", CHATS)
    with pytest.raises(ConfigError) as err:
        probe_examples(_data([f"data.source={chats}", f"data.eval_source={tmp_path / 'nope.jsonl'}"]))
    assert _key_and_message(err.value)[0] == "data.eval_source"
