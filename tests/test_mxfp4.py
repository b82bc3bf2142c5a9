"""gpt-oss as released stores its routed experts in MXFP4: each expert weight as `<name>_blocks` (two 4-bit
E2M1 codes a byte, 32 values a block) and `<name>_scales` (one power-of-two exponent a block, biased by 127),
transposed ([E, out, in] on disk for the [E, in, out] parameter). partrain dequantizes them on load
(partrain.models.pretrained) and trains the dequantized weights; the preflight's shape check reads them too.

The oracle here is the format itself (the OCP Microscaling spec's E2M1 code table, low nibble first), not
the function partrain calls: a folder is written from codes and exponents chosen here, and every loaded
expert weight must equal the values those codes mean."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from partrain.blueprint.config.schema import ModelConfig
from partrain.errors import ConfigError
from partrain.models.build import build_meta_model, hf_config
from partrain.models.materialize import materialize
from partrain.preflight.weights import weight_problems

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
"""The value of each 4-bit code (sign bit, two exponent bits, one mantissa bit)."""
GPT_OSS = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=32,
    tie_word_embeddings=False,
)


def _mxfp4(codes: torch.Tensor, exponents: torch.Tensor) -> tuple:
    """(blocks, scales) as the released files hold them; codes [E, rows, groups, 32], exponents [E, rows, groups]."""
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponents + 127).to(torch.uint8)


def _meaning(codes: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    """The [E, in, out] weight the codes stand for."""
    values = torch.tensor(E2M1)[codes] * torch.exp2(exponents.float()).unsqueeze(-1)
    experts, rows, groups, width = codes.shape
    return values.reshape(experts, rows, groups * width).transpose(1, 2)


def _with_quantization(folder, quantization: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization
    (folder / "config.json").write_text(json.dumps(config))


def test_released_gpt_oss_experts_in_mxfp4_load_dequantized(tmp_path):
    model_cfg = ModelConfig(arch="gpt_oss", config=GPT_OSS)
    materialize(build_meta_model(model_cfg), model_cfg, seed=3, device="cpu").save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    expected, generator = {}, torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        codes = torch.randint(0, 16, (experts, outputs, inputs // 32, 32), generator=generator)
        exponents = torch.randint(-4, 3, (experts, outputs, inputs // 32), generator=generator)
        tensors[name + "_blocks"], tensors[name + "_scales"] = _mxfp4(codes, exponents)
        expected[name] = _meaning(codes, exponents)
    assert len(expected) == 4  # two layers, two expert weights each
    save_file(tensors, tmp_path / "model.safetensors")
    _with_quantization(tmp_path, {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]})

    pretrained = ModelConfig(arch="gpt_oss", pretrained=str(tmp_path))
    assert weight_problems(pretrained) == []  # the preflight reads the packed shapes
    loaded = materialize(build_meta_model(pretrained), pretrained, seed=0, device="cpu")
    for name, value in expected.items():
        assert torch.equal(loaded.get_parameter(name), value), name
    for name, value in tensors.items():  # everything else as stored
        if not name.endswith(("_blocks", "_scales")):
            assert torch.equal(loaded.state_dict()[name], value.float()), name
    # What trains is dense: the model's config (and so an export's config.json) names no quantization.
    assert getattr(hf_config(pretrained), "quantization_config", None) is None


def test_a_release_quantized_otherwise_is_refused_naming_the_folder(tmp_path):
    model_cfg = ModelConfig(arch="gpt_oss", config=GPT_OSS)
    materialize(build_meta_model(model_cfg), model_cfg, seed=3, device="cpu").save_pretrained(tmp_path)
    _with_quantization(tmp_path, {"quant_method": "bitsandbytes", "load_in_4bit": True})
    with pytest.raises(ConfigError) as refused:
        hf_config(ModelConfig(arch="gpt_oss", pretrained=str(tmp_path)))
    problem = refused.value.problems[0]
    assert problem.key == "model.pretrained" and "bitsandbytes" in problem.rule and "unquantized" in problem.fix
