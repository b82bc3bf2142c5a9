"""Per-family files: every supported architecture has a planner family (blueprint/families/) and a
runtime adapter (models/families/), variants share the llama files, GPT-2's own TP plan names real
modules, and the shared planner modules ask the family instead of testing the architecture."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from partrain.blueprint.families import FAMILIES, family
from partrain.blueprint.model_facts import SUPPORTED_ARCHS, UNDECLARED_FIELDS, model_facts
from partrain.blueprint.validate_peft import LORA_TARGETS
from partrain.errors import ConfigError
from partrain.models.adapters import ADAPTERS

PARTRAIN = Path(__file__).resolve().parents[1] / "partrain"


def test_every_arch_has_both_halves_and_they_agree():
    assert tuple(FAMILIES) == SUPPORTED_ARCHS
    assert set(ADAPTERS) == set(SUPPORTED_ARCHS)
    for arch in SUPPORTED_ARCHS:
        assert family(arch).name == ADAPTERS[arch].family, arch
        assert family(arch).arch == arch


def test_variants_reuse_the_llama_files():
    llama = FAMILIES["llama"]
    for variant in ("qwen2", "mistral"):
        assert FAMILIES[variant].name == "llama"
        assert FAMILIES[variant].layer_tensors is llama.layer_tensors
        assert ADAPTERS[variant] is ADAPTERS["llama"]
    # Qwen3 (dense): Llama's layer with per-head q/k norms (the same function, one flag set).
    qwen3 = FAMILIES["qwen3"]
    assert qwen3.name == "llama" and qwen3.qk_norm and ADAPTERS["qwen3"] is ADAPTERS["llama"]
    assert qwen3.layer_tensors.func is llama.layer_tensors and qwen3.layer_tensors.keywords == {"qk_norm": True}


def test_unknown_arch_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        family("lama")
    assert err.value.problems[0].key == "model.arch" and "llama" in err.value.problems[0].fix


def test_hf_config_maps_generic_sizes_per_family():
    sizes = dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=2, vocab=100, positions=32)
    gpt2 = FAMILIES["gpt2"].hf_config(**sizes)
    assert gpt2 == dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, vocab_size=100, n_positions=32)
    facts = model_facts("llama", FAMILIES["llama"].hf_config(**sizes))
    assert (facts.hidden, facts.ffn, facts.n_layers, facts.heads, facts.kv_heads) == (64, 128, 2, 4, 2)


def test_gpt2_tp_plan_names_real_modules():
    torch = pytest.importorskip("torch")
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=16))
    adapter = ADAPTERS["gpt2"]
    layer = adapter.layers(model)[0]
    plan = adapter.layer_tp_plan
    for block in plan.blocks:
        module = layer.get_submodule(block.path)
        for name in [n for n, _ in block.column] + list(block.row):
            assert type(getattr(module, name)).__name__ == "Conv1D", (block.path, name)
        for attr in block.per_rank:
            assert isinstance(getattr(module, attr), int), (block.path, attr)
    for path in plan.sequence_norms + plan.sequence_dropouts:
        layer.get_submodule(path)
    assert all(ADAPTERS[a].layer_tp_plan is None for a in SUPPORTED_ARCHS if a != "gpt2")  # HF's plan


ARCHS = "|".join(SUPPORTED_ARCHS)
ARCH_TEST = re.compile(rf"""((?<!\.block )[!=]=|\bin\s*\()\s*["']({ARCHS})["']""")
"""A comparison with an architecture name (a family's `block` shape excepted)."""
SHARED = sorted(p for p in (PARTRAIN / "blueprint").rglob("*.py") if "families" not in p.parts)


@pytest.mark.parametrize("module", SHARED, ids=lambda p: str(p.relative_to(PARTRAIN)))
def test_shared_blueprint_modules_ask_the_family(module):
    found = ARCH_TEST.search(module.read_text())
    assert not found, f"{module.name} tests the architecture ({found.group(0)}): ask blueprint.families.family()"


def test_family_tables_derived_from_the_files():
    assert LORA_TARGETS["mixtral"] == ("q_proj", "k_proj", "v_proj", "o_proj")
    assert LORA_TARGETS["gpt2"] == ("c_attn", "c_proj", "c_fc")
    assert UNDECLARED_FIELDS["qwen3_moe"] == {"head_dim": None}
    windowed = ["mistral", "gemma2", "gemma3_text", "phi3", "cohere2", "mixtral", "gpt_oss"]
    generic = [a for a in SUPPORTED_ARCHS if FAMILIES[a].generic]  # a window counts whatever layers it names
    assert [a for a in SUPPORTED_ARCHS if FAMILIES[a].window_always] == windowed + generic


def test_the_attention_kernel_follows_the_model_and_sdpa_is_refused_where_scores_are_capped():
    """SDPA by default; eager where the model caps its attention scores (Gemma 2), as the planner and
    the built HF config both say; model.config.attn_implementation is a kernel choice, not a config
    field, and naming SDPA for capped scores is refused naming the key (SDPA would ignore the cap)."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.planner.spec import model_extras
    from partrain.blueprint.validate import validate
    from partrain.models.build import hf_config

    def kernels(*overrides: str):
        v = validate(compose(["recipe=gpt-dp", *overrides]))
        m = v.run.model
        return model_extras(m.arch, m.config, m.pretrained, v.facts).attn_impl, hf_config(m)._attn_implementation

    assert kernels("model=llama-tiny") == ("sdpa", "sdpa")
    assert kernels("model=gemma2-tiny") == ("eager", "eager")
    assert kernels("model=gemma2-tiny", "model.config.attn_logit_softcapping=null") == ("sdpa", "sdpa")
    assert kernels("model=llama-tiny", "+model.config.attn_implementation=eager") == ("eager", "eager")
    with pytest.raises(ConfigError) as refused:
        validate(compose(["recipe=gpt-dp", "model=gemma2-tiny", "+model.config.attn_implementation=sdpa"]))
    text = str(refused.value)
    assert "model.config.attn_implementation" in text and "attn_logit_softcapping=50.0" in text, text
    # gpt-oss' attention adds sink logits, which transformers runs only in eager (or flex/flash) attention.
    assert kernels("model=gpt-oss-tiny") == ("eager", "eager")
    with pytest.raises(ConfigError) as refused:
        validate(compose(["recipe=gpt-dp", "model=gpt-oss-tiny", "+model.config.attn_implementation=sdpa"]))
    assert "sink logits" in str(refused.value) and "model.config.attn_implementation" in str(refused.value)
    with pytest.raises(ConfigError) as typo:
        validate(compose(["recipe=gpt-dp", "model=llama-tiny", "+model.config.attn_implementation=sdpaa"]))
    assert "model.config.attn_implementation" in str(typo.value) and "did you mean sdpa?" in str(typo.value)


def test_the_generic_paths_families_still_build_as_their_base_in_the_installed_transformers():
    """hf_facts.json's generic_families, re-checked: each family holds its base's tensors, a plain head and
    a tp plan (models/generic_survey.py); regenerate with `python -m partrain.models.facts_snapshot`."""
    from partrain.blueprint.families.generic import GENERIC_BASES
    from partrain.models.generic_survey import base_of, base_shapes

    assert {"helium": "llama", "olmo3": "olmo2", "seed_oss": "qwen2"}.items() <= GENERIC_BASES.items()
    bases = base_shapes()
    assert {a: base_of(a, bases)[0] for a in GENERIC_BASES} == GENERIC_BASES
    assert base_of("stablelm", bases)[0] is None and base_of("gpt_oss", bases)[0] is None  # LayerNorm biases; sinks


def test_the_generic_moe_families_still_build_as_recorded_in_the_installed_transformers():
    """hf_facts.json's generic_moe_families, re-checked: each record is what models/generic_moe_survey.py finds
    now (the planner's tensors equal to the meta-built model's at two sizes, the router's logits, the experts'
    layout on disk); a MoE family it cannot take is left out saying why."""
    from partrain.blueprint.families.generic_moe import GENERIC_MOE_RECORDS, NOT_GENERIC_MOE
    from partrain.models.generic_moe_survey import moe_record

    assert {"glm4_moe", "exaone_moe", "ernie4_5_moe"} <= set(GENERIC_MOE_RECORDS)
    for arch, record in GENERIC_MOE_RECORDS.items():
        assert moe_record(arch) == (record, ""), arch
    assert GENERIC_MOE_RECORDS["exaone_moe"].renames  # its router bias is saved under the block's name
    assert "neither llama's nor qwen3's" in NOT_GENERIC_MOE["olmoe"]  # q/k norms over the whole width
    assert moe_record("phimoe")[0] is None and moe_record("llama")[0] is None


def test_the_template_families_still_build_as_recorded_in_the_installed_transformers():
    """hf_facts.json's template_families, re-checked: each record is what models/generic_template_survey.py
    finds now (its template equal to the meta-built model at two sizes, its paths, plans and fixed flags)."""
    from partrain.blueprint.families.generic_template import TEMPLATE_RECORDS
    from partrain.models.generic_template_survey import template_record

    assert {"phi", "starcoder2", "olmo", "nemotron"} <= set(TEMPLATE_RECORDS)
    for arch, record in TEMPLATE_RECORDS.items():
        assert template_record(arch) == (record, ""), arch
    assert TEMPLATE_RECORDS["starcoder2"].fixed_flags == {"use_bias": True}
    assert template_record("cohere")[1] == "its logits are not the head applied to the base model's output"


def test_a_template_family_refuses_what_its_record_cannot_hold(cli):
    """A boolean field that changes the tensors away from the recorded value, Megatron-SP where the row
    projections are not o_proj / down_proj: exit 2 naming the key, before any process."""
    base = ["model=phi-tiny", "cluster.devices_per_node=2"]
    ran = cli("train", *base, "+model.config.qk_layernorm=true", "--dry-run")
    assert ran.code == 2 and "model.config.qk_layernorm=True" in ran.stderr and "template path" in ran.stderr
    ran = cli("train", *base, "parallel.tp=2", "parallel.tp_sequence_parallel=true")
    assert ran.code == 2 and "parallel.tp_sequence_parallel" in ran.stderr, ran.stderr
    assert "Megatron-SP for phi, a family on the template path" in ran.stderr
    # StableLM: no tp plan in its config class, attention outside transformers' interface.
    stablelm = ["model=llama-tiny", "model.arch=stablelm", "cluster.devices_per_node=2"]
    for degree, why in (("parallel.tp=2", "ships no tensor-parallel plan"), ("parallel.sp=2", "attention interface")):
        ran = cli("train", *stablelm, degree)
        assert ran.code == 2 and why in ran.stderr and "stablelm" in ran.stderr, ran.stderr
    assert cli("train", *stablelm, "parallel.pp=2", "--dry-run").code == 0
    ran = cli("train", *base, "parallel.tp=2", "--dry-run")
    assert ran.code == 0 and "phi (template path: tensors, plans and module paths recorded" in ran.stdout, ran.stderr


def test_a_family_off_the_generic_path_is_refused_saying_why(cli):
    ran = cli("train", "model=llama-tiny", "model.arch=gpt_neox", "--dry-run")
    assert ran.code == 2 and "model.arch='gpt_neox'" in ran.stderr, ran.stderr
    assert "the generic path does not take it: its parameters are none of" in ran.stderr
    assert "gpt_neox.final_layer_norm.bias" in ran.stderr  # each survey's reason: the bases', the template's
    assert "nor the template path's: its base model is not at `model`" in ran.stderr


def test_pipeline_stages_reproduce_the_generic_families_they_take():
    """families/generic.py's GENERIC_PIPELINE, re-checked against the installed transformers: a tiny model of
    each generic family split into two pipeline chunks (partrain's own loop over the layers) gives its
    transformers logits exactly; for the others it does not, or cannot run."""
    import torch

    from partrain.blueprint.families import FAMILIES
    from partrain.blueprint.families.generic import GENERIC_PIPELINE
    from partrain.blueprint.families.generic_moe import GENERIC_MOE_RECORDS
    from partrain.blueprint.families.generic_template import TEMPLATE_RECORDS
    from partrain.models import generic_moe_survey, generic_template_survey
    from partrain.models.families import ADAPTERS
    from partrain.models.generic_survey import _build
    from partrain.parallel.pipeline.stage import PipelineStageModule

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def reproduced(arch: str) -> bool:
        if arch in GENERIC_MOE_RECORDS:  # small experts: the survey's first size
            model = generic_moe_survey._build(arch, generic_moe_survey._kwargs(arch, 0)[0], "cpu").eval()
        elif arch in TEMPLATE_RECORDS:
            model = generic_template_survey._build(arch, 0, "cpu").eval()
        else:
            model = _build(arch, "cpu").eval()
        try:
            first = PipelineStageModule(model, ADAPTERS[arch], 0, 2, range(0, 1))
            last = PipelineStageModule(model, ADAPTERS[arch], 1, 2, range(1, 2))
            with torch.no_grad():
                return bool(torch.equal(last(first(ids)), model(input_ids=ids).logits))
        except TypeError:  # the stage calls a module as its verified families do (olmo3's rotary)
            return False

    assert {a for a, f in FAMILIES.items() if f.generic and reproduced(a)} == GENERIC_PIPELINE


def test_a_generic_family_is_refused_pipeline_parallelism_and_short_windows_by_name(cli, monkeypatch):
    from partrain.blueprint import trainable
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate

    # Every generic family takes pp today; one the stages did not reproduce would be refused by name.
    olmo3 = ["model=olmo2-tiny", "model.arch=olmo3", "cluster.devices_per_node=2", "parallel.pp=2"]
    assert trainable.unsupported_features(validate(compose(olmo3))) == []
    monkeypatch.setattr(trainable, "GENERIC_PIPELINE", frozenset())
    (refused,) = trainable.unsupported_features(validate(compose(olmo3)))
    assert "parallel.pp=" in refused and "olmo3, a family on the generic path" in refused
    base = ["model=llama-tiny", "model.arch=helium", "cluster.devices_per_node=2"]
    for degree in ("parallel.tp=2", "parallel.sp=2", "parallel.pp=2"):
        ran = cli("train", *base, degree, "--dry-run")
        assert ran.code == 0, ran.stderr
        assert "helium: generic path: llama's tensors" in ran.stdout and "sp, LoRA, pp" in ran.stdout
    # Ministral derives which layers slide from sliding_window itself: any window shorter than the sequence
    # is refused under sp, not only one that layer_types names.
    windowed = ["model=llama-tiny", "model.arch=ministral", "cluster.devices_per_node=2", "parallel.sp=2"]
    ran = cli("train", *windowed, "model.config.sliding_window=32")
    assert ran.code == 2 and "sliding attention window of 32 tokens" in ran.stderr, ran.stderr
    assert cli("train", *windowed, "model.config.sliding_window=4096", "--dry-run").code == 0
