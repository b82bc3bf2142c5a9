"""Bad configs: each is refused before anything happens, with exit code 2 and one message naming the key.

Every row of BAD is run through the real CLI in-process (`train --dry-run` for humans, `train --json`
without --dry-run for scripts); every fifth row also through the installed `partrain` script in a
subprocess. A hypothesis test feeds random override values to compose + validate: the only
exception allowed out is ConfigError.
"""

from __future__ import annotations

import copy
import functools
import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.schema import RunConfig
from partrain.blueprint.report.layout import layout_report
from partrain.blueprint.trainable import IMPLEMENTED
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError

GPT = "recipe=gpt-3d"  # 8 ranks = dp2 x tp2 x pp2; gpt2-tiny: 4 layers, 4 heads, ffn 512, vocab 256, 512 positions
MOE = "recipe=mixtral-ep"  # 2 ranks = dp2, ep2; 4 experts
SP = "recipe=llama-long-sp"  # 4 ranks = dp2 x sp2 (ulysses); 4 heads, 2 KV heads, seq 1024

# (name, command-line arguments after `partrain train`, the key the one error must name).
# {user} is a user recipe folder holding broken.yaml (not YAML) and badgroup.yaml (unknown model option).
BAD = [
    ("degree-zero", [GPT, "parallel.tp=0"], "parallel.tp"),
    ("degree-negative", [GPT, "parallel.pp=-2"], "parallel.pp"),
    ("two-free-degrees", [GPT, "parallel.tp=-1", "parallel.dp=-1"], "parallel.dp"),
    ("product-not-world", [GPT, "parallel.dp=4"], "parallel"),
    ("free-degree-not-dividing", [GPT, "parallel.dp=-1", "parallel.tp=3", "parallel.pp=1"], "parallel.dp"),
    ("tp-vs-heads", [GPT, "model.config.n_head=2", "parallel.tp=4", "parallel.dp=1"], "parallel.tp"),
    ("tp-vs-kv-heads", [GPT, "model=llama-tiny", "parallel.tp=4", "parallel.dp=1"], "parallel.tp"),
    ("tp-vs-ffn", [GPT, "model.config.n_inner=511"], "parallel.tp"),
    ("tp-vs-vocab", [GPT, "model.config.vocab_size=257"], "parallel.tp"),
    (
        "tp-across-nodes",
        [GPT, "cluster.nodes=4", "cluster.devices_per_node=2", "parallel.tp=4", "parallel.dp=1"],
        "parallel.tp",
    ),
    (
        "order-splits-tp",
        [GPT, "parallel.order=[dp,tp,sp,pp]", "cluster.nodes=4", "cluster.devices_per_node=2"],
        "parallel.order",
    ),
    ("pp-over-layers", [GPT, "parallel.pp=8", "parallel.dp=1", "parallel.tp=1"], "parallel.pp"),
    ("virtual-stages-1f1b", [GPT, "parallel.pp_virtual_stages=2"], "parallel.pp_virtual_stages"),
    ("interleaved-needs-2", [GPT, "parallel.pp_schedule=interleaved-1f1b"], "parallel.pp_virtual_stages"),
    (
        "zbv-needs-exactly-2",
        [GPT, "parallel.pp_schedule=zbv", "train.global_batch_size=16"],
        "parallel.pp_virtual_stages",
    ),
    (
        "chunks-over-layers",
        [GPT, "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=4"],
        "parallel.pp_virtual_stages",
    ),
    (
        "virtual-without-pp",
        [GPT, "parallel.pp=1", "parallel.dp=4", "parallel.pp_virtual_stages=2"],
        "parallel.pp_virtual_stages",
    ),
    ("microbatches-under-stages", [GPT, "train.global_batch_size=4"], "train.microbatches"),
    (
        "interleaved-rounds",
        [GPT, "parallel.pp_schedule=interleaved-1f1b", "parallel.pp_virtual_stages=2", "train.global_batch_size=20"],
        "train.microbatches",
    ),
    ("global-not-multiple", [GPT, "train.global_batch_size=6"], "train.global_batch_size"),
    ("microbatches-inconsistent", [GPT, "train.microbatches=3"], "train.microbatches"),
    ("odd-micro-batch", [GPT, "train.micro_batch_size=3"], "train.global_batch_size"),
    ("ep-dense-model", [GPT, "parallel.ep=2"], "parallel.ep"),
    ("16bit-params-in-fp32", [GPT, "train.param_dtype=16bit"], "train.param_dtype"),
    (
        "ep-vs-experts",
        [MOE, "cluster.devices_per_node=8", "parallel.dp=8", "train.global_batch_size=16", "parallel.ep=8"],
        "parallel.ep",
    ),
    ("ep-vs-dp-sp", [MOE, "parallel.ep=4"], "parallel.ep"),
    ("sp-seq", [SP, "train.seq_len=1023"], "train.seq_len"),
    ("ring-2sp", [SP, "parallel.sp_mode=ring", "train.seq_len=1022"], "train.seq_len"),
    ("ulysses-heads", [SP, "parallel.sp=8", "parallel.dp=1", "cluster.devices_per_node=8"], "parallel.sp"),
    ("seq-over-positions", [GPT, "train.seq_len=1024", "model.config.n_positions=512"], "train.seq_len"),
    ("type-str-for-int", [GPT, "parallel.tp=abc"], "parallel.tp"),
    ("type-float-for-int", [GPT, "train.steps=2.5"], "train.steps"),
    ("type-list-for-int", [GPT, "cluster.nodes=[1,2]"], "cluster.nodes"),
    ("type-bool", [GPT, "model.trust_remote_code=maybe"], "model.trust_remote_code"),
    ("unknown-top", [GPT, "foo=1"], "foo"),
    ("unknown-top-plus", [GPT, "+foo=1"], "foo"),
    ("unknown-nested", [GPT, "parallel.tpp=2"], "parallel.tpp"),
    ("unknown-nested-plus", [GPT, "+parallel.foo=1"], "parallel.foo"),
    ("plus-existing", [GPT, "+parallel.tp=2"], "parallel.tp"),
    ("unknown-hf-field", [GPT, "+model.config.unknown_field=1"], "model.config.unknown_field"),
    ("unknown-recipe", ["recipe=nope"], "recipe"),
    ("unknown-group-option", ["model=foo"], "model"),
    ("group-not-a-name", [GPT, "model=null"], "model"),
    ("malformed-double-equals", [GPT, "parallel.tp==2"], "parallel.tp"),
    ("malformed-path", [GPT, "parallel..tp=2"], "parallel..tp"),
    ("sweep", [GPT, "parallel.tp=choice(1,2)"], "parallel.tp"),
    ("deletion", [GPT, "~parallel.tp"], "parallel.tp"),
    ("bad-interpolation", [GPT, "train.seq_len=${nope}"], "train.seq_len"),
    ("missing-pretrained", [GPT, "model.pretrained=/nonexistent/partrain-model"], "model.pretrained"),
    ("missing-data-source", [GPT, "data.source=/nonexistent/corpus.txt"], "data.source"),
    ("precision-enum", [GPT, "train.precision=fp8"], "train.precision"),
    ("schedule-enum", [GPT, "parallel.pp_schedule=foo"], "parallel.pp_schedule"),
    ("nccl-on-cpu", [GPT, "cluster.backend=nccl"], "cluster.backend"),
    ("negative-steps", [GPT, "train.steps=-1"], "train.steps"),
    ("negative-lr", [GPT, "optim.lr=-0.001"], "optim.lr"),
    ("zero-loss-scale", [GPT, "train.precision=fp16", "train.loss_scale_init=0"], "train.loss_scale_init"),
    ("zero-loss-scale-window", [GPT, "train.loss_scale_window=0"], "train.loss_scale_window"),
    (
        "unknown-fsdp-grad-sync",
        [GPT, "parallel.zero_stage=3", "parallel.fsdp_grad_sync=sometimes"],
        "parallel.fsdp_grad_sync",
    ),
    ("zero-stage-5", [GPT, "parallel.zero_stage=5"], "parallel.zero_stage"),
    ("dp-shard-not-dividing", [GPT, "parallel.dp_shard=3", "parallel.zero_stage=3"], "parallel.dp_shard"),
    ("world-too-large", [GPT, "cluster.nodes=100000", "cluster.devices_per_node=100000"], "cluster.nodes"),
    ("missing-model-fact", [GPT, "model.config.n_head=null"], "model.config.n_head"),
    ("hidden-vs-heads", [GPT, "model.config.n_embd=130"], "model.config.n_head"),
    (
        "kv-vs-heads",
        [GPT, "model=llama-tiny", "model.config.num_key_value_heads=3"],
        "model.config.num_key_value_heads",
    ),
    ("unknown-arch", [GPT, "model.arch=bert"], "model.arch"),
    ("bad-recipes-folder", [GPT, "--recipes", "/nonexistent/recipes"], "--recipes"),
    ("broken-user-recipe", ["recipe=broken", "--recipes", "{user}"], "recipe"),
    ("user-recipe-bad-option", ["recipe=badgroup", "--recipes", "{user}"], "recipe"),
]
SUBPROCESS_ROWS = BAD[::5] + [row for row in BAD if "--recipes" in row[1]]
assert len({name for name, _, _ in BAD}) == len(BAD) >= 30 and len({tuple(a) for _, a, _ in BAD}) == len(BAD)
assert len(SUBPROCESS_ROWS) >= 10


@pytest.fixture(scope="module")
def user_recipes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user-recipes")
    (folder / "broken.yaml").write_text("parallel: [1,\n")
    (folder / "badgroup.yaml").write_text("defaults:\n  - override /model: nope\n")
    return folder


def _args(args, user_recipes):
    return [a.replace("{user}", str(user_recipes)) for a in args]


def assert_refused(ran, key: str, as_json: bool) -> None:
    out = ran.stdout + ran.stderr
    assert ran.code == 2, out
    assert "Traceback" not in out
    assert ran.created() == [], "a refused config must create nothing"
    assert ran.spawned == [], "a refused config must start no process"
    if as_json:
        report = json.loads(ran.stdout)
        assert report["valid"] is False
        assert [e["key"] for e in report["errors"]] == [key], report
        error = report["errors"][0]
        assert set(error) == {"key", "value", "rule", "fix", "message"} and error["rule"] and key in error["message"]
    else:
        assert ran.stdout == ""
        lines = [line for line in ran.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"error: {key}="), ran.stderr


def test_the_in_process_guard_sees_a_launch(cli):
    """The fixture behind `spawned == []` does notice a launch: a valid run reaches it."""
    assert cli("train", "recipe=gpt-dp").spawned != []


def test_the_subprocess_guard_sees_a_process_start(run_partrain):
    ran = run_partrain("-c", "import subprocess; subprocess.run(['true'])", program=sys.executable)
    assert ran.code != 0 and len(ran.spawned) == 1


@pytest.mark.parametrize("name,args,key", BAD, ids=[row[0] for row in BAD])
def test_bad_config_refused_in_process(cli, user_recipes, name, args, key):
    args = _args(args, user_recipes)
    assert_refused(cli("train", *args, "--dry-run"), key, as_json=False)
    assert_refused(cli("train", *args, "--json"), key, as_json=True)  # no --dry-run: must stop before launching


@pytest.mark.parametrize("name,args,key", SUBPROCESS_ROWS, ids=[row[0] for row in SUBPROCESS_ROWS])
def test_bad_config_refused_by_the_installed_command(run_partrain, user_recipes, name, args, key):
    i = SUBPROCESS_ROWS.index((name, args, key))
    mode = [["--dry-run"], [], ["--json"], ["--dry-run", "--json"]][i % 4]
    assert_refused(run_partrain("train", *_args(args, user_recipes), *mode), key, as_json="--json" in mode)


UNSUPPORTED = [  # consistent layouts this version cannot train yet (partrain.blueprint.trainable)
    (
        "master-weights-ep",
        [MOE, "train.precision=bf16", "train.param_dtype=16bit", "parallel.zero_stage=1"],
        "train.param_dtype",
    ),
]


@pytest.mark.parametrize("feature,args,key", UNSUPPORTED, ids=[row[0] for row in UNSUPPORTED])
def test_unsupported_layout_is_planned_then_refused_by_train(cli, feature, args, key):
    if IMPLEMENTED[feature]:
        pytest.skip(f"{feature} is implemented now")
    planned = cli("plan", *args, "--json")
    report = json.loads(planned.stdout)
    assert planned.code == 0 and report["valid"] and any(note.startswith(f"{key}=") for note in report["notes"])
    assert_refused(cli("train", *args, "--json"), key, as_json=True)


def test_several_problems_are_all_reported():
    with pytest.raises(ConfigError) as err:
        validate(compose([GPT, "train.precision=fp8", "optim.lr=-1", "parallel.zero_stage=5"]))
    assert [p.key for p in err.value.problems] == ["train.precision", "parallel.zero_stage", "optim.lr"]


def test_fix_names_the_nearest_valid_degrees():
    with pytest.raises(ConfigError) as err:
        validate(compose([GPT, "parallel.tp=3"]))
    assert "parallel.dp=2 parallel.tp=2 parallel.pp=2 parallel.sp=1" in err.value.problems[0].fix


@pytest.mark.parametrize(
    "overrides,degrees",
    [
        ([GPT, "parallel.dp=-1"], dict(dp=2, tp=2, pp=2, sp=1, ep=1)),
        ([GPT, "parallel.dp=1", "parallel.tp=-1"], dict(dp=1, tp=4, pp=2, sp=1, ep=1)),
        ([MOE, "parallel.ep=-1"], dict(dp=2, tp=1, pp=1, sp=1, ep=2)),
        ([GPT, "parallel.ep=-1"], dict(dp=2, tp=2, pp=2, sp=1, ep=1)),  # a dense model: the rest for ep is 1
    ],
)
def test_minus_one_takes_the_rest(overrides, degrees):
    assert validate(compose(overrides)).layout.degrees == degrees


# --- random input: ConfigError or a valid run, never another exception -----------------------------

BASES = ["recipe=gpt-3d", "recipe=mixtral-ep", "recipe=llama-long-sp", "recipe=llama3-70b-h100", "model=qwen2-moe-tiny"]
NUMBERS = st.one_of(st.integers(-3, 20), st.sampled_from([-1, 0, 2**31, 10**12]))


@functools.lru_cache(maxsize=None)
def _composed(base: str) -> RunConfig:
    return compose([base])


def _check_outcome(make_run) -> None:
    try:
        validated = validate(make_run())
    except ConfigError as err:
        assert err.problems and all(isinstance(p.key, str) and p.key and p.rule for p in err.problems)
        json.dumps([p.to_json() for p in err.problems])
        return
    report = layout_report(validated)
    assert report["valid"] and len(report["ranks"]) == report["world_size"]
    json.dumps(report)


INT_FIELDS = (
    [
        ("parallel", f)
        for f in ("dp", "tp", "pp", "sp", "ep", "dp_shard", "zero_stage", "pp_virtual_stages", "recompute_every")
    ]
    + [("train", f) for f in ("seq_len", "micro_batch_size", "global_batch_size", "microbatches", "steps")]
    + [("cluster", f) for f in ("nodes", "devices_per_node")]
    + [
        ("model.config", f)
        for f in (
            "vocab_size",
            "n_head",
            "n_layer",
            "num_attention_heads",
            "num_key_value_heads",
            "num_hidden_layers",
            "intermediate_size",
            "num_local_experts",
            "max_position_embeddings",
        )
    ]
)
CHOICES = {
    ("parallel", "pp_schedule"): [
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
        "interleaved-zero-bubble",
        "zbv",
        "dualpipev",
        "x",
    ],
    ("parallel", "sp_mode"): ["ulysses", "ring", ""],
    ("parallel", "order"): [
        ["tp", "sp", "dp", "pp"],
        ["pp", "dp", "sp", "tp"],
        ["dp", "tp", "sp", "pp"],
        ["tp", "tp", "dp", "pp"],
        [],
    ],
    ("parallel", "pp_layers_per_stage"): [None, [1, 3], [2, 2, 0], [0, 4], [-1, 5]],
    ("cluster", "allow_tp_across_nodes"): [True, False],
}
FIELD_VALUES = st.one_of(
    st.tuples(st.sampled_from(INT_FIELDS), NUMBERS),
    st.sampled_from(sorted(CHOICES)).flatmap(lambda f: st.tuples(st.just(f), st.sampled_from(CHOICES[f]))),
)


@settings(max_examples=300, deadline=None)
@given(base=st.sampled_from(BASES), changes=st.lists(FIELD_VALUES, min_size=1, max_size=4))
def test_validator_on_random_values_raises_only_config_error(base, changes):
    """Degrees incl. 0, negatives and -1, odd batch sizes, huge clusters, bad orders and schedules."""

    def make_run():
        run = copy.deepcopy(_composed(base))
        for (section, name), value in changes:
            if section == "model.config":
                run.model.config[name] = value
            else:
                setattr(getattr(run, section), name, value)
        return run

    _check_outcome(make_run)


KEYS = [
    "parallel.dp",
    "parallel.tp",
    "parallel.ep",
    "parallel.dp_shard",
    "parallel.order",
    "parallel.pp_layers_per_stage",
    "parallel.pp_schedule",
    "cluster.devices_per_node",
    "cluster.allow_tp_across_nodes",
    "train.seq_len",
    "train.global_batch_size",
    "optim.lr",
    "data.source",
    "checkpoint.resume",
    "model.arch",
    "model.config.n_head",
    "model.config.num_key_value_heads",
    "model.config.mlp_only_layers",
    "model.pretrained",
    "model",
    "recipe",
    "parallel.foo",
    "+parallel.foo",
    "+model.config.foo",
    "~train.steps",
    "foo",
]
TOKENS = [
    "abc",
    "''",
    "null",
    "true",
    "[1,2]",
    "[]",
    "{a:1}",
    "1.5",
    "-0.5",
    "nan",
    "${nope}",
    "${train.steps}",
    "[tp,sp,dp,pp]",
    "ring",
    "zbv",
    "llama-tiny",
    "gpt-3d",
    "qwen2_moe",
    "/nonexistent",
    "a b",
    "=",
    "][",
]
OVERRIDES = st.lists(
    st.builds("{}={}".format, st.sampled_from(KEYS), st.one_of(NUMBERS.map(str), st.sampled_from(TOKENS))),
    min_size=1,
    max_size=3,
)


@settings(max_examples=40, deadline=None)
@given(base=st.sampled_from(BASES), overrides=OVERRIDES)
def test_compose_on_random_overrides_raises_only_config_error(base, overrides):
    """Strings for ints, null, lists, dicts, interpolations, unknown keys, `+`/`~` and malformed syntax."""
    _check_outcome(lambda: compose([base, *overrides]))


def test_huge_values_are_answered_at_once():
    """2**31 attention heads under Ulysses once made the fix hint list the divisors of 2**31 one trial at a
    time (minutes, found by the random test above with --hypothesis-seed=3): divisors now stop at sqrt(n)."""
    import time

    from partrain.blueprint.layout import divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12] and divisors(1) == [1] and divisors(0) == []
    run = copy.deepcopy(_composed("recipe=llama-long-sp"))
    run.model.config["num_attention_heads"] = 2**31
    run.train.global_batch_size = 2**31
    started = time.monotonic()
    _check_outcome(lambda: run)
    assert time.monotonic() - started < 10
