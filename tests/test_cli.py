"""The command line as a user meets it: show, recipes (user folders win, shadowing marked), the dry
run's JSON contract, its speed, and that it never imports torch."""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict

import pytest
import yaml
from conftest import PARTRAIN

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.paths import shipped_recipes_dir

MINE = textwrap.dedent("""\
    # @package _global_
    description: my own gpt-3d, pure data parallel
    defaults:
      - override /model: gpt2-tiny
      - override /cluster: local-cpu
    cluster: {devices_per_node: 4}
    parallel: {dp: 4}
    train: {micro_batch_size: 2, global_batch_size: 8}
    """)


@pytest.fixture
def user_folder(tmp_path):
    folder = tmp_path / "my-recipes"
    folder.mkdir()
    (folder / "gpt-3d.yaml").write_text(MINE)
    return folder


def test_help_lists_the_commands(cli):
    ran = cli("--help")
    assert ran.code == 0
    assert all(cmd in ran.stdout for cmd in ("train", "plan", "show", "recipes", "checkpoint"))


def test_show_prints_the_resolved_yaml(run_partrain):
    ran = run_partrain("show", "recipe=gpt-3d", "parallel.tp=4")
    assert ran.code == 0, ran.stderr
    shown = yaml.safe_load(ran.stdout)
    assert shown["parallel"]["tp"] == 4 and shown["recipe"] == "gpt-3d"
    assert shown["model"]["config"]["n_layer"] == 4 and "${" not in ran.stdout
    assert ran.created() == []


def test_show_json_matches_compose(cli):
    ran = cli("show", "recipe=mixtral-ep", "--json")
    assert ran.code == 0
    assert json.loads(ran.stdout) == json.loads(json.dumps(asdict(compose(["recipe=mixtral-ep"]))))


def test_show_explain_documents_every_key(cli):
    from test_config import _schema_keys

    ran = cli("show", "--explain", "--json")
    assert ran.code == 0
    rows = json.loads(ran.stdout)
    assert {r["key"] for r in rows} == set(_schema_keys())
    assert all(r["doc"].strip() and r["type"] for r in rows)
    human = cli("show", "--explain", "recipe=gpt-3d")
    assert human.code == 0 and "parallel.pp_schedule" in human.stdout


def test_recipes_lists_the_shipped_ones(cli):
    ran = cli("recipes", "--json")
    assert ran.code == 0
    listed = {r["name"]: r for r in json.loads(ran.stdout)}
    assert sorted(listed) == sorted(p.stem for p in shipped_recipes_dir().glob("*.yaml"))
    assert all(r["shipped"] and r["shadows"] is None for r in listed.values())


@pytest.mark.parametrize("how", ["option", "env"])
def test_user_recipe_wins_over_shipped_and_is_marked(cli, user_folder, how):
    args, env = (
        (["--recipes", str(user_folder)], None) if how == "option" else ([], {"PARTRAIN_RECIPES": str(user_folder)})
    )
    ran = cli("train", "recipe=gpt-3d", "--dry-run", "--json", *args, env=env)
    assert ran.code == 0, ran.stderr
    assert json.loads(ran.stdout)["degrees"] == {"dp": 4, "tp": 1, "pp": 1, "ep": 1, "sp": 1}

    listed = {r["name"]: r for r in json.loads(cli("recipes", "--json", *args, env=env).stdout)}
    mine = listed["gpt-3d"]
    assert mine["path"] == str(user_folder / "gpt-3d.yaml") and not mine["shipped"]
    assert mine["shadows"] == str(shipped_recipes_dir() / "gpt-3d.yaml")
    assert mine["description"] == "my own gpt-3d, pure data parallel"
    assert listed["gpt-dp"]["shipped"] and listed["gpt-dp"]["shadows"] is None

    human = cli("recipes", *args, env=env)
    line = next(line for line in human.stdout.splitlines() if "gpt-3d" in line)
    assert "overrides" in human.stdout and str(user_folder.name) in human.stdout and "shipped" not in line


def test_option_folder_wins_over_env_folder(cli, user_folder, tmp_path):
    other = tmp_path / "env-recipes"
    other.mkdir()
    (other / "gpt-3d.yaml").write_text(
        MINE.replace("dp: 4", "dp: 2").replace("devices_per_node: 4", "devices_per_node: 2")
    )
    ran = cli("plan", "recipe=gpt-3d", "--json", "--recipes", str(user_folder), env={"PARTRAIN_RECIPES": str(other)})
    assert json.loads(ran.stdout)["degrees"]["dp"] == 4
    ran = cli("plan", "recipe=gpt-3d", "--json", env={"PARTRAIN_RECIPES": str(other)})
    assert json.loads(ran.stdout)["degrees"]["dp"] == 2


@pytest.mark.parametrize(
    "args,env,key",
    [
        (["--recipes", "/nonexistent/recipes"], None, "--recipes"),
        ([], {"PARTRAIN_RECIPES": "/nonexistent/recipes"}, "PARTRAIN_RECIPES"),
    ],
)
def test_recipe_folder_that_does_not_exist_is_named(cli, args, env, key):
    for command in (["recipes", "--json"], ["show", "--json"], ["plan", "recipe=gpt-3d", "--json"]):
        ran = cli(*command, *args, env=env)
        assert ran.code == 2 and [e["key"] for e in json.loads(ran.stdout)["errors"]] == [key]


def test_dry_run_json_contract(cli):
    ran = cli("train", "recipe=gpt-3d", "--dry-run", "--json")
    assert ran.code == 0, ran.stderr
    assert ran.created() == [] and ran.spawned == []
    report = json.loads(ran.stdout)
    assert report["valid"] is True and report["world_size"] == 8
    assert report["degrees"] == {"dp": 2, "tp": 2, "pp": 2, "ep": 1, "sp": 1}
    assert sorted(report["order"]) == ["dp", "pp", "sp", "tp"]
    assert [r["rank"] for r in report["ranks"]] == list(range(8))
    for row in report["ranks"]:
        assert set(row) >= {"rank", "node", "local_rank", "coords"}
        assert set(row["coords"]) == {"dp", "tp", "pp", "sp", "ep"}
    assert set(report["groups"]) >= {"tp", "sp", "dp", "pp", "ep"}
    for family in ("tp", "sp", "dp", "pp", "ep"):
        groups = report["groups"][family]
        assert sorted(r for g in groups for r in g) == list(range(8))
        assert {len(g) for g in groups} == {report["degrees"][family]}


def test_dry_run_human_report(cli):
    ran = cli("train", "recipe=gpt-3d", "--dry-run")
    assert ran.code == 0
    assert "world size" in ran.stdout and "process groups" in ran.stdout and "verdict" in ran.stdout


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_dry_run_is_fast_and_touches_nothing(run_partrain):
    """Target: under 3 s. Asserted on CPU time, which other load on the machine does not inflate;
    wall time is printed and only guarded against hangs."""
    wall, cpu = [], []
    for _ in range(3):
        start, start_cpu = time.perf_counter(), _child_cpu()
        ran = run_partrain("train", "recipe=gpt-3d", "--dry-run")
        wall.append(time.perf_counter() - start)
        cpu.append(_child_cpu() - start_cpu)
        assert ran.code == 0 and ran.created() == [] and ran.spawned == [], ran.stderr
    print(
        f"\n`partrain train recipe=gpt-3d --dry-run`: median wall {statistics.median(wall):.2f} s "
        f"({', '.join(f'{t:.2f}' for t in wall)}), median CPU {statistics.median(cpu):.2f} s"
    )
    assert statistics.median(cpu) < 3.0
    assert statistics.median(wall) < 15.0


def test_dry_run_does_not_import_torch():
    code = textwrap.dedent("""\
        import sys
        from partrain.cli import main
        for argv in (["train", "recipe=gpt-3d", "--dry-run"], ["plan", "recipe=mixtral-ep", "--json"],
                     ["train", "recipe=gpt-3d", "parallel.tp=3", "--json"], ["show", "--explain"], ["recipes"]):
            try:
                main(argv)
            except SystemExit as exit:
                assert exit.code in (0, 2, None), (argv, exit.code)
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        assert not heavy, heavy
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_launch_imports_no_torch_before_torchrun_starts(tmp_path):
    """The launcher's own work (compose, validate, preflight of folders, checkpoints and data, run
    folder) stays torch-free: torchrun and every worker import torch anyway, and an import here
    would add seconds to every run (and to every multi-process test)."""
    code = textwrap.dedent(f"""\
        import sys
        import partrain.launch
        from partrain.cli import main
        seen = {{}}
        def start(*args, **kwargs):
            seen["heavy"] = sorted(m for m in ("torch", "transformers") if m in sys.modules)
            return 0
        partrain.launch._start = start
        try:
            main(["train", "recipe=gpt-dp", "train.run_dir={tmp_path / "run"}", "data.cache_dir={tmp_path / "data"}",
                  "data.max_bytes=100000", "train.eval_batches=0", "checkpoint.resume=auto"])
        except SystemExit as exit:
            assert exit.code in (0, None), exit.code
        assert seen == {{"heavy": []}}, seen
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


def test_console_script_is_installed():
    assert PARTRAIN.exists()
