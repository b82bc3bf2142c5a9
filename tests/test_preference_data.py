"""Preference rows (data.format=preference, TRL's layouts): rendered into (prompt + chosen, prompt + rejected)
with only the answers labelled, detected by data.format=auto, bad rows refused naming file, line and rule,
pairs kept together in every batch and layout, and the objective's rules exit 2 before any process. In
process through the real CLI where a user's command is checked (conftest's `cli`)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from partrain.blueprint.config.compose import compose
from partrain.data.chat import IGNORE_INDEX
from partrain.data.examples import prepare_examples, resolve_format
from partrain.data.preference_batches import PreferenceBatches

TEXT_ROWS = [{"prompt": f"What is {i} + {i}? ", "chosen": str(2 * i), "rejected": str(2 * i + 1)} for i in range(40)]
CHAT_ROWS = [
    {
        "prompt": [{"role": "user", "content": f"Reverse: w{i}"}],
        "chosen": [{"role": "assistant", "content": f"{i}w"}],
        "rejected": [{"role": "assistant", "content": f"w{i}"}],
    }
    for i in range(40)
]
IMPLICIT_ROWS = [
    {
        "chosen": [{"role": "user", "content": f"Upper: a{i}"}, {"role": "assistant", "content": f"A{i}"}],
        "rejected": [{"role": "user", "content": f"Upper: a{i}"}, {"role": "assistant", "content": f"a{i}"}],
    }
    for i in range(40)
]
ONE = ["cluster.devices_per_node=1", "parallel.dp=1", "train.seq_len=96", "train.global_batch_size=8"]
ONE += ["train.micro_batch_size=8", "data.eval_fraction=0.2"]


def _write(tmp_path: Path, rows, name: str = "pairs.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _examples(tmp_path: Path, rows, *extra):
    source = _write(tmp_path, rows)
    data = compose(
        ["recipe=dpo-lora", f"data.source={source}", "data.format=auto", "data.eval_fraction=0.2", *extra]
    ).data
    data.cache_dir = str(tmp_path / "cache")
    return data, prepare_examples(data)


def _pair(examples, k: int):
    out = []
    for e in (2 * k, 2 * k + 1):
        lo, hi = int(examples.offsets[e]), int(examples.offsets[e + 1])
        out.append((list(examples.ids[lo:hi]), list(examples.labels[lo:hi])))
    return out


@pytest.mark.parametrize("rows", [TEXT_ROWS, CHAT_ROWS, IMPLICIT_ROWS], ids=["text", "conversation", "implicit"])
def test_a_row_is_two_examples_sharing_the_prompt_with_only_the_answers_labelled(rows, tmp_path):
    extra = ["data.chat_template="] if rows is TEXT_ROWS else []  # text answers: plain prompt + answer + EOS
    data, examples = _examples(tmp_path, rows, *extra)
    assert resolve_format(data) == "preference" and examples.paired
    assert examples.n_examples == 2 * len(rows) and examples.n_train == 2 * 32  # 20 % of the rows held out whole
    (c_ids, c_labels), (r_ids, r_labels) = _pair(examples, 3)
    start = next(i for i, label in enumerate(c_labels) if label != IGNORE_INDEX)
    assert c_ids[:start] == r_ids[:start], "both answers follow the same prompt tokens"
    assert all(label == IGNORE_INDEX for label in c_labels[:start] + r_labels[:start])
    trained = bytes(t for t, label in zip(c_ids, c_labels) if label != IGNORE_INDEX)
    answer = {id(TEXT_ROWS): "6", id(CHAT_ROWS): "3w", id(IMPLICIT_ROWS): "A3"}[id(rows)]
    assert trained.startswith(answer.encode()), trained


def test_batches_keep_each_pair_in_one_microbatch_and_are_the_same_for_every_dp_layout(tmp_path):
    _, examples = _examples(tmp_path, CHAT_ROWS)
    batches = PreferenceBatches(examples, 96, global_batch_size=8, seed=3)
    whole, _ = batches.rank_batch(5)
    halves = [batches.rank_batch(5, r, 2)[0] for r in range(2)]
    assert np.array_equal(whole.numpy(), np.concatenate([h.numpy() for h in halves]))
    for row in range(0, 8, 2):  # rows 2k and 2k+1: one pair, the same prompt, then two answers
        assert whole[row, :20].tolist() == whole[row + 1, :20].tolist()
        assert whole[row].tolist() != whole[row + 1].tolist()
    seen = np.concatenate([batches.batch_order(s) for s in range(batches.steps_per_epoch)]).tolist()
    assert len(set(seen)) == len(seen) == batches.steps_per_epoch * 4, "an epoch sees a pair at most once"


@pytest.mark.parametrize(
    "row, rule",
    [
        ({"prompt": "q", "chosen": "a"}, "missing_field"),
        ({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}, "mixed_answers"),
        ({"chosen": "a", "rejected": "b"}, "missing_prompt"),
        (
            {
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "more"}],
                "rejected": [{"role": "assistant", "content": "b"}],
            },
            "answer_turns",
        ),
    ],
)
def test_a_bad_row_is_exit_2_naming_file_line_and_rule(cli, tmp_path, row, rule):
    source = _write(tmp_path, CHAT_ROWS[:5] + [row] + CHAT_ROWS[5:])
    args = ["recipe=dpo-lora", f"data.source={source}", "data.format=preference", *ONE]
    ran = cli("train", "--dry-run", *args, f"data.cache_dir={tmp_path / 'cache'}")
    assert ran.code == 2 and ran.spawned == [], ran.stdout + ran.stderr
    words = " ".join((ran.stdout + ran.stderr).split())
    assert "pairs.jsonl line 6" in words and f"(rule {rule})" in words and "data.skip_bad_rows" in words, words


@pytest.mark.parametrize(
    "args, key, words",
    [
        (["train.objective=simpo", "train.simpo_gamma=inf"], "train.simpo_gamma", "must be a finite number"),
        (["train.micro_batch_size=3", "train.global_batch_size=6"], "train.micro_batch_size", "must be even"),
        (
            ["parallel.pp=2", "parallel.sp=2", "parallel.dp=1", "cluster.devices_per_node=4"],
            "parallel.sp",
            "with sequence parallelism too it is not built yet",
        ),
        (["data.packing=true"], "data.packing", "packing them is not built yet"),
        (["peft=none", "train.preference_reference=adapters"], "train.preference_reference", "needs LoRA adapters"),
        (
            ["train.preference_reference=copy", "parallel.pp=2", "parallel.dp=1", "cluster.devices_per_node=2"],
            "train.preference_reference",
            "with parallel.pp=2 it is not built yet",
        ),
        (["train.objective=simpo", "train.preference_reference=table"], "train.preference_reference", "only dpo"),
        (["data.format=chat"], "data.format", "train.objective=dpo trains on preference pairs"),
        (["train.preference_beta=0"], "train.preference_beta", "must be > 0"),
        (["train.preference_label_smoothing=0.5"], "train.preference_label_smoothing", "[0, 0.5)"),
        (["train.objective=lm"], "train.objective", "set train.objective=dpo"),
    ],
)
def test_the_objectives_rules_are_exit_2_before_any_process(cli, tmp_path, args, key, words):
    source = _write(tmp_path, CHAT_ROWS)
    base = ["recipe=dpo-lora", f"data.source={source}", *ONE, f"data.cache_dir={tmp_path / 'cache'}"]
    ran = cli("train", *base, *args, f"train.run_dir={tmp_path / 'run'}")
    out = " ".join((ran.stdout + ran.stderr).split())
    assert ran.code == 2 and ran.spawned == [] and "Traceback" not in out, out
    assert key in out and words in out, out
    assert not (tmp_path / "run").exists()


def test_auto_detects_preference_rows_and_chat_rows_under_dpo_are_refused(cli, tmp_path):
    chats = _write(tmp_path, [{"messages": r["prompt"] + r["chosen"]} for r in CHAT_ROWS], "chats.jsonl")
    args = ["recipe=dpo-lora", f"data.source={chats}", "data.format=auto", *ONE, f"data.cache_dir={tmp_path / 'c'}"]
    ran = cli("train", "--dry-run", *args)
    out = " ".join((ran.stdout + ran.stderr).split())
    assert ran.code == 2 and "data.format" in out and "preference pairs" in out, out
    pairs = _write(tmp_path, CHAT_ROWS)
    ran = cli("train", "--dry-run", "--json", *args, f"data.source={pairs}")
    assert ran.code == 0, ran.stdout + ran.stderr
    data = json.loads(ran.stdout)["fine_tuning"]["data"]
    assert (data["format"], data["detected"], data["examples_train"]) == ("preference", True, 64)
