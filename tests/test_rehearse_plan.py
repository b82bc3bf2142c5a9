"""`partrain rehearse`'s plans, without a process: what shrinks and what the layout keeps, for every shipped
recipe and model family; bad input is exit 2; the dry run says how to rehearse and what the last rehearsal
found. The rehearsals themselves run in tests/test_rehearse.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from partrain.blueprint.config.compose import compose
from partrain.blueprint.families.generic_moe import EXPERTS_KEYS
from partrain.blueprint.rehearsal import DEFAULT_MAX_PROCESSES, plan_rehearsal
from partrain.blueprint.trainable import unsupported_features
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml"))
MODELS = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml") if p.stem != "empty")
AXES = ("dp", "tp", "pp", "sp", "ep")


def _runs(overrides):
    """The user's run and the plan's two runs, validated and trainable."""
    user = validate(compose(overrides))
    plan = plan_rehearsal(user, list(overrides))
    layout = validate(compose(list(plan.layout_overrides)))
    reference = validate(compose([*plan.layout_overrides, *plan.reference_overrides]))
    for v in (layout, reference):
        assert unsupported_features(v) == [], (overrides, unsupported_features(v))
    assert reference.world_size == 1 and layout.world_size == plan.world <= DEFAULT_MAX_PROCESSES
    return user, plan, layout


def _shipped_recipes():
    """The recipes that compose on this machine as shipped (one reads a model folder a user provides)."""
    out = []
    for name in RECIPES:
        try:
            validate(compose([f"recipe={name}"]))
        except ConfigError:
            continue
        out.append(name)
    return out


def test_every_shipped_recipe_has_a_rehearsal_that_keeps_every_axis():
    recipes = _shipped_recipes()
    assert {"gpt-3d", "llama3-70b-h100", "mixtral-ep", "gpt3-175b-h100"} <= set(recipes), recipes
    for name in recipes:
        user, plan, layout = _runs([f"recipe={name}"])
        for axis in AXES:  # each axis the user splits stays split, maybe by less
            assert (getattr(layout.layout, axis) > 1) == (getattr(user.layout, axis) > 1), (name, axis)
        assert layout.run.model.arch == user.run.model.arch and layout.run.train.precision == "fp32"
        assert layout.run.parallel.pp_schedule == user.run.parallel.pp_schedule
        assert layout.run.parallel.zero_stage == user.run.parallel.zero_stage
        assert layout.run.parallel.recompute == user.run.parallel.recompute
        assert layout.facts.hidden <= 256 and layout.facts.n_layers <= 16, (name, layout.facts)
        reduced = {c.key for c in plan.changes if c.key.startswith("parallel.")}
        if user.world_size > DEFAULT_MAX_PROCESSES:
            assert reduced, name
    seventy = plan_rehearsal(validate(compose(["recipe=llama3-70b-h100"])), ["recipe=llama3-70b-h100"])
    assert seventy.world == 16 and [(c.key, c.before, c.after) for c in seventy.changes][0] == ("parallel.tp", 8, 2)
    assert any("bf16" in line for line in seventy.not_rehearsed) and any(
        "nccl" in line for line in seventy.not_rehearsed
    )


LAYOUTS = {
    "tp2": ["parallel.tp=2"],
    "pp2-interleaved": ["parallel.pp=2", "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=2"],
    "sp2-ulysses": ["parallel.sp=2", "parallel.sp_mode=ulysses"],
}


EXPERT_KEYS = EXPERTS_KEYS


@pytest.mark.parametrize("model", MODELS)
def test_every_family_shrinks_with_every_degree_still_dividing(model):
    """Each shipped model made big (and with 32 experts where it has experts), under each layout and ep2
    for the MoE ones: the rehearsal's model is small, of the same family and options, and valid for the
    same degrees (heads by tp and Ulysses sp, layers by the stages, experts by ep)."""
    from partrain.blueprint.families import family

    config = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    fam = family(config["arch"])
    sizes = fam.hf_config(hidden=1024, layers=12, heads=16, kv_heads=8, ffn=2048)
    big = [f"model={model}", *(f"++model.config.{k}={v}" for k, v in sizes.items())]
    if "head_dim" in config["config"]:
        big.append("++model.config.head_dim=64")
    big += [f"++model.config.{k}=32" for k in EXPERT_KEYS if k in config["config"]]
    if "n_group" in config["config"]:  # group-limited routing: 8 groups of 4, the best 4 groups
        big += ["++model.config.n_group=8", "++model.config.topk_group=4"]
    cases = dict(LAYOUTS)
    if any(k in config["config"] for k in EXPERT_KEYS):
        cases["ep2"] = ["parallel.ep=2", "parallel.dp=2"]
    tried = 0
    for name, layout in cases.items():
        overrides = [*big, *layout, "cluster.devices_per_node=2"]
        try:
            refused = unsupported_features(validate(compose(overrides)))
        except ConfigError:
            refused = True
        if refused:
            continue  # a layout the family refuses before any rehearsal (docs/families.md)
        user, plan, shrunk = _runs(overrides)
        tried += 1
        assert shrunk.run.model.arch == user.run.model.arch and shrunk.facts.hidden < user.facts.hidden, name
        assert shrunk.facts.n_experts <= 8 and shrunk.facts.experts_per_token == user.facts.experts_per_token
        groups = (shrunk.run.model.config or {}).get("n_group")
        if groups:  # a group's score is its best two experts' (DeepSeek-V3, GLM-4.5): two or more a group
            assert shrunk.facts.n_experts // groups >= 2, (model, name, groups)
        for axis in AXES:
            assert getattr(shrunk.layout, axis) == getattr(user.layout, axis), (model, name, axis)
    assert tried >= 2, model


def test_a_pretrained_folder_is_rehearsed_as_its_architecture_shrunk(tmp_path):
    """The folder's weights cannot shrink: its config.json's architecture (every field of the class) is
    built small with random weights; its tokenizer stays the data's."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        rope_theta=5e5,
        tie_word_embeddings=True,
    )
    folder = tmp_path / "my-llama"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    overrides = [f"model.pretrained={folder}", "data.tokenizer=byte", "parallel.tp=2", "cluster.devices_per_node=2"]
    user, plan, shrunk = _runs(overrides)
    assert shrunk.run.model.pretrained is None and shrunk.run.model.arch == "llama"
    assert (shrunk.facts.hidden, shrunk.facts.heads, shrunk.facts.kv_heads) == (64, 4, 2)
    assert shrunk.facts.tied_embeddings and shrunk.run.model.config["rope_parameters"]["rope_theta"] == 5e5
    assert plan.dropped_overrides == (f"model.pretrained={folder}",)


def test_bad_input_is_exit_2_before_any_process(cli, tmp_path):
    ran = cli("rehearse", "recipe=gpt-3d", "parallel.tp=3")
    assert ran.code == 2 and "parallel.tp" in ran.stderr and not ran.spawned
    ran = cli("rehearse", "recipe=gpt-3d", "--steps", "0")
    assert ran.code == 2 and "--steps" in ran.stderr and not ran.spawned
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    ran = cli("rehearse", "recipe=gpt-3d", "--out", str(full))
    assert ran.code == 2 and "--out" in ran.stderr and not ran.spawned


def test_the_dry_run_says_how_to_rehearse_and_what_the_last_rehearsal_found(cli, tmp_path):
    args = ["train", "recipe=gpt-3d", "parallel.zero_stage=3", "--dry-run"]
    cache = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    ran = cli(*args, env=cache)
    assert ran.code == 0 and "`partrain rehearse recipe=gpt-3d parallel.zero_stage=3`" in ran.stdout, ran.stdout[-800:]
    from partrain.blueprint.rehearsal import rehearsal_key
    from partrain.cli.rehearse_cmd import records_folder

    v = validate(compose(["recipe=gpt-3d", "parallel.zero_stage=3"]))
    folder = records_folder(cache)
    folder.mkdir(parents=True)
    record = {"passed": False, "when": "2026-12-07T10:00:00+00:00", "report": "/r/report.json"}
    (folder / f"{rehearsal_key(v)}.json").write_text(json.dumps(record))
    ran = cli(*args, env=cache)
    assert "did NOT match one process on CPU (2026-12-07T10:00:00+00:00; /r/report.json)" in ran.stdout
    # How long a run goes is not what a rehearsal proves: the same record answers.
    ran = cli(*args, "train.steps=7", env=cache)
    assert "did NOT match one process" in ran.stdout
