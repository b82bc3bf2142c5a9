"""Shared fixtures: the `partrain` command run as a user runs it, in an empty folder, with process
starts blocked and recorded (so a test can prove that no worker was ever launched)."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
import types
from dataclasses import dataclass
from pathlib import Path
from typing import List

import pytest

PARTRAIN = Path(sys.executable).with_name("partrain")
"""The console script installed beside this interpreter."""

_SPAWN_GUARD = """\
import os, subprocess
_log = os.environ.get("PARTRAIN_TEST_SPAWN_LOG")
if _log:
    def _blocked(*args, **kwargs):
        with open(_log, "a") as f:
            f.write(repr(args[1:3]) + "\\n")
        raise RuntimeError("partrain tests: starting a process is not allowed here")
    subprocess.Popen.__init__ = _blocked
    os.fork = os.posix_spawn = os.posix_spawnp = os.execv = os.execve = _blocked
"""


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    cwd: Path
    home: Path
    spawned: List[str]
    """Processes the command tried to start (each was refused)."""

    def created(self) -> List[str]:
        """Files and folders that appeared in the working folder or the home folder."""
        return sorted(str(p) for d in (self.cwd, self.home) for p in d.rglob("*"))


def _sandbox(tmp_path: Path):
    n = len(list(tmp_path.glob("run-*")))
    base = tmp_path / f"run-{n}"
    cwd, home = base / "cwd", base / "home"
    cwd.mkdir(parents=True)
    home.mkdir()
    return cwd, home, base / "spawned.log"


@pytest.fixture
def run_partrain(tmp_path):
    """Run the installed `partrain` console script in a fresh empty folder with an empty HOME."""
    guard = tmp_path / "spawn-guard"
    guard.mkdir(exist_ok=True)
    (guard / "sitecustomize.py").write_text(_SPAWN_GUARD)

    def run(*args: str, env: dict | None = None, timeout: float = 60, program: str = str(PARTRAIN)) -> Ran:
        cwd, home, log = _sandbox(tmp_path)
        full_env = {k: v for k, v in os.environ.items() if k != "PARTRAIN_RECIPES"}
        # The guard first; the caller's PYTHONPATH (a worktree tested with the venv of another checkout) after it.
        path = os.pathsep.join(p for p in (str(guard), os.environ.get("PYTHONPATH", "")) if p)
        full_env.update(HOME=str(home), PYTHONPATH=path, PARTRAIN_TEST_SPAWN_LOG=str(log), COLUMNS="200")
        full_env.update(env or {})
        proc = subprocess.run([program, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
        spawned = log.read_text().splitlines() if log.exists() else []
        return Ran(proc.returncode, proc.stdout, proc.stderr, cwd, home, spawned)

    return run


def refuse_process_starts(monkeypatch):
    """Make every way of starting a process raise; returns (the list the attempts are recorded in,
    the refusing function)."""
    spawned: List[str] = []

    def blocked(*args, **kwargs):
        spawned.append(repr(args[1:3]))
        raise RuntimeError("partrain tests: starting a process is not allowed here")

    monkeypatch.setattr(subprocess.Popen, "__init__", blocked)
    for name in ("fork", "posix_spawn", "posix_spawnp", "execv", "execve"):
        monkeypatch.setattr(os, name, blocked)
    return spawned, blocked


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """Invoke the CLI in-process (typer's CliRunner): same code path, no interpreter start-up.

    Runs in a fresh empty folder with an empty HOME; process starts and `partrain.launch.launch`
    are refused and recorded in `Ran.spawned`.
    """
    from typer.testing import CliRunner

    from partrain.cli import app

    spawned, blocked = refuse_process_starts(monkeypatch)
    monkeypatch.setitem(sys.modules, "partrain.launch", types.SimpleNamespace(launch=blocked))
    monkeypatch.delenv("PARTRAIN_RECIPES", raising=False)

    def run(*args: str, env: dict | None = None) -> Ran:
        cwd, home, _ = _sandbox(tmp_path)
        monkeypatch.chdir(cwd)
        monkeypatch.setenv("HOME", str(home))
        monkeypatch.setenv("COLUMNS", "250")  # rich wraps tables at 80 columns otherwise
        result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=True)
        stderr = result.stderr
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            stderr += "".join(traceback.format_exception(result.exception))
        return Ran(result.exit_code, result.stdout, stderr, cwd, home, list(spawned))

    return run


SINGLE_PROCESS_FILES = frozenset(
    f"test_{name}.py"
    for name in (
        "bad_rows",
        "bench_compute",
        "chat_examples",
        "chat_templates",
        "checkpoint_manager",
        "chunked_loss",
        "cli",
        "cli_polish",
        "code_size",
        "config",
        "rehearse_plan",
        "data",
        "docs",
        "eval_split",
        "example_stream",
        "ep_planner",
        "families",
        "faults_config",
        "finetune_dry_run",
        "gpu_memory",
        "grad_clip",
        "hf_writer",
        "host_work",
        "layout",
        "layout_report",
        "local_adamw",
        "packaging",
        "plan_verdict",
        "planner",
        "planner_gpu_calibration",
        "planner_gpu_time",
        "planner_peaks_cpu",
        "preflight_dry_run",
        "pretrained_as_is",
        "resume_identity",
        "schedule_picture",
        "schedules",
        "search_optimum",
        "simulate",
        "sp_planner",
        "validate",
        "what_runs_keep",
        "data_prepare",
        "no_silent_fallbacks",
        "quickstarts",
        "epochs",
        "doc_commands",
        "local_gpus",
        "mxfp4",
        "preference_data",
        "preference_trl",
    )
)
"""Test files whose tests run in pytest's process or start one short process at a time (planner,
validator, dry runs, at most one one-rank training run)."""


LAUNCHER_FILES = frozenset(
    f"test_{name}.py"
    for name in (
        "auto_layout",
        "bench_comm",
        "benchmark_gpu",
        "checkpoint_nodes",
        "device_script",
        "dp_sync_planner",
        "elastic",
        "faults_checkpoint",
        "faults_lifecycle",
        "hub",
        "multinode",
        "node_watch",
        "plan_vs_measured",
        "progress_output",
        "resume",
        "sft_recipe",
        "slurm",
        "streaming",
    )
)
"""Multi-process files about the launch itself (torchrun, SIGTERM, killed and hung nodes, resume,
elastic re-layout, SLURM): they run one at a time, apart from the parity files, whose training
processes come from one fork server."""

PROCESS_GROUPS = ("launchers", "parallel-layouts")
"""The two work units of the files that start training processes (every other file is a unit of its own)."""


def xdist_work_unit(nodeid: str) -> str:
    """The xdist work unit of a test: its file if that file is single-process, else one of two
    groups of the files that start training processes (LAUNCHER_FILES, or the rest)."""
    name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    if name in SINGLE_PROCESS_FILES:
        return name
    return PROCESS_GROUPS[0] if name in LAUNCHER_FILES else PROCESS_GROUPS[1]


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist (`-p no:xdist`) the hook is never called
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist (`-n 3`, the README's command) each group of the files that start training
    processes runs one test at a time on a worker of its own, and the single-process files on the
    third, each file on one worker so that its module fixtures run once. One group alone left a
    third of the two cores idle (sleeps, timeouts, one-process references, the parent's preparation
    between launches); a file not listed in SINGLE_PROCESS_FILES counts as multi-process."""
    from xdist.scheduler import LoadScopeScheduling

    class ProcessGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_work_unit(nodeid)

        def _assign_work_unit(self, node) -> None:
            # The process groups first, one to each of the first two workers: xdist would order the
            # units by test count, and a large single-process file could take a group's place.
            for group in reversed(PROCESS_GROUPS):
                if group in self.workqueue:
                    self.workqueue.move_to_end(group, last=False)
            super()._assign_work_unit(node)

    return ProcessGroupScheduling(config, log)


def pytest_configure(config):
    """Once, in pytest's own process (not in each xdist worker): the package's bytecode written beside its
    sources. The suite starts hundreds of interpreters (launchers, torchrun, workers); where
    PYTHONDONTWRITEBYTECODE is set (as on the CI machines) each would compile partrain's sources again,
    about half a CPU second apiece. An unwritable checkout just compiles as before."""
    import compileall

    import partrain

    if not hasattr(config, "workerinput"):
        compileall.compile_dir(Path(partrain.__file__).parent, quiet=2)


def pytest_collection_modifyitems(config, items):
    """The fast tier, `pytest -m "not slow"`: every test of a file that starts training processes
    (one not in SINGLE_PROCESS_FILES) counts as slow, so the fast tier is the single-process files
    (planner, validator, dry runs, CLI, data, config): minutes, where the whole suite takes 20 and more."""
    slow = pytest.mark.slow
    for item in items:
        if xdist_work_unit(item.nodeid) in PROCESS_GROUPS:
            item.add_marker(slow)
