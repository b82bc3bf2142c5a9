"""No silent fallbacks (issue 45 item 7, item 6): a mistyped key points at the key meant, a user's source
is read whole unless data.max_bytes says otherwise (and then the cut is said)."""

from __future__ import annotations

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.names import nearest_key
from partrain.data.corpus import BUILTIN_BYTES, Corpus, cut_note
from partrain.errors import ConfigError


@pytest.mark.parametrize(
    "typed, meant",
    [
        ("cluster.num_nodes", "cluster.nodes"),
        ("cluster.gpus_per_node", "cluster.devices_per_node"),
        ("parallel.tensor_parallel", "parallel.tp"),
        ("parallel.pipeline_parallel_size", "parallel.pp"),
        ("parallel.context_parallel", "parallel.sp"),
        ("train.max_steps", "train.steps"),
        ("optim.learning_rate", "optim.lr"),
        ("parallel.zero_stag", "parallel.zero_stage"),
        ("train.stpes", "train.steps"),
    ],
)
def test_did_you_mean_points_at_the_key_meant(typed, meant):
    with pytest.raises(ConfigError) as err:
        compose([f"{typed}=2"])
    (problem,) = err.value.problems
    assert problem.key == typed and problem.fix == f"did you mean {meant}?"


def test_a_stem_match_beats_a_spelling_match():
    assert nearest_key("num_nodes", ["nodes", "min_nodes", "node_rank"]) == "nodes"
    assert nearest_key("nodes_count", ["min_nodes", "node_rank"]) == "min_nodes"  # the only key with the word
    assert nearest_key("zzz", ["nodes"]) is None


def test_a_users_source_is_read_whole_by_default_and_a_cut_is_said(tmp_path, cli):
    source = tmp_path / "corpus.txt"
    source.write_text("the cat sat on the mat. " * 20_000)  # 480 KB
    default = compose([f"data.source={source}"]).data
    assert Corpus.from_config(default).max_bytes == 0 and cut_note(default) is None
    assert Corpus.from_config(compose([]).data).max_bytes == BUILTIN_BYTES  # the builtin corpus: its first 8 MB
    capped = compose([f"data.source={source}", "data.max_bytes=100000"]).data
    note = cut_note(capped)
    assert "data.max_bytes=100000 reads the first 100,000 bytes" in note and "480,000 bytes" in note
    ran = cli("train", f"data.source={source}", "data.max_bytes=100000", "train.seq_len=64", "--dry-run", "--json")
    assert ran.code == 0, ran.stderr
    assert f"note: {note}" in ran.stderr
