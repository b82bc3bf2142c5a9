"""`data.streaming=true`: batches tokenized on the fly (partrain.data.streaming).

In-process: batches are a function of the seed and step only (a second stream, and a replay after
going back, give the same tensors), ranks' rows put together are the global batch, eval windows are
never trained on, a short corpus and a mismatched resume are ConfigErrors naming the key. Real runs
(slow): gpt-dp streamed on 2 processes matches the one-process streamed run (1e-5), writes no token
cache, and a resume from its step-3 checkpoint continues with the same losses.
"""

from __future__ import annotations

import json

import pytest
import torch

from partrain.blueprint.config.compose import compose
from partrain.errors import ConfigError
from partrain.rehearse.runs import train_all
from partrain.testing.parity import (
    check_parity,
    max_relative_difference,
    parity_args,
    reference_overrides,
    run_training,
)


@pytest.fixture
def numbered_corpus(tmp_path):
    """Documents that are all different, so a window's text tells where it came from."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i:05d} " + "abc " * (i % 7)}) + "\n" for i in range(600)))
    return path


def _data(source, *extra):
    return compose(["recipe=gpt-dp", f"data.source={source}", "data.streaming=true", "data.max_bytes=0", *extra]).data


def test_streamed_batches_depend_on_seed_and_step_only_and_split_over_ranks(numbered_corpus):
    from partrain.data.streaming import StreamBatches

    data = _data(numbered_corpus)
    first = StreamBatches(data, 32, 8, seed=7)
    wanted = [first.global_batch(s).clone() for s in range(140)]  # 524 windows a pass: 2 passes and more
    again = StreamBatches(data, 32, 8, seed=7)
    assert torch.equal(again.global_batch(130), wanted[130])
    assert torch.equal(again.global_batch(3), wanted[3])  # an earlier step replays the stream
    assert not torch.equal(StreamBatches(data, 32, 8, seed=8).global_batch(3), wanted[3])
    inputs, labels = first.rank_batch(5, 0, 1)
    parts = [first.rank_batch(5, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
    assert torch.equal(torch.cat([p[1] for p in parts]), labels)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_eval_windows_are_held_out_of_training(numbered_corpus):
    from partrain.data.streaming import open_stream

    batches, evals = open_stream(_data(numbered_corpus), 32, 4, seed=1, eval_batches=2)
    held = {tuple(row.tolist()) for i in range(2) for row in torch.cat(evals.eval_batch(i), dim=1)}
    assert len(held) == 8
    trained = {tuple(row.tolist()) for s in range(300) for row in torch.cat(batches.rank_batch(s), dim=1)}  # 2+ passes
    assert not held & trained


def test_a_short_stream_and_a_mismatched_resume_are_config_errors(numbered_corpus):
    from partrain.data.streaming import StreamBatches

    short = StreamBatches(_data(numbered_corpus, "data.max_bytes=2000"), 64, 64, seed=1)
    with pytest.raises(ConfigError) as err:
        short.global_batch(0)
    assert err.value.problems[0].key == "train.seq_len" and "streamed" in err.value.problems[0].rule
    state = StreamBatches(_data(numbered_corpus), 32, 8, seed=1).state_dict()
    with pytest.raises(ConfigError) as err:
        StreamBatches(_data(numbered_corpus), 32, 8, seed=2).load_state_dict(state)
    assert err.value.problems[0].key == "train.seed"
    with pytest.raises(ConfigError) as err:
        StreamBatches(_data(numbered_corpus), 32, 8, seed=1).load_state_dict({**state, "stream_source": None})
    assert err.value.problems[0].key == "data.streaming"


STREAMED = [
    "recipe=gpt-dp",
    "data.streaming=true",
    "data.max_bytes=300000",
    "train.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
]


@pytest.mark.slow
def test_streamed_dp2_matches_one_process_writes_no_cache_and_resumes_exactly(tmp_path):
    cache = tmp_path / "cache"
    base = [*STREAMED, f"data.cache_dir={cache}"]
    dp2 = [*base, "parallel.dp=2", "cluster.devices_per_node=2", "checkpoint.every_steps=3"]
    # Both in real processes through the worker's code (one forked launch each); the resume below
    # goes through `partrain train` itself.
    runs = train_all({"ref": parity_args(reference_overrides(base), 6), "dp2": parity_args(dp2, 6)}, tmp_path)
    reference, got = runs["ref"], runs["dp2"]
    print("streamed dp2 vs one process:", check_parity(reference, got))
    assert not cache.exists() or not any(cache.rglob("*.bin")), "a streaming run wrote a token cache"
    assert json.loads((got.run_dir / "stream.json").read_text())["format"].startswith("stream-")

    ckpt = got.run_dir / "checkpoints" / "step-00000003"
    resumed = run_training([*dp2, f"checkpoint.resume={ckpt}"], tmp_path / "resumed", 6)
    assert len(resumed.losses) == 3
    diff = max_relative_difference(got.losses[3:], resumed.losses)
    print(f"streamed resume from step 3: max relative loss difference {diff:.2e}")
    assert diff <= 1e-6
