"""Hub ids and `datasets` sources, offline: a Hub-style cache (HF_HOME with
`hub/models--org--name/snapshots/<commit>` and `refs/main`) built in tmp_path, HF_HUB_OFFLINE=1,
a `datasets` save_to_disk folder and a Hub dataset snapshot of parquet files. Nothing downloads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
DATA_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
TEXTS = [f"the cat number {i % 20} sat on the mat and the dog ran to the park {i % 7}" for i in range(400)]


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="[UNK]").save_pretrained(folder)


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """HF_HOME holding org/tiny-llama (config, safetensors, tokenizer) and the dataset org/texts."""
    import torch
    from datasets import Dataset, DatasetDict
    from transformers import LlamaConfig, LlamaForCausalLM

    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / "models--org--tiny-llama"
    snap = repo / "snapshots" / COMMIT
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    LlamaForCausalLM(config).save_pretrained(snap)
    _tokenizer(snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)

    data_repo = home / "hub" / "datasets--org--texts"
    (data_repo / "snapshots" / DATA_COMMIT / "data").mkdir(parents=True)
    Dataset.from_dict({"text": TEXTS}).to_parquet(
        str(data_repo / "snapshots" / DATA_COMMIT / "data" / "train-00000-of-00001.parquet")
    )
    Dataset.from_dict({"text": ["held out"] * 3}).to_parquet(
        str(data_repo / "snapshots" / DATA_COMMIT / "data" / "test-00000-of-00001.parquet")
    )
    (data_repo / "refs").mkdir()
    (data_repo / "refs" / "main").write_text(DATA_COMMIT)

    disk = home / "on-disk"
    DatasetDict({"train": Dataset.from_dict({"text": TEXTS}), "test": Dataset.from_dict({"text": ["x"]})}).save_to_disk(
        str(disk)
    )
    return home


def _env(home: Path) -> dict:
    return dict(os.environ, HF_HOME=str(home), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


TRAIN = [
    "recipe=gpt-dp",
    "model=llama-tiny",
    "model.pretrained=org/tiny-llama",
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.max_position_embeddings=256",
    "model.config.eos_token_id=1",
    "data.tokenizer=org/tiny-llama",
    "parallel.dp=1",
    "cluster.devices_per_node=1",
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "train.eval_batches=0",
    "train.steps=5",
]


@pytest.mark.slow
def test_a_run_on_a_hub_cache_model_and_a_datasets_folder_trains_offline(hub_home, tmp_path):
    run_dir = tmp_path / "run"
    args = [*TRAIN, f"data.source={hub_home / 'on-disk'}", f"data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *args, f"train.run_dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(hub_home),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 5
    hub = json.loads((run_dir / "hub.json").read_text())
    for key in ("model.pretrained", "data.tokenizer"):
        assert hub[key]["repo"] == "org/tiny-llama" and hub[key]["commit"] == COMMIT, hub


def test_a_missing_hub_id_exits_2_before_anything_starts(hub_home, run_partrain):
    ran = run_partrain(
        "train", "recipe=gpt-dp", "model.pretrained=org/nope", "data.tokenizer=org/tiny-llama@nope", env=_env(hub_home)
    )
    assert ran.code == 2 and not ran.spawned, ran.stderr
    text = " ".join(ran.stderr.split())
    assert "model.pretrained='org/nope'" in text and "HF_HUB_OFFLINE=1" in text, text
    assert "data.tokenizer='org/tiny-llama@nope'" in text, text


def test_hub_dataset_id_and_save_to_disk_folder_give_their_split(hub_home, monkeypatch):
    from huggingface_hub import constants

    from partrain.blueprint.config.compose import compose
    from partrain.data.corpus import Corpus
    from partrain.preflight.hub import hub_record, resolve_hub_ids

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(hub_home / "datasets-cache"))
    run = resolve_hub_ids(compose(["data.source=org/texts", "data.max_bytes=0"]))
    assert hub_record(run)["data.source"]["commit"] == DATA_COMMIT
    for streaming in (False, True):
        data = dict(run.data.__dict__, streaming=streaming)
        assert list(Corpus.from_config(type(run.data)(**data)).documents()) == TEXTS
        disk = dict(data, source=str(hub_home / "on-disk"))
        assert list(Corpus.from_config(type(run.data)(**disk)).documents()) == TEXTS
    test_split = dict(run.data.__dict__, split="test")
    assert list(Corpus.from_config(type(run.data)(**test_split)).documents()) == ["held out"] * 3

    from partrain.data.streaming import StreamBatches  # data.streaming trains from the IterableDataset

    streamed = type(run.data)(**dict(run.data.__dict__, streaming=True))
    inputs, labels = StreamBatches(streamed, 16, 4, seed=1).rank_batch(0)
    assert inputs.shape == labels.shape == (4, 16)
    text = bytes(inputs[0].tolist()).decode(errors="replace")
    assert any(word in text for word in ("the", "cat", "dog", "mat", "park", "number")), text
