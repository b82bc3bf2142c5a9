"""Megatron-SP with sharded saves (every family, GPT-2 included) and Korthikanti's selective recompute:
parity against the one-process run, saved bytes measured by saved-tensor hooks against the planner."""

from __future__ import annotations

import pytest
import torch

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.schema import ModelConfig
from partrain.blueprint.planner import estimate
from partrain.blueprint.planner.memory import dtypes, layer_activations
from partrain.blueprint.planner.spec import spec_from_validated
from partrain.blueprint.validate import validate
from partrain.rehearse.runs import train_all
from partrain.runtime.spawn import run_spawned
from partrain.testing.parity import check_parity, parity_args, reference_overrides

STEPS = 3
COMMON = ["train.seq_len=64", "data.max_bytes=1000000", "train.global_batch_size=8", "train.micro_batch_size=2"]
GPT3D = ["recipe=gpt-3d", "parallel.tp_sequence_parallel=true"]
GPT_TP2 = GPT3D + ["parallel.dp=1", "parallel.pp=1", "cluster.devices_per_node=2"]
LLAMA_TP2 = [
    "recipe=llama-fsdp-tp",
    "parallel.tp_sequence_parallel=true",
    "parallel.dp=1",
    "parallel.tp=2",
    "parallel.zero_stage=0",
    "cluster.devices_per_node=2",
]
SELECTIVE = ["parallel.recompute=selective"]
DROPOUT = ["model.config.resid_pdrop=0.1", "model.config.embd_pdrop=0.1"]
"""Dropout in GPT-2's sequence-parallel regions (embedding, residual): SequenceDropout keeps the unsplit masks."""

# Llama tp2 + SP without recompute is tests/test_tensor_parallel.py's "llama-tp2-sp" (same runtime).
# GPT-2 tp2 + SP without recompute or dropout is the dropout case's runtime with p = 0: left to it.
LAYOUTS = {
    "gpt2-tp2-sp-selective": GPT_TP2 + SELECTIVE,
    # gpt-3d (dp2 x tp2 x pp2) with SP, with and without selective recompute in one run:
    # recompute_every=2, so layers 0 and 2 recompute their attention core and layers 1 and 3 keep it.
    "gpt2-3d-sp-selective-every2": GPT3D + SELECTIVE + ["parallel.recompute_every=2"],
    "llama-tp2-sp-selective": LLAMA_TP2 + SELECTIVE,
    "gpt2-tp2-sp-dropout": GPT_TP2 + DROPOUT,
}


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def _model_overrides(overrides) -> tuple:
    return tuple(o for o in overrides if o.startswith("model."))


def _reference_name(recipe: str, model_overrides: tuple = ()) -> str:
    return "reference-" + recipe.split("=")[1] + ("-dropout" if model_overrides else "")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache):
    """Every layout and one single-process reference per (recipe, model overrides), plus the
    reference without the dropout, trained once per module through the worker's code; the runs of
    one process count share a launch (testing.in_process.train_all)."""
    common = COMMON + [f"data.cache_dir={data_cache}"]
    cases = {}
    for name, overrides in LAYOUTS.items():
        recipe, model = overrides[0], _model_overrides(overrides)
        for ref_model in {model, ()}:
            ref = reference_overrides([recipe, *ref_model] + common)
            cases[_reference_name(recipe, ref_model)] = parity_args(ref, STEPS)
        cases[name] = parity_args(overrides + common, STEPS)
    return train_all(cases, tmp_path_factory.mktemp("runs"))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_megatron_sp_matches_single_process(name, runs):
    overrides = LAYOUTS[name]
    recipe, model = overrides[0], _model_overrides(overrides)
    print(name, check_parity(runs[_reference_name(recipe, model)], runs[name]))
    if model:  # the dropout really changed the run
        assert runs[_reference_name(recipe, model)].losses != runs[_reference_name(recipe)].losses


# ---- saved bytes per layer: hooks vs planner ------------------------------------------------------

TINY = {"gpt2": "gpt2-tiny", "llama": "llama-tiny"}
SEQ, MBS = 64, 2


def _layer_bytes(rank: int, world: int, archs: list, policies: list) -> dict:
    """Saved bytes of decoder layer 1 (and of the whole model) for one microbatch, at tp=1 (no mesh)
    and at tp=world with Megatron-SP, counted by saved-tensor hooks."""
    from torch.distributed.device_mesh import init_device_mesh

    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.loss import forward_loss
    from partrain.models.materialize import materialize
    from partrain.parallel.recompute import apply_recompute
    from partrain.parallel.tensor_parallel import apply_tp, loss_context
    from partrain.runtime.activations import ModuleSavedActivations, SavedActivations
    from partrain.simulate.measure import model_config

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = {}
    for arch in archs:
        cfg = model_config(TINY[arch])
        for policy in policies:
            for tp in (1, world):
                model = build_meta_model(cfg)
                adapter = get_adapter(model)
                if tp > 1:
                    apply_tp(model, adapter, mesh, sequence_parallel=True)
                apply_recompute(model, adapter, policy)
                materialize(model, cfg, seed=1, device="cpu").train()
                ids = torch.randint(0, 256, (MBS, SEQ + 1), generator=torch.Generator().manual_seed(0))
                layer = adapter.layers(model)[1]
                with loss_context(tp, True)():
                    with ModuleSavedActivations(layer, model.parameters()) as counted:
                        forward_loss(model, ids[:, :-1], ids[:, 1:]).backward()
                    with SavedActivations(model.parameters()) as whole:  # own pass: hooks nest innermost-wins
                        loss = forward_loss(model, ids[:, :-1], ids[:, 1:])
                    loss.backward()
                out[f"{arch}/{policy}/{tp}"] = [counted.total, whole.total]
    return out


def _planned_bytes(arch: str, tp: int, policy: str) -> tuple:
    """(counted bytes of one layer, activation bytes of the model) the planner gives per rank."""
    v = validate(
        compose(
            [
                f"model={TINY[arch]}",
                "cluster=local-cpu",
                f"cluster.devices_per_node={tp}",
                "parallel.dp=1",
                f"parallel.tp={tp}",
                f"parallel.tp_sequence_parallel={str(tp > 1).lower()}",
                f"train.seq_len={SEQ}",
                f"train.micro_batch_size={MBS}",
                f"train.global_batch_size={MBS}",
                f"parallel.recompute={policy}",
            ]
        )
    )
    spec = spec_from_validated(v)
    la = layer_activations(spec, False, MBS * SEQ, SEQ, dtypes(spec.precision, spec.mixed))
    # A layer's own counter also sees the rotary cos/sin it multiplies by (fp32, whole sequence; the
    # planner counts them once per model, in end_activations).
    rotary = 0 if arch == "gpt2" else 2 * SEQ * spec.facts.head_dim * 4
    layer = la.per_rank(spec.tp, spec.tp_sp, policy) + rotary
    return layer, estimate(v, mixed="autocast")["memory_bytes"]["activations"]


@pytest.mark.slow
def test_sp_layer_bytes_divide_by_tp_and_match_planner(tmp_path):
    archs, policies = ["gpt2", "llama"], ["none", "selective"]
    results = run_spawned(_layer_bytes, 2, tmp_path, archs, policies, timeout_s=120)
    assert results[0] == results[1]
    got = results[0]
    for arch in archs:
        for policy in policies:
            key = f"{arch}/{policy}"
            (one, one_model), (two, two_model) = got[f"{key}/1"], got[f"{key}/2"]
            print(f"{key}: layer 1 saves tp1 {one} B, tp2+SP {two} B per rank ({two / (one / 2):.3f} x tp1/2)")
            assert two <= 1.05 * one / 2, (key, one, two)
            # Per layer and per model, at tp 1 and tp 2 + SP.
            for tp, layer_bytes, model_bytes in ((1, one, one_model), (2, two, two_model)):
                planned_layer, planned_model = _planned_bytes(arch, tp, policy)
                assert planned_layer == pytest.approx(layer_bytes, rel=0.01), (key, tp)
                assert planned_model == pytest.approx(model_bytes, rel=0.01), (key, tp)


def test_gpt3_175b_counted_layer_bytes_divide_by_tp_with_sp():
    """Planner: per-layer counted bytes of GPT-3 175B at tp8 + SP are its tp1 bytes / 8."""
    for policy in ("selective", "none"):
        tp8 = estimate(validate(compose(["recipe=gpt3-175b-h100", f"parallel.recompute={policy}"])))
        tp1 = estimate(
            validate(
                compose(
                    [
                        "recipe=gpt3-175b-h100",
                        "parallel.tp=1",
                        "parallel.dp=64",
                        "parallel.tp_sequence_parallel=false",
                        f"parallel.recompute={policy}",
                    ]
                )
            )
        )
        assert tp8["counted_layer_bytes"] <= 1.05 * tp1["counted_layer_bytes"] / 8, policy


def test_gpt2_megatron_sp_is_trainable():
    from partrain.blueprint.trainable import unsupported_features

    v = validate(compose(GPT3D))
    assert unsupported_features(v) == []


# ---- every family: one step's gradients under tp2 + SP + selective recompute -------------------------

_LLAMA_CFG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    bos_token_id=0,
    eos_token_id=0,
)
_MOE = dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
FAMILY_CONFIGS = {
    "gpt2": dict(
        vocab_size=256,
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    ),
    "llama": _LLAMA_CFG,
    "qwen2": _LLAMA_CFG,
    "mistral": dict(_LLAMA_CFG, sliding_window=None),
    "mixtral": dict(_LLAMA_CFG, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    # layer 1 dense (mlp_only_layers): its MLP runs through the sharded-save path, layer 0's MoE gathers.
    "qwen2_moe": dict(_LLAMA_CFG, **_MOE, shared_expert_intermediate_size=64, mlp_only_layers=[1]),
    "qwen3_moe": dict(_LLAMA_CFG, **_MOE),
}


def _family_gradients(rank: int, world: int) -> dict:
    """Worst relative difference between the full gradient of every parameter under tp=world + SP +
    selective recompute and the one-process gradient, per family."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from partrain.models.adapters import get_adapter
    from partrain.models.build import build_meta_model
    from partrain.models.loss import forward_loss
    from partrain.models.materialize import materialize
    from partrain.parallel.recompute import apply_recompute
    from partrain.parallel.tensor_parallel import apply_tp, loss_context

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    out = {}
    for arch, config in FAMILY_CONFIGS.items():
        cfg = ModelConfig(arch=arch, config=config)
        reference = materialize(build_meta_model(cfg), cfg, seed=7, device="cpu")
        forward_loss(reference, ids[:, :-1], ids[:, 1:]).backward()
        model = build_meta_model(cfg)
        adapter = get_adapter(model)
        apply_tp(model, adapter, mesh, sequence_parallel=True)
        apply_recompute(model, adapter, "selective")
        materialize(model, cfg, seed=7, device="cpu")
        with loss_context(world, True)():
            forward_loss(model, ids[:, :-1], ids[:, 1:]).backward()
        worst = 0.0
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            ref = reference.get_parameter(name).grad
            worst = max(worst, float((g - ref).abs().max() / ref.abs().max()))
        out[arch] = worst
    return out


@pytest.mark.slow
def test_every_family_gradients_under_sp_and_selective_recompute(tmp_path):
    for result in run_spawned(_family_gradients, 2, tmp_path, timeout_s=180):
        print(result)
        assert set(result) == set(FAMILY_CONFIGS)
        assert all(rel < 1e-5 for rel in result.values()), result
