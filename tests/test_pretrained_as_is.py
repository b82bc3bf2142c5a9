"""model.pretrained=DIR takes DIR as it is: its config (arch and sizes), its name and its tokenizer;
only model.config keys given on the command line or in a recipe override it (blueprint/config/pretrained.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A small Llama save_pretrained folder (config only: composition and validation read no weights)
    with a tokenizer_config.json beside it, as a fine-tuning checkpoint ships."""
    folder = tmp_path_factory.mktemp("pretrained") / "tiny-chat-llama"
    folder.mkdir()
    config = dict(
        model_type="llama",
        vocab_size=300,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return folder


def test_the_folder_config_is_the_model_whatever_the_model_group(llama_folder):
    for group in ([], ["model=gpt2-tiny"], ["model=llama-tiny"], ["recipe=gpt-dp"]):
        v = validate(compose([*group, f"model.pretrained={llama_folder}"]))
        assert v.run.model.arch == "llama" and v.run.model.config == {}, group
        assert (v.facts.hidden, v.facts.n_layers, v.facts.heads, v.facts.kv_heads, v.facts.vocab) == (96, 3, 6, 2, 300)
        assert v.run.model.name == "tiny-chat-llama"
        assert v.run.data.tokenizer == str(llama_folder), "the folder's own tokenizer is the default"


def test_command_line_keys_still_override_and_stay_in_the_config(llama_folder):
    run = compose([f"model.pretrained={llama_folder}", "model.config.num_hidden_layers=2", "model.name=mine"])
    assert run.model.config == {"num_hidden_layers": 2} and run.model.name == "mine"
    assert validate(run).facts.n_layers == 2


def test_an_explicit_tokenizer_or_a_folder_without_one(llama_folder, tmp_path):
    assert compose([f"model.pretrained={llama_folder}", "data.tokenizer=byte"]).data.tokenizer == "byte"
    bare = tmp_path / "bare"
    bare.mkdir()
    config = json.loads((llama_folder / "config.json").read_text())
    (bare / "config.json").write_text(json.dumps({**config, "vocab_size": 256}))  # a byte-vocabulary model
    assert compose([f"model.pretrained={bare}"]).data.tokenizer == "byte"
    (bare / "config.json").write_text(json.dumps(config))  # 300 ids: made for another tokenizer
    with pytest.raises(ConfigError) as err:
        compose([f"model.pretrained={bare}"])
    (problem,) = err.value.problems
    assert problem.key == "model.pretrained" and "vocab_size=300" in problem.rule and "data.tokenizer=" in problem.fix
    assert compose([f"model.pretrained={bare}", "data.tokenizer=byte"]).data.tokenizer == "byte"  # by name
    assert compose([]).data.tokenizer == "byte", "without a pretrained model, auto is the byte tokenizer"


def test_an_explicit_arch_of_another_family_is_refused_naming_both(llama_folder):
    with pytest.raises(ConfigError) as err:
        validate(compose([f"model.pretrained={llama_folder}", "model.arch=gpt2"]))
    (problem,) = err.value.problems
    assert problem.key == "model.arch" and "'llama'" in problem.rule and "drop model.arch" in problem.fix


def test_a_recipe_model_config_counts_as_explicit(llama_folder, tmp_path):
    (tmp_path / "ft.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: llama-tiny\nmodel:\n  config:\n    num_hidden_layers: 1\n"
    )
    run = compose(["recipe=ft", f"model.pretrained={llama_folder}"], recipe_dirs=[tmp_path])
    assert run.model.config == {"num_hidden_layers": 1} and run.model.arch == "llama"


def test_a_folder_without_config_json_is_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        validate(compose([f"model.pretrained={tmp_path}"]))
    assert err.value.problems[0].key == "model.pretrained" and "config.json" in err.value.problems[0].rule


@pytest.fixture(scope="module")
def bpe_tokenizer(tmp_path_factory) -> Path:
    """A small BPE tokenizer (a few hundred ids) saved with save_pretrained, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel()
    words = [f"word{i} token{i * 7} text{i % 13}" for i in range(400)]
    core.train_from_iterator(words, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    folder = tmp_path_factory.mktemp("bpe") / "tok"
    PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", unk_token="<unk>").save_pretrained(folder)
    return folder


def test_built_from_config_the_vocabulary_follows_the_tokenizer(bpe_tokenizer):
    from partrain.blueprint.config.pretrained import VOCAB_MULTIPLE
    from partrain.data.tokenizer import load_tokenizer

    size = load_tokenizer(str(bpe_tokenizer)).vocab_size
    assert size > 256
    run = compose(["model=llama-tiny", f"data.tokenizer={bpe_tokenizer}"])
    vocab = run.model.config["vocab_size"]
    assert vocab >= size and vocab % VOCAB_MULTIPLE == 0 and vocab - size < VOCAB_MULTIPLE
    assert validate(compose([f"data.tokenizer={bpe_tokenizer}", "parallel.tp=2", "cluster.devices_per_node=2"]))
    # Given on the command line, the vocabulary is the user's (the launch then refuses it if too small).
    assert compose([f"data.tokenizer={bpe_tokenizer}", "model.config.vocab_size=512"]).model.config["vocab_size"] == 512


def test_built_from_config_the_positions_follow_the_sequence_unless_given():
    run = compose(["recipe=gpt-3d", "train.seq_len=2048"])
    assert run.model.config["n_positions"] == 2048 and validate(run).facts.max_positions == 2048
    assert compose(["recipe=gpt-3d"]).model.config["n_positions"] == 512, "a shorter sequence changes nothing"
    with pytest.raises(ConfigError, match="maximum positions"):
        validate(compose(["recipe=gpt-3d", "train.seq_len=2048", "model.config.n_positions=1024"]))


def test_the_report_names_the_folder_and_the_keys_that_override_it(llama_folder):
    from rich.console import Console

    from partrain.blueprint.report.layout import layout_report, render_layout

    report = layout_report(validate(compose([f"model.pretrained={llama_folder}", "model.config.num_hidden_layers=2"])))
    assert report["pretrained"] == {
        "folder": str(llama_folder),
        "config_overrides": {"num_hidden_layers": 2},
        "tokenizer": str(llama_folder),
    }
    console = Console(width=300, record=True)
    render_layout(report, console)
    text = console.export_text()
    assert "overridden here: num_hidden_layers=2; tokenizer: its own" in text
    assert layout_report(validate(compose([]))).get("pretrained") is None


def test_a_folder_of_an_unsupported_family_is_named_as_that_folder(tmp_path):
    """Issue 45 item 7: the user gave a folder, not model.arch; the message names the folder's config.json."""
    folder = tmp_path / "rwkv"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "rwkv", "vocab_size": 256, "hidden_size": 32}))
    with pytest.raises(ConfigError) as err:
        validate(compose([f"model.pretrained={folder}"]))
    (problem,) = err.value.problems
    assert problem.key == "model.pretrained" and "config.json has model_type='rwkv'" in problem.rule
    assert "families.md" in problem.fix
