"""The dry run covers fine-tuning (issue 37 item 7): the detected format, the template, the masked share
of the first global batches and the adapters' parameters and memory, in the text report and in --json;
a fine-tuning problem is exit 2 before any process in --dry-run, --dry-run --check and train alike.
In-process through the real CLI (conftest's `cli`: process starts refused and recorded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

CHATS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": str(2 * i)},
        ]
    }
    for i in range(50)
]
ONE = ["cluster.devices_per_node=1", "parallel.dp=1", "train.seq_len=160", "train.global_batch_size=8"]
ONE += ["train.micro_batch_size=8", "data.eval_fraction=0.2"]


@pytest.fixture
def chats(tmp_path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in CHATS))
    return path


def _report(ran) -> dict:
    assert ran.code == 0, ran.stdout + ran.stderr
    assert ran.spawned == [] and ran.created() == [], (ran.spawned, ran.created())
    return json.loads(ran.stdout)


def test_the_report_names_format_template_masked_share_and_adapters(cli, chats, tmp_path):
    args = ["recipe=sft-lora", f"data.source={chats}", "data.format=auto", "data.packing=false", *ONE]
    args += [f"data.cache_dir={tmp_path / 'cache'}"]
    section = _report(cli("train", "--dry-run", "--json", *args))["fine_tuning"]
    data, adapters = section["data"], section["adapters"]
    assert (data["format"], data["detected"], data["template"]) == ("chat", True, "chatml (data.chat_template)")
    assert (data["examples_train"], data["examples_eval"]) == (40, 10)
    first = data["first_batches"]
    # one padded row per example: each trains its answer and <|im_end|>, the rest of the row is masked
    trained_per_row = [len(str(2 * i)) + len("<|im_end|>") for i in range(50)]
    assert min(trained_per_row) * 8 * first["steps"] <= first["trained"] <= max(trained_per_row) * 8 * first["steps"]
    assert first["masked_share"] == pytest.approx(1 - first["trained"] / first["tokens"])
    assert not (tmp_path / "cache").exists()

    transformers, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    from partrain.blueprint.config.compose import compose

    config = transformers.LlamaConfig(**compose(["model=llama-tiny"]).model.config)
    model = peft.get_peft_model(
        transformers.LlamaForCausalLM(config),
        peft.LoraConfig(r=adapters["r"], lora_alpha=adapters["alpha"], target_modules=adapters["target_modules"]),
    )
    assert adapters["params"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert adapters["memory_bytes"] == 16 * adapters["params"]

    text = cli("train", "--dry-run", *args)
    assert text.code == 0, text.stdout + text.stderr
    for words in ("fine-tuning data", "detected from the first row", "masked tokens", "65,536 trainable parameters"):
        assert words in text.stdout, text.stdout
    plan = _report(cli("plan", "--json", "recipe=sft-lora"))["fine_tuning"]
    assert plan["data"] is None and plan["adapters"] == adapters, "plan reads no data but counts the adapters"


def test_no_template_is_exit_2_before_any_process_in_every_command(chats, tmp_path, monkeypatch):
    from conftest import refuse_process_starts
    from typer.testing import CliRunner

    from partrain.cli import app

    spawned, _ = refuse_process_starts(monkeypatch)  # the real launcher: its preflight runs, no process starts
    monkeypatch.setenv("HOME", str(tmp_path))
    args = ["model=llama-tiny", f"data.source={chats}", "data.packing=false", *ONE]
    args += [f"data.cache_dir={tmp_path / 'cache'}", f"train.run_dir={tmp_path / 'run'}"]
    for extra in (["--dry-run"], ["--dry-run", "--check"], []):
        ran = CliRunner().invoke(app, ["train", *extra, "--json", *args])
        assert ran.exit_code == 2 and spawned == [], (ran.exit_code, ran.output, spawned)
        assert [e["key"] for e in json.loads(ran.stdout)["errors"]] == ["data.chat_template"]
