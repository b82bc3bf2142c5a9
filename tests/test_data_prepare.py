"""`partrain data prepare OVERRIDES` (issue 45 item 6): the run's data tokenized into the cache before a
launch, exactly the entry `train` with the same overrides then opens."""

from __future__ import annotations

import json

from partrain.blueprint.config.compose import compose
from partrain.data.prepare import prepare_data


def test_prepare_writes_the_entry_train_then_opens(cli, tmp_path):
    source = tmp_path / "corpus.txt"
    source.write_text("the cat sat on the mat. " * 4000)
    overrides = [f"data.source={source}", f"data.cache_dir={tmp_path / 'cache'}", "train.seq_len=64"]
    ran = cli("data", "prepare", *overrides, "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    report = json.loads(ran.stdout)
    meta = tmp_path / "cache" / report["meta_path"].split("/cache/", 1)[1]
    assert meta.is_file() and report["entry"]["n_train_tokens"] > 0
    before = meta.stat().st_mtime_ns
    assert str(prepare_data(compose(overrides).data).meta_path) == report["meta_path"]  # what the launch opens
    assert meta.stat().st_mtime_ns == before  # found, not written again
    again = cli("data", "prepare", *overrides)
    assert again.code == 0 and "reuses it" in again.stdout and again.spawned == []


def test_prepare_refuses_a_stream_and_bad_data_like_the_launch(cli, tmp_path):
    ran = cli("data", "prepare", "data.streaming=true")
    assert ran.code == 2 and "data.streaming" in ran.stderr and "nothing is prepared ahead" in ran.stderr
    short = tmp_path / "short.txt"
    short.write_text("too short")
    ran = cli("data", "prepare", f"data.source={short}", f"data.cache_dir={tmp_path / 'cache'}")
    assert ran.code == 2 and "fewer than one batch" in ran.stderr
