"""Fine-tuning data, first version (issue 37): chat rows rendered into the examples cache, one padded
example per row, labels on the assistant turns only, and the loss normalised by the global batch's
labelled tokens, so DDP (dp2) and a 1F1B pipeline (pp2, 2 microbatches) match one process although
their microbatches hold very different numbers of labelled tokens. The runs of one process count share
a launch (testing.in_process.train_all)."""

from __future__ import annotations

import json

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.schema import DataConfig
from partrain.blueprint.validate import validate
from partrain.data.chat import IGNORE_INDEX
from partrain.data.example_batches import ExampleBatches
from partrain.data.examples import prepare_examples
from partrain.data.tokenizer import ByteTokenizer
from partrain.errors import ConfigError
from partrain.rehearse.runs import train_all
from partrain.testing.parity import check_parity, parity_args, reference_overrides

STEPS = 3
SEQ_LEN = 128
GLOBAL_BATCH = 8


def _rows(n: int = 48) -> list:
    """Multi-turn chats, a system turn in every third, answers from 1 to ~30 bytes long."""
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "Be terse."}] if i % 3 == 0 else []
        for turn in range(1 + i % 2):
            messages.append({"role": "user", "content": f"{i}+{turn}?"})
            answer = str(i + turn) if i % 4 else "ok " * (i % 9 + 8) + str(i + turn)
            messages.append({"role": "assistant", "content": answer})
        rows.append({"messages": messages})
    return rows


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("chat") / "chat.jsonl", _rows())


@pytest.fixture(scope="module")
def data_overrides(chat_file, tmp_path_factory):
    return [
        "model=llama-tiny",
        f"data.source={chat_file}",
        "data.tokenizer=byte",
        "data.chat_template=chatml",
        "data.packing=false",
        "data.long_examples=truncate",  # many rows are longer than seq_len: the cut is part of what is checked
        "data.eval_fraction=0.25",
        f"data.cache_dir={tmp_path_factory.mktemp('cache')}",
        f"train.seq_len={SEQ_LEN}",
        f"train.global_batch_size={GLOBAL_BATCH}",
        "optim.lr=2e-3",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
    ]


LAYOUTS = {
    "chat-ddp2": ["parallel.dp=2", "parallel.pp=1", "parallel.zero_stage=0", "train.micro_batch_size=2"],
    "chat-pp2-1f1b": [
        "parallel.dp=1",
        "parallel.pp=2",
        "parallel.pp_schedule=1f1b",
        "parallel.zero_stage=0",
        "train.micro_batch_size=4",
        "train.microbatches=2",
    ],
}


@pytest.fixture(scope="module")
def runs(data_overrides, tmp_path_factory):
    cases = {"reference": parity_args(reference_overrides(data_overrides + ["train.micro_batch_size=8"]), STEPS)}
    for name, layout in LAYOUTS.items():
        cases[name] = parity_args(data_overrides + layout + ["parallel.tp=1", "cluster.devices_per_node=2"], STEPS)
    # Two malformed rows skipped (data.skip_bad_rows): the run summary counts them and the cut examples.
    bad = [{"messages": [{"role": "user", "content": "no answer"}]}, {"messages": []}]
    skipping = _write(tmp_path_factory.mktemp("bad") / "chat.jsonl", _rows()[:20] + bad + _rows()[20:])
    overrides = [o for o in data_overrides if not o.startswith("data.source=")]
    overrides += [f"data.source={skipping}", "data.skip_bad_rows=true", "train.micro_batch_size=8"]
    cases["reference-skipping"] = parity_args(reference_overrides(overrides), STEPS)
    return train_all(cases, tmp_path_factory.mktemp("runs"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_masked_loss_matches_single_process(name, runs):
    got, ref = runs[name], runs["reference"]
    print(name, check_parity(ref, got))
    assert got.losses[-1] < got.losses[0]


@pytest.mark.slow
def test_the_run_summary_counts_skipped_rows_and_truncated_examples(runs):
    rows = runs["reference-skipping"].summary["data_rows"]
    assert rows["skipped_rows"] == {"empty_conversation": 1, "no_assistant_turn": 1}
    assert rows["long_examples"]["mode"] == "truncate" and rows["long_examples"]["count"] > 0
    assert runs["reference"].summary["data_rows"] == {"long_examples": rows["long_examples"]}


def _config(chat_file, tmp_path) -> DataConfig:
    return DataConfig(
        source=chat_file,
        tokenizer="byte",
        chat_template="chatml",
        packing=False,
        eval_fraction=0.25,
        cache_dir=str(tmp_path),
    )


def test_loader_labels_are_exactly_the_assistant_turns_shifted(chat_file, tmp_path):
    examples = prepare_examples(_config(chat_file, tmp_path))
    batches = ExampleBatches(examples, SEQ_LEN, GLOBAL_BATCH, seed=1234)
    rows = _rows()
    tok = ByteTokenizer()
    truncated = 0
    for step in range(2):
        inputs, labels = batches.rank_batch(step)
        for row, e in enumerate(batches.index[batches.positions(step)].tolist()):
            trained = labels[row] != IGNORE_INDEX
            runs, current = [], []
            for t in range(SEQ_LEN):
                if trained[t]:
                    current.append(int(labels[row, t]))
                elif current:
                    runs.append(tok.decode(current))
                    current = []
            runs += [tok.decode(current)] if current else []
            answers = [m["content"] + "<|im_end|>" for m in rows[e]["messages"] if m["role"] == "assistant"]
            if examples.offsets[e + 1] - examples.offsets[e] <= SEQ_LEN + 1:
                assert runs == answers
            else:  # truncated at seq_len + 1 tokens: the answers up to the cut
                assert runs[:-1] == answers[: len(runs) - 1] and answers[len(runs) - 1].startswith(runs[-1])
                truncated += 1
            # Shifted: the label at t is the input at t + 1 (where both are inside the example).
            inner = trained[:-1].nonzero().flatten()
            assert (labels[row, inner] == inputs[row, inner + 1]).all()
    # The microbatches (2 rows) of a global batch hold very different numbers of labelled tokens.
    counts = [(labels[i : i + 2] != IGNORE_INDEX).sum().item() for i in range(0, GLOBAL_BATCH, 2)]
    assert max(counts) >= 2 * min(counts), counts
    assert batches.label_count(1) == (labels != IGNORE_INDEX).sum().item()
    assert truncated <= batches.truncated


def test_a_bad_row_exits_2_naming_file_and_line_in_dry_run_and_train(run_partrain, data_overrides, tmp_path):
    bad = _write(tmp_path / "bad.jsonl", _rows(6)[:5] + [{"messages": [{"role": "user", "content": "hi"}]}])
    overrides = [o for o in data_overrides if not o.startswith("data.source=")] + [f"data.source={bad}"]
    for extra in (["--dry-run"], []):
        ran = run_partrain("train", *overrides, "train.steps=1", *extra)
        assert ran.code == 2, ran.stderr
        assert f"{bad} line 6: the conversation has no assistant turn" in ran.stderr
        assert not ran.spawned


@pytest.mark.parametrize(
    "extra, key",
    [
        (["data.format=text", "data.packing=false"], "data.packing"),
        # streamed rows are built (tests/test_example_stream.py), padded only and never read ahead
        (["data.format=chat", "data.packing=true", "data.streaming=true"], "data.packing"),
        (["data.format=chat", "data.packing=false", "data.streaming=true"], "data.long_examples"),
        (["data.format=prompt_completion", "data.packing=false", "data.prompt_template=Q:"], "data.prompt_template"),
        (["data.format=dialogue"], "data.format"),
        (["data.train_on=prompt"], "data.train_on"),
    ],
)
def test_combinations_not_built_are_refused_naming_the_key(extra, key):
    with pytest.raises(ConfigError) as err:
        validate(compose(["model=llama-tiny", "data.source=/tmp/x.jsonl", *extra]))
    assert key in {p.key for p in err.value.problems}


def test_data_show_json_is_the_loaders_rows_in_hugging_face_convention(run_partrain, data_overrides, tmp_path):
    ran = run_partrain("data", "show", *data_overrides, "--n", "3", "--json")
    assert ran.code == 0, ran.stderr
    samples = json.loads(ran.stdout)["samples"]
    assert len(samples) == 3
    examples = prepare_examples(_config(data_overrides[1].split("=", 1)[1], tmp_path))
    batches = ExampleBatches(examples, SEQ_LEN, GLOBAL_BATCH, seed=1234)
    inputs, labels = batches.rank_batch(0)
    tok = ByteTokenizer()
    for i, sample in enumerate(samples):
        assert sample["input_ids"] == inputs[i].tolist()
        assert sample["position_ids"] == list(range(SEQ_LEN))
        # Aligned, unshifted: labels[t] is input_ids[t] where trained; the loader's targets shifted by one.
        assert sample["labels"] == [IGNORE_INDEX] + labels[i, :-1].tolist()
        trained = [t for t, label in enumerate(sample["labels"]) if label != IGNORE_INDEX]
        assert all(sample["labels"][t] == sample["input_ids"][t] for t in trained)
        row = _rows()[int(batches.index[batches.positions(0)][i])]
        answers = "".join(m["content"] + "<|im_end|>" for m in row["messages"] if m["role"] == "assistant")
        shown = tok.decode([sample["input_ids"][t] for t in trained])
        assert shown and answers.startswith(shown)  # all of them, or those up to the cut at seq_len
    # Piped (no colour): the trained text is bracketed, each answer through its end-of-turn marker.
    plain = run_partrain("data", "show", *data_overrides, "--n", "1")
    assert plain.code == 0 and "<|im_end|>\u27e7" in plain.stdout and "\u27e6...\u27e7: tokens the loss" in plain.stdout
