"""Streamed fine-tuning rows (data.streaming=true, issue 37 item 2) trained for real: dp2 (DDP, 2
microbatches per rank of uneven label counts) matches one process step for step, since every rank renders
the same global batch and normalises by its label count. One launch per process count (train_all)."""

from __future__ import annotations

import json

import pytest

from partrain.rehearse.runs import train_all
from partrain.testing.parity import check_parity, parity_args, reference_overrides

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    chats = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"{i}?"}, {"role": "assistant", "content": "ok " * (1 + i % 11)}]}
        for i in range(64)
    ]
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["model=llama-tiny", f"data.source={chats}", "data.chat_template=chatml", "data.streaming=true"]
    base += ["data.packing=false", "data.long_examples=truncate", "train.seq_len=64", "train.global_batch_size=8"]
    base += ["optim.lr=2e-3", "optim.warmup_steps=0", "optim.schedule=constant"]
    cases = {
        "reference": parity_args(reference_overrides(base + ["train.micro_batch_size=8"]), STEPS),
        "stream-ddp2": parity_args(
            base
            + ["parallel.dp=2", "parallel.tp=1", "parallel.zero_stage=0", "train.micro_batch_size=2"]
            + ["cluster.devices_per_node=2"],
            STEPS,
        ),
    }
    return train_all(cases, tmp_path_factory.mktemp("runs"))


def test_streamed_examples_dp2_match_one_process(runs):
    got = runs["stream-ddp2"]
    print(check_parity(runs["reference"], got))
    assert got.losses[-1] < got.losses[0]
