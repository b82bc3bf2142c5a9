"""What a new user meets first: --version, help without `<bool>`, case-insensitive choice hints,
valid ranges in type errors, rounded report numbers, `show --diff`."""

from __future__ import annotations

import json

import pytest

from partrain import __version__
from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.cli import main
from partrain.errors import ConfigError


def run_main(capsys, *args):
    with pytest.raises(SystemExit) as ended:
        main(list(args))
    out = capsys.readouterr()
    return ended.value.code, out.out, out.err


def test_version(capsys):
    code, out, _ = run_main(capsys, "--version")
    assert code == 0 and out.startswith(f"partrain {__version__} (torch ") and "transformers" in out


@pytest.mark.parametrize(
    "args", [["--help"], ["train", "--help"], ["show", "--help"], ["checkpoint", "info", "--help"]]
)
def test_help_shows_flags_without_a_type(capsys, monkeypatch, args):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_main(capsys, *args)
    assert code == 0 and "--help" in out and "<bool>" not in out
    if args == ["train", "--help"]:
        assert "--dry-run" in out and "<int>" in out  # options that take a value keep their type


def problem_of(*overrides):
    with pytest.raises(ConfigError) as err:
        validate(compose(["recipe=gpt-dp", *overrides]))
    (problem,) = err.value.problems
    return problem


def test_choices_are_suggested_whatever_the_case():
    assert problem_of("parallel.pp_schedule=1F1B").fix == "did you mean parallel.pp_schedule=1f1b?"
    assert problem_of("optim.schedule=Cosine").fix == "did you mean optim.schedule=cosine?"
    assert problem_of("train.precision=bf61").fix == "did you mean train.precision=bf16?"
    assert problem_of("cluster.backend=mpi").fix == "set cluster.backend=gloo"
    for override, hint in (("model=GPT2-Tiny", "did you mean model=gpt2-tiny?"), ("recipe=GPT-DP", "recipe=gpt-dp?")):
        with pytest.raises(ConfigError) as err:
            compose([override])
        assert hint in err.value.problems[0].fix


def test_type_errors_say_the_valid_values():
    assert "parallel.zero_stage takes an integer 0..3" in problem_of("parallel.zero_stage=two").rule
    assert "train.steps takes an integer >= 1" in problem_of("train.steps=many").rule
    assert "train.stop_on_nan takes true or false" in problem_of("train.stop_on_nan=maybe").rule
    assert "optim.lr takes a number" in problem_of("optim.lr=fast").rule


def test_report_numbers_are_rounded():
    from partrain.blueprint.report.estimate import _count

    assert [_count(n) for n in (891_648, 124_439_808, 7.2e9, 1.75e11, 2e12)] == [
        "0.89 M",
        "124 M",
        "7.2 B",
        "175 B",
        "2 T",
    ]


def test_show_diff_against_the_defaults_and_a_recipe(capsys):
    code, out, _ = run_main(capsys, "show", "--diff", "recipe=gpt-dp", "optim=sgd")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith("# differences from the defaults: ")
    assert "parallel.dp: 2  # default: -1" in lines and "optim.name: sgd  # default: adamw" in lines
    code, out, _ = run_main(
        capsys, "show", "--diff", "--against", "gpt-dp", "--json", "recipe=gpt-dp", "train.stop_on_nan=false"
    )
    assert code == 0 and json.loads(out) == {
        "against": "gpt-dp",
        "differences": [{"key": "train.stop_on_nan", "value": False, "base": True}],
    }
    code, _, err = run_main(capsys, "show", "--diff", "--against", "gpt-dpp")
    assert code == 2 and "--against" in err and "gpt-dp" in err
    code, _, err = run_main(capsys, "show", "--against", "gpt-dp")
    assert code == 2 and "only goes with --diff" in err
