"""HF export at scale: shards written by several processes from a real llama-fsdp-tp run's checkpoint
(dp2 x tp2, FSDP + TP + sequence parallel), a run's own export at its end (checkpoint.export_hf),
and the bf16 export. gpt-3d's checkpoint is exported in tests/test_resume.py (it shares that run)."""

from __future__ import annotations

import json

import pytest
import torch

from partrain.rehearse.runs import train_all
from partrain.testing.hf_check import export_with_cli, logits_difference
from partrain.testing.parity import parity_args

pytestmark = pytest.mark.slow

LLAMA = [
    "recipe=llama-fsdp-tp",
    "train.seq_len=32",
    "data.max_bytes=200000",
    "checkpoint.every_steps=2",
    "checkpoint.export_hf=true",
]
MIB = 1 << 20
CONSTANT = 96 * MIB
"""What an exporting process may hold beyond 1.5x its shard: one read batch and DCP's buffers."""


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """llama-fsdp-tp for 2 steps in real processes through the worker's code (testing.in_process)."""
    base = tmp_path_factory.mktemp("llama-fsdp-tp")
    return train_all({"llama": parity_args(LLAMA + [f"data.cache_dir={base / 'cache'}"], 2)}, base)["llama"].run_dir


def test_llama_fsdp_tp_checkpoint_exports_with_four_processes(llama_run, tmp_path):
    ckpt = llama_run / "checkpoints" / "step-00000002"
    out = tmp_path / "hf"
    report = export_with_cli(ckpt, out, nproc=4)
    names = [f"model-{k:05d}-of-00004.safetensors" for k in range(1, 5)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == names
    assert sum(s["tensors"] for s in report["shards"]) == len(index["weight_map"])
    assert sum(s["bytes"] for s in report["shards"]) == index["metadata"]["total_size"]
    for shard in report["shards"]:  # no process held more than its own shard (plus a constant)
        held = shard["peak_rss_bytes"] - shard["rss_before_bytes"]
        print(f"shard {shard['index']}: {shard['bytes'] / MIB:.2f} MiB, held {held / MIB:.1f} MiB")
        assert held <= 1.5 * shard["bytes"] + CONSTANT, shard
    assert logits_difference(out, ckpt) == 0.0
    # The run's own export (checkpoint.export_hf=true): the same weights.
    assert (llama_run / "hf" / "config.json").is_file()
    assert logits_difference(llama_run / "hf", ckpt) == 0.0
    assert json.loads((llama_run / "summary.json").read_text())["hf_export"] == str(llama_run / "hf")


def test_bf16_export_casts_every_weight(llama_run, tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig

    from partrain.checkpoint import export_hf, load_model_weights

    ckpt = llama_run / "checkpoints" / "step-00000002"
    out = export_hf(ckpt, tmp_path / "hf", dtype="bf16")
    reference = load_model_weights(ckpt)[0].state_dict()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(reference)
        for key in f.keys():
            value = f.get_tensor(key)
            assert value.dtype == torch.bfloat16 and torch.equal(value, reference[key].to(torch.bfloat16)), key
    assert AutoConfig.from_pretrained(out, local_files_only=True).dtype == torch.bfloat16
