"""A run's life, for real: signals stop it cleanly and it resumes exactly, no worker outlives a killed
launcher or torchrun, one run per folder, tracebacks in the run folder, and exit codes that say
what happened (0 trained, 1 failed or did not train, 2 refused, 128 + signal stopped).

Every launched run is in `_Runs`, whose teardown kills what is left (launcher, torchrun, workers),
also when a test fails.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from partrain.checkpoint import complete_checkpoints
from partrain.rehearse.runs import train_all
from partrain.runtime.procs import workers_of_run
from partrain.runtime.run_lock import LOCK_FILE, FolderLock, hold_folders, read_holder, retire_old_errors
from partrain.testing.parity import max_relative_difference, parity_args, run_training

ROOT = Path(__file__).resolve().parents[1]
DP2 = [
    "recipe=gpt-dp",
    "parallel.dp=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "data.max_bytes=1000000",
    "train.eval_every=0",
    "train.eval_batches=0",
]
ONE = [*DP2, "parallel.dp=1", "cluster.devices_per_node=1", "train.global_batch_size=2", "train.seq_len=32"]
STEPS = 16
"""Steps of the stop-and-resume runs: the signal is sent after step 1, the stop comes a step later."""


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


class _Runs:
    """`partrain train` runs started in the background; `cleanup` kills whatever is left of them."""

    def __init__(self) -> None:
        self.started: List[tuple] = []

    def start(self, overrides: List[str], run_dir: Path, steps: int) -> subprocess.Popen:
        args = [*overrides, f"train.steps={steps}", f"train.run_dir={run_dir}"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "partrain.cli", "train", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, COLUMNS="250"),
        )
        self.started.append((proc, run_dir))
        return proc

    def cleanup(self) -> None:
        for proc, run_dir in self.started:
            for pid in [proc.pid, *workers_of_run(run_dir)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)


@pytest.fixture
def runs():
    started = _Runs()
    yield started
    started.cleanup()


def _wait_training(proc: subprocess.Popen, run_dir: Path, timeout: float = 300) -> None:
    """Until rank 0 recorded its first step (metrics.jsonl), so a signal lands mid-run. The deadline only
    stops a hung launch: 120 s was too short once on a clean clone's loaded CI run (2026-12-07)."""
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.exists() and metrics.read_text().strip()):
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before training:\n{proc.stdout.read()}\n{proc.stderr.read()}")
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.02)


def _no_workers_within(run_dir: Path, seconds: float) -> float:
    """Seconds until no process of this run folder is left (fails after `seconds`)."""
    t0 = time.monotonic()
    while workers_of_run(run_dir):
        assert time.monotonic() - t0 < seconds, f"orphans left: {workers_of_run(run_dir)}"
        time.sleep(0.05)
    return time.monotonic() - t0


def _torchrun_of(proc: subprocess.Popen, run_dir: Path) -> int:
    from partrain.runtime.procs import children_of

    kids = children_of(proc.pid)
    assert len(kids) == 1, kids
    return kids[0]


def _losses(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


# ---- stop, resume, no orphans ---------------------------------------------------------------------


def test_sigterm_stops_after_the_step_saves_and_resumes_exactly(runs, tmp_path, data_cache):
    """SIGTERM to `partrain train`: every rank stops after the same step, saves it, exit 143 with one
    line; the run folder's lock is held while it runs (a stale one from a dead process is taken
    over), an old errors/ is moved aside, and resume=auto continues to the uninterrupted losses."""
    base = [*DP2, f"data.cache_dir={data_cache}", "checkpoint.every_steps=1000", "checkpoint.keep_last=0"]
    # The uninterrupted run, in real processes through the worker's code (testing.in_process.train_all).
    straight = train_all({"straight": parity_args(base, STEPS)}, tmp_path)["straight"]

    run_dir = tmp_path / "stopped"
    (run_dir / "errors").mkdir(parents=True)
    (run_dir / "errors" / "rank-1.txt").write_text("rank 1: RuntimeError: an earlier run's failure\n\n")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": int(dead.stdout)}))  # stale: its process is gone

    proc = runs.start(base, run_dir, STEPS)
    _wait_training(proc, run_dir)
    assert read_holder(run_dir)["pid"] == proc.pid
    with open(run_dir / LOCK_FILE) as f, pytest.raises(BlockingIOError):
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - sent
    assert proc.returncode == 143, out + err
    match = re.search(r"stopped by SIGTERM after step (\d+); checkpoint saved at (\S+); resume with ", out)
    assert match, out + err
    step = int(match.group(1))
    assert 1 <= step < STEPS and "Traceback" not in out + err
    print(f"SIGTERM -> exit 143 in {took:.2f} s (stopped after step {step})")
    assert [s for s, _ in complete_checkpoints(run_dir / "checkpoints")] == [step]
    assert Path(match.group(2)) == run_dir / "checkpoints" / f"step-{step:08d}"
    assert sorted(_losses(run_dir)) == list(range(1, step + 1))
    assert (run_dir / "errors" / "previous" / "rank-1.txt").exists() and not (
        run_dir / "errors" / "rank-1.txt"
    ).exists()
    _no_workers_within(run_dir, 5)

    resumed = run_training([*base, "checkpoint.resume=auto"], run_dir, STEPS)
    assert len(resumed.losses) == STEPS  # steps 1..N of the stopped run, then N+1.. of the resumed one
    assert max_relative_difference(straight.losses, resumed.losses) <= 1e-5


@pytest.mark.parametrize("victim", ["launcher", "torchrun"])
def test_kill_9_of_the_launcher_or_torchrun_leaves_no_worker(victim, runs, tmp_path, data_cache):
    """kill -9 of `partrain train` (torchrun gets SIGTERM as its parent-death signal) or of torchrun
    (the workers get SIGHUP): the workers stop after their step, save it, and are gone in seconds."""
    run_dir = tmp_path / "run"
    proc = runs.start([*DP2, f"data.cache_dir={data_cache}", "checkpoint.every_steps=1000"], run_dir, 1000)
    _wait_training(proc, run_dir)
    torchrun = _torchrun_of(proc, run_dir)
    os.kill(proc.pid if victim == "launcher" else torchrun, signal.SIGKILL)
    gone = _no_workers_within(run_dir, 15)
    print(f"kill -9 {victim}: every worker gone {gone:.2f} s later")
    out, err = proc.communicate(timeout=30)
    if victim == "torchrun":  # the launcher lives on and says what happened
        assert proc.returncode == 129, out + err
        assert "stopped because its launcher died, after step" in out and "Traceback" not in out + err
    assert len(complete_checkpoints(run_dir / "checkpoints")) == 1


def _pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits to be received by process pid (/proc/PID/status ShdPnd); False once it ended."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except FileNotFoundError:
        return False
    for line in lines:
        if line.startswith("ShdPnd:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _freeze(pids: List[int]) -> None:
    """SIGSTOP, and wait until every thread is stopped (until then a thread may still take signals)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            _until(lambda: "\tT" in (task / "status").read_text().split("State:", 1)[1].split("\n", 1)[0])


def _until(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_second_sigint_stops_at_once_without_a_complete_checkpoint(runs, tmp_path, data_cache):
    """Ctrl-C twice: exit 130 at once, the step in progress not saved. No timing is assumed: both
    workers are frozen (SIGSTOP) while the launcher forwards the first SIGINT; then only worker A runs
    and takes it, while B stays frozen, so A cannot finish the step or its save (both need B's
    collectives). The second SIGINT then reaches A as a second signal (B's is merged into its pending
    first), A ends at once, and only then does B run again."""
    run_dir = tmp_path / "run"
    proc = runs.start([*DP2, f"data.cache_dir={data_cache}", "checkpoint.every_steps=1000"], run_dir, 1000)
    _wait_training(proc, run_dir)
    from partrain.runtime.procs import children_of

    workers = children_of(_torchrun_of(proc, run_dir))
    assert len(workers) == 2, workers
    a, b = workers
    _freeze(workers)
    proc.send_signal(signal.SIGINT)
    _until(lambda: all(_pending(pid, signal.SIGINT) for pid in workers))
    os.kill(a, signal.SIGCONT)
    _until(lambda: _gone(a) or not _pending(a, signal.SIGINT))
    proc.send_signal(signal.SIGINT)
    _until(lambda: _gone(a), seconds=30)
    os.kill(b, signal.SIGCONT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, out + err
    assert "stopped by SIGINT at once" in out and "Traceback" not in out + err
    assert complete_checkpoints(run_dir / "checkpoints") == []
    _no_workers_within(run_dir, 5)


def _gone(pid: int) -> bool:
    """Whether process pid has ended (no longer exists, or a zombie not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_the_stop_watch_exits_at_once_on_a_second_signal_while_the_main_thread_is_busy(tmp_path):
    """The worker's StopWatch in a bare process: the first SIGTERM is a request the main thread reads,
    the second ends the process with 143 although the main thread never looks again."""
    script = (
        "import sys, time\n"
        "from partrain.runtime.signals import StopWatch\n"
        "stop = StopWatch('test').start()\n"
        "print('ready', flush=True)\n"
        "while not stop.signum: time.sleep(0.01)\n"
        "print('requested', stop.signum, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline() == f"requested {int(signal.SIGTERM)}\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 143
    finally:
        proc.kill()
        proc.wait()


# ---- one run per folder -----------------------------------------------------------------------------


def test_a_second_run_on_a_held_folder_exits_2_naming_the_holder_before_starting_anything(run_partrain, tmp_path):
    run_dir, ckpt_dir = tmp_path / "held", tmp_path / "ckpts"
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "spawn-guard"), str(ROOT)])}
    with hold_folders([run_dir]):
        ran = run_partrain("train", "recipe=gpt-dp", f"train.run_dir={run_dir}", env=env)
    assert ran.code == 2, ran.stdout + ran.stderr
    assert "train.run_dir" in ran.stderr and f"pid {os.getpid()}" in ran.stderr and "kill -TERM" in ran.stderr
    assert ran.spawned == [] and "Traceback" not in ran.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing written by the refused run

    with hold_folders([ckpt_dir]):
        ran = run_partrain(
            "train", "recipe=gpt-dp", f"train.run_dir={tmp_path / 'new'}", f"checkpoint.dir={ckpt_dir}", env=env
        )
    assert ran.code == 2 and "checkpoint.dir" in ran.stderr and ran.spawned == []
    assert not (tmp_path / "new").exists()  # the run folder the refused run created is gone again

    (tmp_path / "a-file").write_text("not a folder")
    ran = run_partrain("train", "recipe=gpt-dp", f"train.run_dir={tmp_path / 'a-file'}", env=env)
    assert ran.code == 2 and "train.run_dir" in ran.stderr and "Traceback" not in ran.stderr and ran.spawned == []


def test_a_stale_lock_is_taken_over_and_old_errors_are_moved_aside(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_FILE).write_text(json.dumps({"pid": 999999999}))
    lock = FolderLock(folder)
    lock.acquire()  # no process holds the flock: taken at once
    assert read_holder(folder)["pid"] == os.getpid()
    lock.release()

    errors = folder / "errors"
    (errors / "previous").mkdir(parents=True)
    (errors / "previous" / "rank-3.txt").write_text("two runs ago")
    (errors / "rank-0.txt").write_text("one run ago")
    assert retire_old_errors(folder) == errors / "previous"
    assert sorted(p.name for p in errors.iterdir()) == ["previous"]
    assert sorted(p.name for p in (errors / "previous").iterdir()) == ["rank-0.txt"]


# ---- honest exit codes, tracebacks in the run folder ---------------------------------------------------


@pytest.mark.parametrize(
    "case, overrides, message",
    [
        pytest.param(
            "all-skipped",
            ["train.precision=fp16", "train.loss_scale_init=1.8e19", "train.steps=2"],
            "all 2 optimizer steps were skipped",
            id="fp16-every-step-overflows",
        ),
        pytest.param(
            "failed",
            ["optim.lr=1e10", "train.steps=3"],
            "training failed: rank 0: FloatingPointError: loss became nan at step 2",
            id="worker-raises",
        ),
    ],
)
def test_a_run_that_did_not_train_exits_1_with_one_line(case, overrides, message, tmp_path, data_cache):
    run_dir = tmp_path / "run"
    args = [*ONE, f"data.cache_dir={data_cache}", *overrides, f"train.run_dir={run_dir}"]
    proc = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *args],
        capture_output=True,
        text=True,
        # A 3-step one-process run takes seconds; under CI's load it once took 4 min 43 s to fail (a load
        # average of 150 on 2 cores) and 300 s cut it short.
        timeout=900,
        env=dict(os.environ, COLUMNS="250"),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert message in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    if case == "failed":  # the details are in the run folder
        assert f"traceback: {run_dir / 'errors' / 'rank-0.txt'}" in proc.stdout
        assert "Traceback" in (run_dir / "errors" / "rank-0.txt").read_text()
        assert "ChildFailedError" in (run_dir / "logs" / "torchrun.log").read_text()
    else:
        assert json.loads((run_dir / "summary.json").read_text())["problem"].startswith(message.split(",")[0])


def test_a_final_loss_that_is_not_finite_is_a_problem_and_a_finished_run_is_not():
    """The verdict the summary carries (the fp16 case above runs it end to end): a NaN or inf final
    loss (train.stop_on_nan=false) is reported; skipped steps among taken ones are not."""
    from partrain.train.loop import StepResult, TrainState

    def step(i, loss, skipped=False):
        return StepResult(i, loss, 1e-3, 1.0, 0.1, 100.0, loss_scale=1024.0, skipped=skipped)

    assert TrainState(history=[step(1, 5.0, True), step(2, 4.0)]).problem() is None
    assert TrainState(history=[]).problem() is None
    for bad in (float("nan"), float("inf")):
        problem = TrainState(history=[step(1, 5.0), step(2, bad)]).problem()
        assert problem.startswith(f"the final loss is {bad}, not finite") and "optim.lr" in problem
    assert (
        TrainState(history=[step(1, 5.0, True), step(2, 5.0, True)])
        .problem()
        .startswith("all 2 optimizer steps were skipped")
    )
