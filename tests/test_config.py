"""The config tree, schema and model facts: every recipe composes and validates, every schema key is
documented and settable, and the model facts agree with the installed transformers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from partrain.blueprint.config import schema
from partrain.blueprint.config.compose import compose, load_resolved, to_yaml
from partrain.blueprint.config.docs import field_docs
from partrain.blueprint.config.paths import conf_dir, shipped_recipes_dir
from partrain.blueprint.config.recipes import list_recipes
from partrain.blueprint.model_facts import SUPPORTED_ARCHS, load_snapshot, model_facts
from partrain.blueprint.validate import validate
from partrain.models.facts_snapshot import live_class_fields

SHIPPED = sorted(p.stem for p in shipped_recipes_dir().glob("*.yaml"))
MODELS = sorted(conf_dir().joinpath("model").glob("*.yaml"))


def test_shipped_recipes_are_listed():
    assert len(SHIPPED) >= 8
    found = list_recipes([])
    assert sorted(found) == SHIPPED
    assert all(r.shipped and r.description and r.shadows is None for r in found.values())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_recipe_composes_and_validates(name):
    validated = validate(compose([f"recipe={name}"]))
    assert validated.run.recipe == name
    cluster = validated.run.cluster
    assert validated.world_size == cluster.nodes * cluster.devices_per_node
    assert (
        validated.global_batch_size
        == validated.run.train.micro_batch_size * validated.microbatches * validated.layout.dp
    )


@pytest.mark.parametrize("name", SHIPPED)
def test_resolved_yaml_round_trips(tmp_path, name):
    """What a worker reads (config.yaml, no Hydra) is exactly what was composed."""
    run = compose([f"recipe={name}"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(run))
    assert load_resolved(path) == run


def _schema_keys(cls=schema.RunConfig, prefix=""):
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            yield from _schema_keys(type(value), f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}"


def _dataclasses_of_schema():
    return [obj for obj in vars(schema).values() if dataclasses.is_dataclass(obj) and obj.__module__ == schema.__name__]


def test_every_schema_field_has_a_docstring():
    classes = _dataclasses_of_schema()
    assert len(classes) >= 8
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in classes
        for f in dataclasses.fields(cls)
        if not field_docs(cls).get(f.name)
    ]
    assert missing == []


def _hydra_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_hydra_value(v)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, str) else str(value)


def test_every_schema_key_can_be_set_without_plus():
    """Also keys that no YAML file of the group mentions (Hydra alone would demand `+key=`)."""
    base = compose(["recipe=gpt-3d"])
    keys = [k for k in _schema_keys() if k not in ("recipe", "model.config")]
    same = [f"{k}={_hydra_value(_get(base, k))}" for k in keys]
    assert compose(["recipe=gpt-3d", *same]) == base
    changed = compose(
        [
            "recipe=gpt-3d",
            "cluster.allow_tp_across_nodes=true",
            "model.pretrained=/some/folder",
            "model.trust_remote_code=true",
            "model.config.n_inner=256",
        ]
    )
    assert changed.cluster.allow_tp_across_nodes and changed.model.trust_remote_code
    assert changed.model.pretrained == "/some/folder" and changed.model.config["n_inner"] == 256


def _get(run, dotted):
    for part in dotted.split("."):
        run = getattr(run, part)
    return run


def test_hf_field_aliases_are_accepted():
    facts = validate(
        compose(["recipe=gpt-3d", "model.config.num_attention_heads=8", "model.config.hidden_size=256"])
    ).facts
    assert (facts.heads, facts.hidden) == (8, 256)


# --- model facts against the installed transformers ------------------------------------------------


@pytest.mark.parametrize("arch", SUPPORTED_ARCHS)
def test_snapshot_matches_installed_transformers(arch):
    snapshot = load_snapshot()
    assert snapshot[arch] == live_class_fields(arch), (
        f"partrain/blueprint/hf_facts.json was made with transformers {snapshot['transformers_version']}; "
        "regenerate it with `python -m partrain.models.facts_snapshot`"
    )


VARIANTS = [  # derivations the shipped models do not exercise
    ("llama", {"hidden_size": 96, "num_attention_heads": 6, "num_hidden_layers": 3}),  # no GQA: kv = heads
    ("gpt2", {"n_embd": 64, "n_head": 4, "n_inner": 100, "n_layer": 2}),
    ("qwen2_moe", {"num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [1, 3], "num_experts": 4}),
    ("qwen3_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3], "head_dim": 48}),
    ("mistral", {"head_dim": 48, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 1}),
]
MODEL_CASES = [
    pytest.param(*(lambda d: (d["arch"], d["config"]))(yaml.safe_load(p.read_text())), id=p.stem) for p in MODELS
] + [pytest.param(arch, kwargs, id=f"{arch}-variant") for arch, kwargs in VARIANTS]


@pytest.mark.parametrize("arch,kwargs", MODEL_CASES)
def test_model_facts_agree_with_the_hf_config_object(arch, kwargs):
    from transformers import CONFIG_MAPPING

    from partrain.blueprint.families.generic_moe import GENERIC_MOE_RECORDS

    hf = CONFIG_MAPPING[arch](**kwargs)
    facts = model_facts(arch, kwargs)
    hidden, heads = hf.hidden_size, hf.num_attention_heads
    ffn = {
        "gpt2": hf.n_inner if arch == "gpt2" and hf.n_inner else 4 * hidden,
        "qwen2_moe": getattr(hf, "moe_intermediate_size", None),
        "qwen3_moe": getattr(hf, "moe_intermediate_size", None),
    }.get(arch) or hf.intermediate_size
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None) or 0
    moe_layers = 0
    if arch in ("qwen2_moe", "qwen3_moe"):
        moe_layers = sum(
            1
            for i in range(hf.num_hidden_layers)
            if i not in hf.mlp_only_layers and (i + 1) % hf.decoder_sparse_step == 0
        )
    elif experts:
        moe_layers = hf.num_hidden_layers
    expected = dict(
        n_layers=hf.num_hidden_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or hidden // heads,
        ffn=ffn,
        vocab=hf.vocab_size,
        max_positions=hf.max_position_embeddings,
        tied_embeddings=hf.tie_word_embeddings,
        n_experts=experts,
        experts_per_token=getattr(hf, "num_experts_per_tok", 0) if experts else 0,
        moe_layers=moe_layers,
        shared_expert_ffn=getattr(hf, "shared_expert_intermediate_size", 0) if arch == "qwen2_moe" else 0,
    )
    if arch == "deepseek_v3":  # latent attention: q/k heads of nope + rope; routed layers after the dense ones
        expected.update(
            head_dim=hf.qk_nope_head_dim + hf.qk_rope_head_dim,
            ffn=hf.moe_intermediate_size,
            moe_layers=hf.num_hidden_layers - hf.first_k_dense_replace,
            shared_expert_ffn=hf.moe_intermediate_size * hf.n_shared_experts,
        )
        assert (facts.latent_attention.kv_lora_rank, facts.latent_attention.v_head_dim) == (
            hf.kv_lora_rank,
            hf.v_head_dim,
        )
    if arch in GENERIC_MOE_RECORDS:  # the generic MoE path: its figures counted on the meta-built model
        expected.update(_moe_figures(hf))
    assert {k: getattr(facts, k) for k in expected} == expected


def _moe_figures(hf) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        layers = AutoModelForCausalLM.from_config(hf).model.layers
    sparse = [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]
    shared = getattr(sparse[0], "shared_experts", None)
    return dict(
        ffn=sparse[0].experts.down_proj.shape[-1],
        n_experts=sparse[0].experts.gate_up_proj.shape[0],
        moe_layers=len(sparse),
        shared_expert_ffn=shared.down_proj.weight.shape[1] if shared is not None else 0,
    )


def test_every_verified_arch_has_a_shipped_model():
    """The families of their own file; the generic paths' are trained from a user's folder or model.arch, two
    MoE ones and a template one also from a shipped tiny model (the suite's parity runs)."""
    from partrain.blueprint.families import VERIFIED

    shipped = {yaml.safe_load(p.read_text())["arch"] for p in MODELS}
    assert shipped - set(VERIFIED) == {"glm4_moe", "exaone_moe", "phi"} and set(VERIFIED) <= shipped


def test_pretrained_folder_config_wins(tmp_path: Path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "llama", "num_hidden_layers": 7, "hidden_size": 64, '
        '"num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 300}'
    )
    facts = model_facts("llama", {"num_hidden_layers": 2}, str(tmp_path))
    assert (facts.n_layers, facts.hidden, facts.vocab) == (2, 64, 300)  # model.config on top of config.json
    facts = model_facts("llama", {}, str(tmp_path))
    assert facts.n_layers == 7


def test_use_cache_is_refused_before_any_process():
    """The worker's own refusal (models/build.py), said by validation: exit 2 before a launch."""
    from partrain.blueprint.validate import validate
    from partrain.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        validate(compose(["model=llama-tiny", "++model.config.use_cache=true"]))
    (problem,) = refused.value.problems
    assert problem.key == "model.config.use_cache" and "use_cache=False" in problem.rule
