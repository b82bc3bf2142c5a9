"""data.streaming=true with fine-tuning rows (issue 37 item 2): each example rendered on the fly into the
padded row the examples cache gives it, batches the same for every dp split, the label count every rank
knows, the held-out head, and the rules a stream cannot honour refused before any process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError

SEQ = 96
STREAM = ["data.streaming=true", "data.packing=false", "data.long_examples=truncate", "data.chat_template=chatml"]


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("stream") / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"Q{i}?"}, {"role": "assistant", "content": "A" * (1 + i % 9)}]}
        for i in range(60)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_streamed_rows_are_the_cached_examples_rows(chats, tmp_path):
    from partrain.data.example_batches import ExampleBatches
    from partrain.data.example_stream import ExampleStreamBatches
    from partrain.data.examples import prepare_examples

    data = compose([f"data.source={chats}", *STREAM, "data.eval_fraction=0"]).data
    stream = ExampleStreamBatches(data, SEQ, 8, seed=3, eval_batches=1)
    streamed = [tuple(map(tuple, r.tolist())) for r in stream.pass_rows()]
    cached_cfg = compose([f"data.source={chats}", *STREAM[1:], "data.eval_fraction=0", f"data.cache_dir={tmp_path}"])
    cached = ExampleBatches(prepare_examples(cached_cfg.data), SEQ, 60, 0, "truncate")
    inputs, labels = cached._rows.rows(np.arange(60))
    assert streamed == [(tuple(i), tuple(l)) for i, l in zip(inputs.tolist(), labels.tolist())]

    # steps: the first 8 rows are held out; dp2's halves are the whole batch; the label count is the batch's
    held = {tuple(r.flatten().tolist()) for r in stream.global_batch(0)}
    assert not held & {tuple(np.asarray(r).flatten().tolist()) for r in list(stream.pass_rows())[:8]}
    x, y = stream.rank_batch(0)
    (x0, y0), (x1, y1) = stream.rank_batch(0, 0, 2), stream.rank_batch(0, 1, 2)
    assert x.tolist() == x0.tolist() + x1.tolist() and y.tolist() == y0.tolist() + y1.tolist()
    assert stream.label_count(0) == int((y != -100).sum()) and stream.label_share(0) == stream.label_count(0) / 8
    again = ExampleStreamBatches(data, SEQ, 8, seed=3, eval_batches=1)
    again.load_state_dict(stream.state_dict() | {"step": 5})
    assert again.rank_batch(5)[1].tolist() == stream.rank_batch(5)[1].tolist()


@pytest.mark.parametrize(
    "changed",
    ["data.train_on=all", "data.chat_template=llama3", "data.long_examples=skip"],
)
def test_a_resume_with_another_rendering_is_refused(chats, changed):
    """The stream identity a checkpoint's data position records covers how rows are rendered, not only
    the source and tokenizer: resuming after changing it stops with exit 2 (a ConfigError)."""
    from partrain.data.example_stream import ExampleStreamBatches
    from partrain.data.stream_facts import stream_facts

    saved = ExampleStreamBatches(compose([f"data.source={chats}", *STREAM]).data, SEQ, 8, seed=3).state_dict()
    data = compose([f"data.source={chats}", *STREAM, changed]).data
    assert stream_facts(data)["stream_source"] != saved["stream_source"]
    with pytest.raises(ConfigError) as err:
        ExampleStreamBatches(data, SEQ, 8, seed=3).load_state_dict(saved | {"step": 2})
    (problem,) = err.value.problems
    assert problem.key == "data.streaming" and changed.split("=")[0] in problem.rule


def test_streamed_text_keeps_its_identity(tmp_path):
    """Streamed text: source and tokenizer only, so the checkpoints of earlier versions still resume."""
    import hashlib

    from partrain.data.corpus import Corpus
    from partrain.data.stream_facts import stream_facts

    (tmp_path / "a.txt").write_text("some text " * 50)
    data = compose([f"data.source={tmp_path}", "data.streaming=true", "data.tokenizer=byte"]).data
    inputs = {"source": Corpus.from_config(data).identity(), "tokenizer": stream_facts(data)["tokenizer"]}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    assert stream_facts(data)["stream_source"] == digest


def test_what_a_stream_cannot_do_is_exit_2(chats):
    with pytest.raises(ConfigError) as err:
        validate(compose([f"data.source={chats}", "data.format=chat", "data.streaming=true"]))
    assert {p.key for p in err.value.problems} >= {"data.packing", "data.long_examples"}
    validate(compose([f"data.source={chats}", "data.format=chat", *STREAM]))  # accepted
