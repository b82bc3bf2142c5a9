"""Model layer: HF config, meta build, layout-independent init, pretrained load, adapters, loss.

Tiny fp32 models (hidden 64, 2 layers, vocab 256) on CPU. The multi-process test runs FSDP2 and
tensor parallelism on 2 gloo processes and compares gathered weights with a 1-process run.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from partrain.blueprint.config.schema import ModelConfig
from partrain.blueprint.model_facts import SUPPORTED_ARCHS
from partrain.errors import ConfigError
from partrain.models.adapters import ADAPTERS, get_adapter
from partrain.models.build import build_meta_model, hf_config
from partrain.models.loss import IGNORE_INDEX, forward_loss
from partrain.models.materialize import materialize
from partrain.models.random_init import name_seed
from partrain.runtime.lifecycle import joined_group, leave

VOCAB = 256
_LLAMA_LIKE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=128,
)
TINY = {
    # dropout off so forward passes are comparable; bos/eos inside the tiny vocabulary
    "gpt2": dict(
        n_embd=64,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=128,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    ),
    "llama": _LLAMA_LIKE,  # GQA: 2 KV heads for 4 query heads
    "qwen2": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "mixtral": dict(_LLAMA_LIKE, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(
        _LLAMA_LIKE,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    ),  # layer 1 has a dense MLP
    "qwen3_moe": dict(
        _LLAMA_LIKE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=32, mlp_only_layers=[1]
    ),  # q/k norms; head_dim 32 != hidden / heads; layer 1 dense
}
ARCHS = list(TINY)


def tiny(arch: str, **overrides) -> ModelConfig:
    return ModelConfig(arch=arch, config={**TINY[arch], **overrides}, name=f"{arch}-tiny")


def built(model_cfg: ModelConfig, seed: int = 0):
    return materialize(build_meta_model(model_cfg), model_cfg, seed=seed, device="cpu")


def hf_reference(model_cfg: ModelConfig):
    """The same model built the ordinary HF way: allocated on CPU, HF's own init."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hf_config(model_cfg), dtype=torch.float32)


def batch(seed: int = 0, size=(2, 16)):
    return torch.randint(0, VOCAB, size, generator=torch.Generator().manual_seed(seed))


def shifted(ids: torch.Tensor) -> torch.Tensor:
    """Labels as the data pipeline makes them: the next token, IGNORE_INDEX at the end."""
    return F.pad(ids[:, 1:], (0, 1), value=IGNORE_INDEX)


def assert_same_tensors(a, b):
    a, b = dict(a), dict(b)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


# ---- config and build ----------------------------------------------------------------------------


def test_hf_config_training_defaults():
    config = hf_config(tiny("llama"))
    assert config.use_cache is False
    assert config._attn_implementation == "sdpa"
    assert config.num_key_value_heads == 2
    eager = hf_config(ModelConfig(arch="llama", config={**_LLAMA_LIKE, "attn_implementation": "eager"}))
    assert eager._attn_implementation == "eager"


@pytest.mark.parametrize(
    "cfg, key",
    [
        (ModelConfig(arch="llamma", config={}), "model.arch"),
        (ModelConfig(arch="llama", config={**_LLAMA_LIKE, "hiden_size": 32}), "model.config.hiden_size"),
        (ModelConfig(arch="llama", config={**_LLAMA_LIKE, "use_cache": True}), "model.config.use_cache"),
    ],
)
def test_hf_config_errors(cfg, key):
    with pytest.raises(ConfigError) as err:
        hf_config(cfg)
    assert err.value.problems[0].key == key


def test_pretrained_folder_without_safetensors(tmp_path):
    model_cfg = tiny("llama")
    hf_config(model_cfg).save_pretrained(tmp_path)
    model_cfg = ModelConfig(arch="llama", pretrained=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        materialize(build_meta_model(model_cfg), model_cfg, seed=0, device="cpu")
    assert err.value.problems[0].key == "model.pretrained"


@pytest.mark.parametrize("arch", ARCHS)
def test_meta_build_allocates_nothing(arch):
    model = build_meta_model(tiny(arch))
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ---- materialize ---------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_materialize_gives_a_working_model(arch):
    model = built(tiny(arch))
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    ids = batch()
    loss = forward_loss(model, ids, shifted(ids))
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(VOCAB)) < 0.1  # near-uniform prediction at init


@pytest.mark.parametrize("arch", ["llama", "gpt2", "mixtral"])
def test_materialize_is_deterministic(arch):
    a, b, c = built(tiny(arch), seed=3), built(tiny(arch), seed=3), built(tiny(arch), seed=4)
    assert_same_tensors(a.named_parameters(), b.named_parameters())
    assert_same_tensors(a.named_buffers(), b.named_buffers())
    differs = [n for n, p in a.named_parameters() if p.std() > 0 and not torch.equal(p, c.get_parameter(n))]
    assert differs, "another seed must give other random weights"


def test_values_depend_on_the_name_not_on_the_rest_of_the_model():
    """A pipeline stage (here: no embedding) gets the same weights as the full model."""
    model_cfg = tiny("llama")
    full = built(model_cfg)
    stage = build_meta_model(model_cfg)
    stage.model.embed_tokens = None
    materialize(stage, model_cfg, seed=0, device="cpu")
    for name, param in stage.named_parameters():
        assert torch.equal(param, full.get_parameter(name)), name


def test_gpt2_embeddings_stay_tied():
    model = built(tiny("gpt2"))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert get_adapter(model).tied_embeddings(model)


@pytest.mark.parametrize("arch", ARCHS)
def test_init_follows_hf(arch):
    """Per tensor: constants (norms, biases) exactly as HF's init, random ones with HF's std."""
    ours, theirs = built(tiny(arch)), hf_reference(tiny(arch))
    for name, ref in theirs.named_parameters():
        mine = ours.get_parameter(name)
        if ref.numel() == 1 or ref.std() == 0:
            assert torch.equal(mine, ref), name
        else:
            tolerance = max(0.05, 4 / math.sqrt(2 * ref.numel()))  # 4 standard errors of a std estimate
            assert abs(mine.std().item() / ref.std().item() - 1) < tolerance, name
            assert abs(mine.mean().item()) < 4 * ref.std().item() / math.sqrt(ref.numel()) + 1e-6, name


def test_init_std_matches_initializer_range():
    model_cfg = tiny("llama", initializer_range=0.05)
    model = built(model_cfg)
    assert model.model.layers[0].mlp.gate_proj.weight.std().item() == pytest.approx(0.05, rel=0.05)
    gpt2 = built(tiny("gpt2"))
    scaled = 0.02 / math.sqrt(2 * 2)  # GPT-2 residual projections: initializer_range / sqrt(2 n_layer)
    assert gpt2.transformer.h[0].mlp.c_proj.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert gpt2.transformer.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "mixtral", "qwen3_moe"])
def test_rotary_buffers_match_hf(arch):
    model_cfg = tiny(arch, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    assert_same_tensors(built(model_cfg).named_buffers(), hf_reference(model_cfg).named_buffers())


def test_name_seed_is_stable():
    assert name_seed(0, "a.weight") == name_seed(0, "a.weight") != name_seed(1, "a.weight")
    assert name_seed(0, "model.embed_tokens.weight") == 1900915749987320403  # fixed across processes/versions


# ---- pretrained ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_pretrained_round_trip(arch, tmp_path):
    source = built(tiny(arch), seed=11)
    source.save_pretrained(tmp_path, safe_serialization=True)
    assert not list(tmp_path.glob("*.bin"))
    model_cfg = ModelConfig(arch=arch, pretrained=str(tmp_path))
    assert hf_config(model_cfg).use_cache is False  # config.json says True; training overrides it
    loaded = materialize(build_meta_model(model_cfg), model_cfg, seed=99, device="cpu")
    assert_same_tensors(loaded.named_parameters(), source.named_parameters())
    assert_same_tensors(loaded.named_buffers(), source.named_buffers())
    if arch == "gpt2":
        assert loaded.lm_head.weight is loaded.transformer.wte.weight


@pytest.mark.parametrize("arch", ["glm4_moe", "exaone_moe", "ernie4_5_moe", "minimax_m3_vl_text"])
def test_pretrained_round_trip_of_the_generic_moe_path(arch, tmp_path):
    """A folder save_pretrained writes for a family of the generic MoE path (experts one Linear each, or
    fused; ExaONE-MoE's router bias under the block's name) loads every parameter and buffer as saved."""
    from partrain.models import generic_moe_survey

    source = generic_moe_survey._build(arch, generic_moe_survey._kwargs(arch, 0)[0], "cpu")
    with torch.no_grad():
        for _, buffer in source.named_buffers():
            if buffer.is_floating_point() and not buffer.any():  # a zero-initialised selection bias
                buffer.normal_()
    source.save_pretrained(tmp_path)
    model_cfg = ModelConfig(arch=arch, pretrained=str(tmp_path))
    loaded = materialize(build_meta_model(model_cfg), model_cfg, seed=99, device="cpu")
    assert_same_tensors(loaded.named_parameters(), source.named_parameters())
    assert_same_tensors(loaded.named_buffers(), source.named_buffers())


@pytest.mark.parametrize("arch", ["phi", "starcoder2", "olmo"])
def test_pretrained_round_trip_of_the_template_path(arch, tmp_path):
    """A save_pretrained folder of a family on the template path loads every parameter and buffer as saved."""
    from partrain.models import generic_template_survey

    source = generic_template_survey._build(arch, 0, "cpu")
    source.save_pretrained(tmp_path)
    model_cfg = ModelConfig(arch=arch, pretrained=str(tmp_path))
    loaded = materialize(build_meta_model(model_cfg), model_cfg, seed=99, device="cpu")
    assert_same_tensors(loaded.named_parameters(), source.named_parameters())
    assert_same_tensors(loaded.named_buffers(), source.named_buffers())


def test_pretrained_hub_style_gpt2_in_bf16(tmp_path):
    """Hub gpt2 files name tensors without "transformer." and omit the tied head; bf16 is upcast."""
    from safetensors.torch import save_file

    source = built(tiny("gpt2"), seed=2)
    source.config.save_pretrained(tmp_path)
    tensors = {
        n.removeprefix("transformer."): p.detach().to(torch.bfloat16).contiguous() for n, p in source.named_parameters()
    }  # lm_head is wte: listed once
    save_file(tensors, tmp_path / "model.safetensors")
    model_cfg = ModelConfig(arch="gpt2", pretrained=str(tmp_path))
    loaded = materialize(build_meta_model(model_cfg), model_cfg, seed=0, device="cpu")
    for name, param in loaded.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, source.get_parameter(name).to(torch.bfloat16).float()), name
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_pretrained_shape_mismatch_is_a_config_error(tmp_path):
    built(tiny("llama")).save_pretrained(tmp_path, safe_serialization=True)
    model_cfg = ModelConfig(arch="llama", config={"intermediate_size": 96}, pretrained=str(tmp_path))
    with pytest.raises(ConfigError) as err:
        materialize(build_meta_model(model_cfg), model_cfg, seed=0, device="cpu")
    assert err.value.problems[0].key == "model.pretrained" and "gate_proj" in err.value.problems[0].rule


# ---- adapters ------------------------------------------------------------------------------------


def test_every_supported_arch_has_an_adapter():
    assert set(ADAPTERS) == set(SUPPORTED_ARCHS)
    with pytest.raises(ConfigError) as err:
        get_adapter("gpt3")
    assert err.value.problems[0].key == "model.arch" and "gpt2" in err.value.problems[0].rule


@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_paths_resolve(arch):
    model = build_meta_model(tiny(arch))
    adapter = get_adapter(model)
    assert get_adapter(arch) is adapter is get_adapter(tiny(arch))
    layers = adapter.layers(model)
    assert isinstance(layers, torch.nn.ModuleList) and len(layers) == 2
    assert model.get_submodule(adapter.layer_fqn(1)) is layers[1]
    assert adapter.embeddings(model)[0].weight.shape[0] == VOCAB
    assert adapter.final_norm(model) is not None and adapter.lm_head(model) is not None
    assert (adapter.rotary(model) is None) == (arch == "gpt2")
    assert adapter.attention(layers[0]) is not None and adapter.mlp(layers[0]) is not None
    assert adapter.is_moe == (arch in ("mixtral", "qwen2_moe", "qwen3_moe"))
    if adapter.is_moe:
        experts = adapter.experts(layers[0])
        assert {n for n, _ in experts.named_parameters()} == set(adapter.expert_param_names)
        assert experts.gate_up_proj.shape[0] == 4 and adapter.router(layers[0]) is not None
        assert (adapter.experts(layers[1]) is None) == (arch in ("qwen2_moe", "qwen3_moe"))
    else:
        assert adapter.experts(layers[0]) is None
    plan = adapter.hf_plan(model, "tp")
    if arch == "gpt2":
        assert plan is None and adapter.fused_qkv_attr and adapter.conv1d_weights
    else:
        names = [n for n, _ in model.named_modules()] + [n for n, _ in model.named_parameters()]
        for pattern in plan:  # every HF plan entry names something that exists in some layer
            assert any(fnmatch.fnmatchcase(n, pattern) for n in names), pattern


# ---- loss ----------------------------------------------------------------------------------------


def test_forward_loss_does_not_shift_again():
    model = built(tiny("llama")).eval()
    ids = batch(1)
    ours = forward_loss(model, ids, shifted(ids))
    hf_shifting = model(input_ids=ids, labels=ids).loss  # HF shifts unshifted labels itself
    torch.testing.assert_close(ours, hf_shifting, rtol=1e-6, atol=1e-6)
    labels = shifted(ids)
    labels[0] = IGNORE_INDEX  # ignored rows do not count
    logits = model(input_ids=ids[1:]).logits
    torch.testing.assert_close(
        forward_loss(model, ids, labels),
        F.cross_entropy(logits.flatten(0, 1), labels[1:].flatten()),
        rtol=1e-6,
        atol=1e-6,
    )


# ---- two processes: FSDP2 and tensor parallel ----------------------------------------------------

SEED = 5
DIST_CASES = {
    # case: (model config, sharding); gpt2 with n_positions=127 shards wpe unevenly (64 + 63 rows)
    "gpt2_fsdp": (tiny("gpt2", n_positions=127), "fsdp"),
    "llama_fsdp": (tiny("llama"), "fsdp"),
    "llama_tp": (tiny("llama"), "tp"),
    "mixtral_fsdp": (tiny("mixtral"), "fsdp"),
}


def _shard(model, mesh, how):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    adapter = get_adapter(model)
    if how == "tp":
        for layer in adapter.layers(model):
            parallelize_module(
                layer,
                mesh,
                {
                    "self_attn.q_proj": ColwiseParallel(),
                    "self_attn.k_proj": ColwiseParallel(),
                    "self_attn.v_proj": ColwiseParallel(),
                    "self_attn.o_proj": RowwiseParallel(),
                    "mlp.gate_proj": ColwiseParallel(),
                    "mlp.up_proj": ColwiseParallel(),
                    "mlp.down_proj": RowwiseParallel(),
                },
            )
        return
    for layer in adapter.layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _worker(rank: int, world: int, folder: str, pretrained: str) -> None:
    """One rank: shard each case's meta model, materialize, save gathered weights and the loss."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    code = 0
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(folder, "store"), world)
        with joined_group("gloo", rank, world, 60, store=store):
            mesh = init_device_mesh("cpu", (world,))
            cases = dict(DIST_CASES, llama_pretrained_fsdp=(ModelConfig(arch="llama", pretrained=pretrained), "fsdp"))
            report = {}
            for case, (model_cfg, how) in cases.items():
                model = build_meta_model(model_cfg)
                _shard(model, mesh, how)
                materialize(model, model_cfg, seed=SEED, device="cpu")
                params = dict(model.named_parameters())
                local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params.values())
                full = {
                    n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().contiguous()
                    for n, p in params.items()
                }
                save_file(full, os.path.join(folder, f"{case}.rank{rank}.safetensors"))
                loss = forward_loss(model.eval(), batch(), shifted(batch()))
                loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
                report[case] = {
                    "local_numel": local,
                    "total_numel": sum(p.numel() for p in params.values()),
                    "loss": loss.item(),
                    "tied": bool(getattr(model.config, "tie_word_embeddings", False))
                    and model.lm_head.weight is model.transformer.wte.weight,
                }
            Path(folder, f"report.rank{rank}.json").write_text(json.dumps(report))
    except BaseException:
        traceback.print_exc()
        code = 1
    leave(code)  # gloo can abort at interpreter exit even after destroy (design brief, section 10)


def _expected_local(full: torch.Tensor, placements, coordinate) -> torch.Tensor:
    """This rank's piece, written out by hand: the inner (tp) mesh dim splits first, then dp.

    That order is what FSDP2-over-TP means: FSDP shards the TP shard, which DTensor records as
    _StridedShard on the dp dim when both shard the same tensor dim.
    """
    from torch.distributed.tensor import Replicate

    piece = full
    for mesh_dim in reversed(range(len(placements))):
        placement = placements[mesh_dim]
        if not isinstance(placement, Replicate):
            piece = torch.chunk(piece, 2, dim=placement.dim)[coordinate[mesh_dim]]
    return piece


def test_materialize_cuts_shards_locally_on_a_2d_mesh():
    """FSDP2 x TP on a fake 4-rank (dp=2, tp=2) mesh, as rank 3 at coordinate (1, 1).

    The fake process group's collectives do nothing, so correct local shards show that materialize
    cut them out without communication. Only one fake rank per process: DTensor's dispatch caches
    key device meshes by an equality that ignores the rank, so a second fake rank in the same
    process would inherit the first one's coordinates (the unusual dim names keep other tests'
    meshes from colliding with this one).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    model_cfg = tiny("llama")
    reference = built(model_cfg, seed=SEED)
    dist.init_process_group("fake", rank=3, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("models_dp", "models_tp"))
        model = build_meta_model(model_cfg)
        _shard(model, mesh["models_tp"], "tp")
        _shard(model, mesh["models_dp"], "fsdp")
        materialize(model, model_cfg, seed=SEED, device="cpu")
        assert tuple(mesh.get_coordinate()) == (1, 1)
        strided = 0
        for name, param in model.named_parameters():
            coordinate = param.device_mesh.get_coordinate()  # 2-D for TP'd weights, 1-D (dp) otherwise
            assert set(coordinate) == {1}, (name, coordinate)
            strided += "_StridedShard" in str(param.placements)
            expected = _expected_local(reference.get_parameter(name).detach(), param.placements, coordinate)
            assert torch.equal(param.to_local(), expected), (name, param.placements)
        assert strided, "TP-then-FSDP parameters should be _StridedShard on the dp dim"
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_materialize_matches_single_process(tmp_path):
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    pretrained = tmp_path / "pretrained"
    built(tiny("llama"), seed=21).save_pretrained(pretrained, safe_serialization=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(rank, 2, str(tmp_path), str(pretrained))) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=150)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    assert [p.exitcode for p in procs] == [0, 0]

    reference_cfgs = {case: cfg for case, (cfg, _) in DIST_CASES.items()}
    reference_cfgs["llama_pretrained_fsdp"] = ModelConfig(arch="llama", pretrained=str(pretrained))
    for rank in range(2):
        report = json.loads((tmp_path / f"report.rank{rank}.json").read_text())
        for case, model_cfg in reference_cfgs.items():
            reference = built(model_cfg, seed=SEED).eval()
            gathered = load_file(tmp_path / f"{case}.rank{rank}.safetensors")
            assert_same_tensors(gathered, {n: p.detach() for n, p in reference.named_parameters()})
            entry = report[case]
            assert entry["local_numel"] < entry["total_numel"], f"{case}: nothing was sharded"
            expected = forward_loss(reference, batch(), shifted(batch())).item()
            assert entry["loss"] == pytest.approx(expected, rel=1e-5), case
        assert report["gpt2_fsdp"]["tied"]
