"""Hostile fine-tuning data (issue 38 item 7): every malformed row is exit 2 naming its file, line and
rule, or with data.skip_bad_rows=true left out and counted per rule; every row bad is still exit 2.
Examples longer than a row follow data.long_examples (error names file, line, length and limit;
truncate and skip are counted). Single process: the examples are rendered in memory or into a
temporary cache, and the CLI cases stop in the preflight, before any process."""

from __future__ import annotations

import dataclasses
import json

import pytest

from partrain.blueprint.config.schema import DataConfig
from partrain.data.example_batches import ExampleBatches
from partrain.data.examples import prepare_examples, probe_examples
from partrain.data.long_examples import long_example_problems, row_facts, row_note
from partrain.errors import ConfigError

SEQ_LEN = 128


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"q{i}?"}, {"role": "assistant", "content": f"a{i}."}]}


GOOD = {
    "chat": _chat,
    "prompt_completion": lambda i: {"prompt": f"q{i}? ", "completion": f"a{i}."},
    "tokenized": lambda i: {"input_ids": [10 + i, 20, 30], "labels": [-100, 20, 30]},
}


def _turns(*pairs) -> dict:
    """A chat row of (role, content) turns; None leaves the key out."""
    turns = [{k: v for k, v in (("role", role), ("content", content)) if v is not None} for role, content in pairs]
    return {"messages": turns}


ANSWER = ("assistant", "a")
BAD = {  # case: (format, the bad row, its rule)
    "no role": ("chat", _turns((None, "hi"), ANSWER), "no_role_or_content"),
    "no content": ("chat", _turns(("user", None), ANSWER), "no_role_or_content"),
    "unknown role": ("chat", _turns(("robot", "x"), ANSWER), "unknown_role"),
    "non-string content": ("chat", _turns(("user", ["x"]), ANSWER), "not_a_string"),
    "empty conversation": ("chat", _turns(), "empty_conversation"),
    "no assistant turn": ("chat", _turns(("user", "hi")), "no_assistant_turn"),
    "system in the middle": ("chat", _turns(("user", "q"), ("system", "s"), ANSWER), "system_not_first"),
    "no messages field": ("chat", {"text": "hello"}, "missing_field"),
    "missing prompt": ("prompt_completion", {"completion": "a"}, "missing_field"),
    "non-string completion": ("prompt_completion", {"prompt": "q", "completion": 7}, "not_a_string"),
    "input_ids not ints": ("tokenized", {"input_ids": [1, "2", 3]}, "bad_input_ids"),
    "labels of another length": ("tokenized", {"input_ids": [1, 2, 3], "labels": [1, 2]}, "bad_labels"),
}


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _cfg(path: str, fmt: str, tmp_path, **extra) -> DataConfig:
    template = "chatml" if fmt == "chat" else ""
    return DataConfig(
        source=path, tokenizer="byte", format=fmt, chat_template=template, packing=False, eval_fraction=0.0,
        cache_dir=str(tmp_path / "cache"), **extra,
    )  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_row_is_exit_2_naming_file_line_and_rule_or_a_counted_skip(case, tmp_path):
    fmt, bad, rule = BAD[case]
    rows = [GOOD[fmt](0), GOOD[fmt](1), bad, GOOD[fmt](2)]
    path = _write(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ConfigError) as err:
        probe_examples(_cfg(path, fmt, tmp_path))
    (problem,) = err.value.problems
    assert problem.key == "data.source"
    assert f"{path} line 3:" in problem.rule and f"(rule {rule})" in problem.rule
    assert "data.skip_bad_rows=true" in problem.fix
    examples = probe_examples(_cfg(path, fmt, tmp_path, skip_bad_rows=True))
    assert examples.n_examples == 3
    assert examples.skipped["counts"] == {rule: 1} and examples.skipped["rows"] == [2]
    assert f"{path} line 3:" in examples.skipped["first"]
    assert row_facts(_cfg(path, fmt, tmp_path), examples, SEQ_LEN) == {"skipped_rows": {rule: 1}}


def test_skips_are_stored_in_the_cache_and_counted_per_rule(tmp_path):
    rows = [_chat(0), BAD["no role"][1], _chat(1), BAD["unknown role"][1], BAD["no content"][1], _chat(2)]
    path = _write(tmp_path / "rows.jsonl", rows)
    cfg = _cfg(path, "chat", tmp_path, skip_bad_rows=True)
    built = prepare_examples(cfg)
    again = prepare_examples(cfg)  # reopened from the cache entry's meta.json
    for examples in (built, again):
        assert examples.n_examples == 3
        assert examples.skipped["counts"] == {"no_role_or_content": 2, "unknown_role": 1}
    note = row_note(cfg, again, SEQ_LEN)
    assert note.startswith("data.skip_bad_rows: 3 malformed rows skipped (no_role_or_content 2, unknown_role 1)")
    with pytest.raises(ConfigError):  # skip_bad_rows=false does not reuse the entry that skipped them
        prepare_examples(_cfg(path, "chat", tmp_path))


def test_every_row_bad_is_still_exit_2(tmp_path):
    path = _write(tmp_path / "rows.jsonl", [BAD["no assistant turn"][1], BAD["empty conversation"][1]])
    with pytest.raises(ConfigError) as err:
        probe_examples(_cfg(path, "chat", tmp_path, skip_bad_rows=True))
    (problem,) = err.value.problems
    assert "every row is malformed: 2 malformed rows skipped" in problem.rule
    assert f"{path} line 1:" in problem.rule


def _long_rows() -> list:
    # row 2 is skipped as malformed, so the long example (line 4) is example 2: its line is found again.
    long = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 300}]}
    return [_chat(0), BAD["no assistant turn"][1], _chat(1), long, _chat(2), _chat(3)]


def test_long_examples_error_names_file_line_length_and_limit(tmp_path):
    path = _write(tmp_path / "rows.jsonl", _long_rows())
    cfg = _cfg(path, "chat", tmp_path, skip_bad_rows=True)  # skip_bad_rows does not skip long examples
    examples = probe_examples(cfg)
    (problem,) = long_example_problems(cfg, examples, SEQ_LEN)
    length = int(examples.offsets[3] - examples.offsets[2])
    assert problem.key == "data.long_examples" and problem.value == "error"
    assert f"{path} line 4: the example is {length} tokens, longer than the {SEQ_LEN + 1} a row holds" in problem.rule
    assert problem.fix == "set data.long_examples=truncate (or skip), or raise train.seq_len"


@pytest.mark.parametrize("mode", ["truncate", "skip"])
def test_long_examples_truncate_or_skip_are_counted(mode, tmp_path):
    path = _write(tmp_path / "rows.jsonl", _long_rows())
    cfg = _cfg(path, "chat", tmp_path, skip_bad_rows=True, long_examples=mode)
    examples = probe_examples(cfg)
    assert long_example_problems(cfg, examples, SEQ_LEN) == []
    batches = ExampleBatches(examples, SEQ_LEN, 2, seed=0, long_examples=mode)
    assert batches.truncated == 1
    assert (2 in batches.index.tolist()) == (mode == "truncate")
    facts = row_facts(cfg, examples, SEQ_LEN)
    assert facts == {"skipped_rows": {"no_assistant_turn": 1}, "long_examples": {"mode": mode, "count": 1}}
    assert f"data.long_examples={mode}: 1 examples" in row_note(cfg, examples, SEQ_LEN)


def _train_args(path: str, tmp_path, *extra: str) -> list:
    return [
        "train", "model=llama-tiny", f"data.source={path}", "data.tokenizer=byte", "data.chat_template=chatml",
        "data.packing=false", "data.eval_fraction=0.2", f"data.cache_dir={tmp_path / 'cache'}",
        f"train.seq_len={SEQ_LEN}", "train.global_batch_size=2", "train.micro_batch_size=2", "train.steps=1",
        "train.eval_batches=0",
        "parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "cluster.devices_per_node=1", *extra,
    ]  # fmt: skip


def _system_in_the_middle(tmp_path) -> str:
    rows = [_chat(0), _chat(1), BAD["system in the middle"][1], *(_chat(i) for i in range(2, 6))]
    return _write(tmp_path / "rows.jsonl", rows)


def test_cli_bad_row_is_exit_2_before_any_process(run_partrain, tmp_path):
    path = _system_in_the_middle(tmp_path)
    ran = run_partrain(*_train_args(path, tmp_path))  # the launch's own preflight, not a dry run
    assert ran.code == 2, ran.stderr
    assert f"{path} line 3: turn 1 is a system turn after the start" in ran.stderr
    assert "rule system_not_first" in ran.stderr and not ran.spawned


def test_cli_dry_run_notes_the_skipped_rows(cli, tmp_path):
    path = _system_in_the_middle(tmp_path)
    ran = cli(*_train_args(path, tmp_path, "data.skip_bad_rows=true"), "--dry-run")
    assert ran.code == 0, ran.stderr
    assert "note: data.skip_bad_rows: 1 malformed row skipped (system_not_first 1)" in ran.stderr
    ran = cli(*_train_args(path, tmp_path, "data.skip_bad_rows=true"), "--dry-run", "--json")
    assert ran.code == 0, ran.stderr
    data = json.loads(ran.stdout)["fine_tuning"]["data"]  # the report carries the counts too
    assert data["skipped_rows"] == {"system_not_first": 1} and data["long_examples"] is None


def test_cli_long_example_dry_run_exit_2_naming_line_and_limit(run_partrain, tmp_path):
    path = _write(tmp_path / "rows.jsonl", _long_rows()[2:])
    ran = run_partrain(*_train_args(path, tmp_path), "--dry-run")
    assert ran.code == 2, ran.stderr
    assert "data.long_examples" in ran.stderr and f"{path} line 2: the example is" in ran.stderr
    assert f"longer than the {SEQ_LEN + 1} a row holds" in ran.stderr and "data.long_examples=truncate" in ran.stderr
    assert not ran.spawned


def test_a_line_that_is_not_json_is_skipped_and_counted_like_any_bad_row(tmp_path):
    """Issue 45: data.skip_bad_rows skips every kind of bad row, a line that is not JSON included."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_chat(0)) + "\n" + '{"messages": [oops\n' + json.dumps(_chat(1)) + "\n")
    with pytest.raises(ConfigError) as err:
        probe_examples(_cfg(str(path), "chat", tmp_path))
    (problem,) = err.value.problems
    assert "line 2 is not valid JSON" in problem.rule and "data.skip_bad_rows=true" in problem.fix
    chat = _cfg(str(path), "chat", tmp_path, skip_bad_rows=True)
    for cfg in (chat, dataclasses.replace(chat, format="auto")):  # auto reads the first valid row
        examples = probe_examples(cfg)
        assert examples.n_examples == 2 and examples.skipped["counts"] == {"invalid_json": 1}
        assert examples.skipped["rows"] == [1] and f"{path} line 2: not valid JSON" in examples.skipped["first"]
