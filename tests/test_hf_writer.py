"""The HF export's file writer (checkpoint/hf_shards.write_file) over torch DCP's
HuggingFaceStorageWriter: several batches become one safetensors file in the given order, with
save_pretrained's format metadata; views of one fused tensor are written apart; a full disk surfaces
as the OSError itself and leaves no file or scratch folder; a model in memory (the LoRA merged
export's path) round-trips through from_pretrained with Mixtral's per-expert save format. One
process, no process group."""

from __future__ import annotations

import errno
import json
import struct

import pytest
import torch


def _header(path):
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(size))


def test_batches_become_one_file_in_order(tmp_path):
    from safetensors import safe_open

    from partrain.checkpoint.hf_shards import own_storage, write_file

    fused = torch.randn(4, 3, 5)
    batches = [
        {"b.weight": torch.randn(7, 2), "a.bias": torch.randn(7)},
        {f"e.{k}.weight": own_storage(fused[k]) for k in range(4)},  # views of one tensor, made apart
        {"z.weight": torch.randn(3, 3).to(torch.bfloat16)},
    ]
    expected = {k: v.clone() for b in batches for k, v in b.items()}
    file = tmp_path / "model.safetensors"
    assert write_file(file, iter(batches)) == len(expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # scratch folders gone
    assert list(_header(file)) == ["__metadata__", *expected]  # the order given
    small = tmp_path / "small.safetensors"  # a header with no room for the metadata: written longer
    write_file(small, iter([{"w": torch.arange(3.0)}]))
    for path, tensors in ((file, expected), (small, {"w": torch.arange(3.0)})):
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == {"format": "pt"}  # as save_pretrained writes it
            for key, value in tensors.items():
                assert f.get_tensor(key).dtype == value.dtype and torch.equal(f.get_tensor(key), value), key


def test_a_full_disk_raises_the_oserror_and_leaves_nothing(tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from partrain.checkpoint.hf_shards import write_file

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", no_space)
    with pytest.raises(OSError) as raised:
        write_file(tmp_path / "model.safetensors", iter([{"w": torch.ones(2)}]))
    assert raised.value.errno == errno.ENOSPC
    assert list(tmp_path.iterdir()) == []


def test_a_model_in_memory_round_trips_with_the_per_expert_format(tmp_path):
    from transformers import AutoModelForCausalLM, MixtralConfig

    from partrain.checkpoint.hf_export import merged_batches
    from partrain.checkpoint.hf_shards import write_file

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    write_file(tmp_path / "model.safetensors", merged_batches(model, torch.float32, limit=4096))
    model.config.save_pretrained(tmp_path)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in _header(tmp_path / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
