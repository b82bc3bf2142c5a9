"""The built wheel, not the checkout, provides the config tree and the recipes.

The wheel is installed into a scratch venv whose only other packages are this environment's
site-packages, added by a .pth line (so the editable install's own .pth, which points at the
checkout, is not processed there). Everything runs from an empty folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv folder, environment) of a scratch venv holding the wheel built from this checkout."""
    base = tmp_path_factory.mktemp("packaging")
    dist, venv = base / "dist", base / "venv"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-q",
            "-w",
            dist,
            REPO,
        ]
    )
    wheel = next(dist.glob("partrain-*.whl"))
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_partrain_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PARTRAIN_RECIPES")}
    return venv, env, base


def test_wheel_ships_conf_and_recipes(installed):
    venv, env, base = installed
    cwd = base / "cwd-api"
    cwd.mkdir()
    code = textwrap.dedent("""\
        import json, partrain
        from partrain.blueprint.config.paths import conf_dir, shipped_recipes_dir
        from partrain.blueprint.config.compose import compose
        from partrain.blueprint.validate import validate
        v = validate(compose(["recipe=gpt-3d"]))
        print(json.dumps({"package": partrain.__file__, "conf": str(conf_dir()), "recipes": str(shipped_recipes_dir()),
                          "world": v.world_size, "degrees": v.layout.degrees}))
        """)
    found = json.loads(_run([venv / "bin" / "python", "-c", code], cwd=cwd, env=env).stdout)
    root = str(venv.resolve())
    assert all(found[k].startswith(root) for k in ("package", "conf", "recipes")), found
    assert found["conf"].endswith("partrain/_conf") and found["recipes"].endswith("partrain/_recipes")
    assert found["world"] == 8 and found["degrees"] == {"dp": 2, "tp": 2, "pp": 2, "ep": 1, "sp": 1}
    assert str(REPO) not in json.dumps(found)


def test_installed_command_runs_a_dry_run(installed):
    venv, env, base = installed
    cwd = base / "cwd-cli"
    cwd.mkdir()
    ran = _run([venv / "bin" / "partrain", "train", "recipe=gpt-3d", "--dry-run", "--json"], cwd=cwd, env=env)
    assert json.loads(ran.stdout)["world_size"] == 8
    listed = json.loads(_run([venv / "bin" / "partrain", "recipes", "--json"], cwd=cwd, env=env).stdout)
    assert {r["name"] for r in listed} >= {"gpt-3d", "gpt-dp", "mixtral-ep"}
    assert all(r["path"].startswith(str(venv.resolve())) for r in listed)
    assert list(cwd.iterdir()) == []
