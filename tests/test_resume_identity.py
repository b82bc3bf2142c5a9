"""A resume on cached fine-tuning examples refuses data rendered otherwise than the checkpoint's (another
template, train_on, tokenizer, packing) even when the example count is unchanged, and keeps accepting
the same settings, entries copied elsewhere, and checkpoints or entries written before it was recorded.
Single process: only the examples cache and the data positions, no training."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from partrain.blueprint.config.schema import DataConfig
from partrain.data.example_batches import ExampleBatches
from partrain.data.example_packing import PackedExampleBatches, resume_position_problems
from partrain.data.examples import open_examples, prepare_examples, rendering_identity
from partrain.errors import ConfigError

SEQ_LEN = 96
GLOBAL_BATCH = 4


def _rows(n: int = 24) -> list:
    """Short two-turn chats: every one fits a row, so the example count never depends on the template."""
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": f"{i * 7}"}]
        rows.append({"messages": messages})
    return rows


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in _rows()))
    return str(path)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _cfg(chat_file, cache, **changes) -> DataConfig:
    base = DataConfig(
        source=chat_file,
        tokenizer="byte",
        chat_template="chatml",
        packing=False,
        eval_fraction=0.0,
        cache_dir=str(cache),
    )
    return dataclasses.replace(base, **changes)


def _position(cfg: DataConfig, step: int = 3, cls=ExampleBatches) -> dict:
    batches = cls(prepare_examples(cfg), SEQ_LEN, GLOBAL_BATCH, seed=7, long_examples="truncate")
    batches.step = step
    return batches.state_dict()


@pytest.mark.parametrize(
    "change, key",
    [({"chat_template": "zephyr"}, "data.chat_template"), ({"train_on": "all"}, "data.train_on")],
)
def test_a_resume_with_other_rendering_is_refused_naming_the_key(chat_file, cache, change, key):
    saved = _position(_cfg(chat_file, cache))
    batches = ExampleBatches(prepare_examples(_cfg(chat_file, cache, **change)), SEQ_LEN, GLOBAL_BATCH, seed=7)
    assert batches.n_examples == saved["n_examples"]  # the count alone would not tell
    with pytest.raises(ConfigError) as err:
        batches.load_state_dict(saved)
    problem = err.value.problems[0]
    assert problem.key == key
    assert "data.chat_template" in problem.rule and "data.train_on" in problem.rule  # what the check covers
    assert "original data settings" in problem.fix


def test_the_same_settings_resume_on_the_same_batch(chat_file, cache):
    cfg = _cfg(chat_file, cache)
    saved = _position(cfg)
    assert set(saved["rendering"]) >= {"data.chat_template", "data.train_on", "data.tokenizer", "data.long_examples"}
    fresh = ExampleBatches(prepare_examples(cfg), SEQ_LEN, GLOBAL_BATCH, seed=7)
    fresh.load_state_dict(saved)
    assert fresh.step == 3
    reference = ExampleBatches(prepare_examples(cfg), SEQ_LEN, GLOBAL_BATCH, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(fresh.next_batch(), reference.rank_batch(3)))


def test_an_entry_copied_elsewhere_and_old_states_and_entries_still_resume(chat_file, cache, tmp_path):
    cfg = _cfg(chat_file, cache)
    saved = _position(cfg)
    moved = tmp_path / "elsewhere.jsonl"
    shutil.copy(chat_file, moved)  # the identity holds no path: another machine's copy still resumes
    assert rendering_identity(_cfg(str(moved), cache), "chat", "byte") == rendering_identity(cfg, "chat", "byte")
    examples = prepare_examples(cfg)
    folder = tmp_path / "copied-entry"
    shutil.copytree(examples.meta_path.parent, folder)
    ExampleBatches(open_examples(folder / "meta.json"), SEQ_LEN, GLOBAL_BATCH, seed=7).load_state_dict(saved)

    old_state = {k: v for k, v in saved.items() if k != "rendering"}  # a checkpoint written before it
    ExampleBatches(examples, SEQ_LEN, GLOBAL_BATCH, seed=7).load_state_dict(old_state)
    old_entry = dataclasses.replace(prepare_examples(_cfg(chat_file, cache, train_on="all")), rendering={})
    old = ExampleBatches(old_entry, SEQ_LEN, GLOBAL_BATCH, seed=7)  # an entry written before it
    assert "rendering" not in old.state_dict()
    old.load_state_dict(saved)
    assert old.step == 3


def test_packed_and_padded_positions_refuse_each_other_naming_data_packing(chat_file, cache):
    padded = _position(_cfg(chat_file, cache))
    examples = prepare_examples(_cfg(chat_file, cache))
    packed = PackedExampleBatches(examples, SEQ_LEN, GLOBAL_BATCH, seed=7)
    for batches, saved in (
        (packed, padded),
        (ExampleBatches(examples, SEQ_LEN, GLOBAL_BATCH, seed=7), packed.state_dict()),
    ):
        with pytest.raises(ConfigError) as err:
            batches.load_state_dict(saved)
        assert err.value.problems[0].key == "data.packing"
        assert "data.packing=" in err.value.problems[0].rule and "original data.packing=" in err.value.problems[0].fix


def test_the_preflight_helper_reports_the_workers_refusal(chat_file, cache):
    saved = _position(_cfg(chat_file, cache))
    examples = prepare_examples(_cfg(chat_file, cache, train_on="all"))
    problems = resume_position_problems(examples, saved, SEQ_LEN, GLOBAL_BATCH, 7, "truncate", False)
    assert [p.key for p in problems] == ["data.train_on"]
    same = prepare_examples(_cfg(chat_file, cache))
    assert resume_position_problems(same, saved, SEQ_LEN, GLOBAL_BATCH, 7, "truncate", False) == []


def test_the_preflight_refuses_a_resume_on_other_data_settings(chat_file, cache):
    """What `train` and `--dry-run` run before any process: the chosen checkpoint's data position
    against this run's examples (exit 2 through the ConfigError), by the workers' own check."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.preflight import data_problems

    saved = _position(_cfg(chat_file, cache))

    def run(*overrides):
        return validate(
            compose(
                [
                    "model=llama-tiny",
                    "cluster.devices_per_node=1",
                    f"data.source={chat_file}",
                    "data.tokenizer=byte",
                    "data.chat_template=chatml",
                    "data.packing=false",
                    "data.eval_fraction=0.02",  # 24 rows: none held out, as in _cfg
                    f"data.cache_dir={cache}",
                    f"train.seq_len={SEQ_LEN}",
                    f"train.global_batch_size={GLOBAL_BATCH}",
                    "train.micro_batch_size=4",
                    "train.seed=7",
                    "train.eval_batches=0",
                    *overrides,
                ]
            )
        )

    record = {"extra": {"data": saved}}
    assert data_problems(run(), dry_run=True, resume_record=record) == []
    problems = data_problems(run("data.train_on=all"), dry_run=True, resume_record=record)
    assert [p.key for p in problems] == ["data.train_on"]
