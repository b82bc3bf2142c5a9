"""SLURM: a worker's place derived from SLURM's variables alone (one task per device), the layout
checked against the allocation, and `partrain launch slurm`'s sbatch script for a layout.

No SLURM here: the environments are what srun gives each task (variables only), and the real run
starts the two tasks itself, as srun would."""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import partrain
from partrain.errors import ConfigError
from partrain.runtime.context import from_environ
from partrain.runtime.sbatch import parse_time
from partrain.runtime.slurm import PORT_SPAN, allocation_problems, expand_counts, expand_nodelist, master_port_for
from partrain.testing.parity import RunRecord, check_parity, run_training

REPO = Path(partrain.__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def no_sinfo(monkeypatch):
    """`launch slurm` reads the partition with sinfo when it is on PATH (a machine with slurm-wlm, such as
    one that ran tests/e2e/slurm.sh): these tests decide what sinfo says themselves."""
    from partrain.runtime import partition

    real = partition.read_sinfo
    monkeypatch.setattr(partition, "read_sinfo", lambda which=lambda _: None: real(which=which))


def fake_task(procid: int, nodes: int = 2, per_node: int = 4, nodelist: str = "node[03-04]", job: str = "4242"):
    """The variables srun sets for task `procid` of a `nodes` x `per_node` step (block distribution)."""
    return {
        "SLURM_JOB_ID": job,
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})" if nodes > 1 else str(per_node),
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid % per_node),
        "SLURM_NODEID": str(procid // per_node),
        "SLURM_STEP_ID": "0",
    }


def test_compressed_node_lists_and_counts_expand_like_scontrol():
    assert expand_nodelist("node[03-04]") == ["node03", "node04"]
    assert expand_nodelist("gpu[01-04,07]") == ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]
    assert expand_nodelist("a1,b[2-3],c") == ["a1", "b2", "b3", "c"]
    assert expand_nodelist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert expand_nodelist("gpu-[098-101].ib") == ["gpu-098.ib", "gpu-099.ib", "gpu-100.ib", "gpu-101.ib"]
    for bad in ("node[03-04", "node[a-b]", ""):
        with pytest.raises(ValueError):
            expand_nodelist(bad)
    assert expand_counts("4(x2),2") == [4, 4, 2]
    assert expand_counts("8") == [8]


def test_each_task_of_a_2x4_step_derives_its_rank_from_slurm_variables():
    port = master_port_for("4242")
    assert port == 15000 + 4242
    for procid in range(8):
        env = from_environ(fake_task(procid))
        assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (
            procid,
            8,
            procid % 4,
            4,
            procid // 4,
        )
        assert (env.master_addr, env.master_port) == ("node03", port)
        assert env.init_method == f"tcp://node03:{port}"
        assert allocation_problems(fake_task(procid), nodes=2, devices_per_node=4) == []
    # The step's own variables (srun inside sbatch) win over the job's; explicit MASTER_* win over both.
    step = dict(fake_task(5), SLURM_STEP_NODELIST="gpu[07,09]", MASTER_PORT="23456")
    assert (from_environ(step).master_addr, from_environ(step).master_port) == ("gpu07", 23456)
    assert from_environ(dict(fake_task(5), MASTER_ADDR="10.0.0.1")).master_addr == "10.0.0.1"
    # torchrun's variables come first; a one-task step is not a worker (partrain starts torchrun itself).
    assert from_environ(dict(fake_task(5), RANK="1", WORLD_SIZE="2")).rank == 1
    assert from_environ(dict(fake_task(0, nodes=1, per_node=1))) is None
    with pytest.raises(ConfigError, match="SLURM_PROCID"):
        from_environ(dict(fake_task(0), SLURM_PROCID="x"))


def test_an_allocation_that_does_not_match_the_layout_names_the_key():
    one_node = allocation_problems(fake_task(0, nodes=1, per_node=8), nodes=2, devices_per_node=4)
    assert [p.key for p in one_node] == ["cluster.nodes", "cluster.devices_per_node"]
    assert "srun --nodes=2 --ntasks-per-node=4" in one_node[0].fix
    two_per_node = allocation_problems(fake_task(0, nodes=2, per_node=2), nodes=2, devices_per_node=4)
    assert [(p.key, p.value) for p in two_per_node] == [("cluster.devices_per_node", 4)]
    assert "2,2 tasks per node" in two_per_node[0].rule
    # torchrun started by one task per node: its workers are torchrun's, the step is not checked.
    torchrun_worker = dict(fake_task(0, nodes=2, per_node=1), RANK="3", WORLD_SIZE="8")
    assert allocation_problems(torchrun_worker, nodes=2, devices_per_node=4) == []


def test_train_under_a_mismatched_srun_step_exits_2_before_any_file(tmp_path):
    """The real `partrain train` as srun would start it (task 0 of 1 node x 4), for a 2-process layout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "PARTRAIN_"))}
    env.update(fake_task(0, nodes=1, per_node=4, nodelist="localhost"), PYTHONPATH=str(REPO), HOME=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", "recipe=gpt-dp"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cluster.devices_per_node=2" in proc.stderr and "4 tasks per node" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == []


def test_srun_tasks_of_two_nodes_without_a_shared_checkpoint_dir_exit_2_before_any_file(tmp_path):
    """Issue 38: under srun, as under torchrun, a multi-node run saving into each node's own run folder
    is refused before any process or file (its checkpoints could never be resumed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "PARTRAIN_"))}
    env.update(fake_task(2, nodes=2, per_node=2, nodelist="localhost,127.0.0.1"), HOME=str(tmp_path))
    env.update(PYTHONPATH=str(REPO))
    args = ["recipe=gpt-dp", "cluster.nodes=2", "parallel.dp=4", "checkpoint.every_steps=5"]
    proc = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "checkpoint.dir" in proc.stderr and "every node mounts" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and [p.name for p in tmp_path.iterdir()] == []


def test_launch_slurm_refuses_node_local_checkpoints_of_a_multi_node_run(cli):
    args = ["recipe=gpt-dp", "cluster.nodes=2", "parallel.dp=4", "checkpoint.every_steps=5"]
    ran = cli("launch", "slurm", *args, "--out", "job.sbatch")
    assert ran.code == 2, ran.stdout + ran.stderr
    assert "checkpoint.dir" in ran.stderr and "set checkpoint.dir to a folder on a file system every node mounts" in (
        " ".join(ran.stderr.split())
    )
    assert ran.created() == [] and ran.spawned == []
    ran = cli("launch", "slurm", *args, "checkpoint.dir=/shared/ckpt")  # one folder for all nodes: fine
    assert ran.code == 0, ran.stderr
    assert "checkpoint.dir=/shared/ckpt" in srun_line(ran.stdout)
    single = cli("launch", "slurm", "recipe=gpt-dp", "checkpoint.every_steps=5")  # one node: its run folder is fine
    assert single.code == 0, single.stderr


def srun_line(script: str) -> list:
    (line,) = [line for line in script.splitlines() if line.startswith("srun ")]
    return shlex.split(line.removesuffix(" &"))


def sbatch_lines(script: str) -> dict:
    pairs = [line.removeprefix("#SBATCH ").partition("=") for line in script.splitlines() if line.startswith("#SBATCH")]
    return {key: value for key, _, value in pairs}


def test_sbatch_script_for_llama3_70b_on_8_nodes_of_8_gpus(cli):
    ran = cli(
        "launch",
        "slurm",
        "recipe=llama3-70b-h100",
        "checkpoint.every_steps=50",
        "checkpoint.dir=/shared/ckpt",
        "--time",
        "1-12:00",
        "--partition",
        "gpu",
        "--account",
        "proj1",
    )
    assert ran.code == 0, ran.stderr
    options = sbatch_lines(ran.stdout)
    assert options["--nodes"] == "8" and options["--ntasks-per-node"] == "8" and options["--gpus-per-node"] == "8"
    assert options["--time"] == "1-12:00:00" and options["--partition"] == "gpu" and options["--account"] == "proj1"
    assert options["--signal"] == "B:USR1@120" and options["--open-mode"] == "append" and "--requeue" in options
    assert options["--cpus-per-task"] == "8"
    assert options["--job-name"] == "partrain-llama3-70b-h100" and options["--output"] == "%x-%j.out"
    run_id = _run_id_of(ran.stdout)
    assert srun_line(ran.stdout) == [
        "srun",
        "partrain",
        "train",
        "recipe=llama3-70b-h100",
        "checkpoint.every_steps=50",
        "checkpoint.dir=/shared/ckpt",
        "checkpoint.resume=auto",
        f"train.run_id={run_id}",
        "train.threads_per_process=8",
    ]
    assert 'scontrol requeue "$SLURM_JOB_ID"' in ran.stdout
    assert ran.spawned == [] and ran.created() == []


def test_sbatch_script_for_a_cpu_layout_quotes_overrides_and_writes_out(cli):
    args = ["recipe=gpt-dp", "cluster.nodes=2", "parallel.dp=4", "train.run_dir=/scratch/my runs/a"]
    args += ["checkpoint.dir=/scratch/ck", "--time", "30"]
    ran = cli("launch", "slurm", *args, "--cpus-per-task", "4")
    assert ran.code == 0, ran.stderr
    options = sbatch_lines(ran.stdout)
    assert (options["--nodes"], options["--ntasks-per-node"], options["--cpus-per-task"]) == ("2", "2", "4")
    assert "--gpus-per-node" not in options and options["--time"] == "00:30:00"
    # train.run_dir given: the script adds no run id (the folder is named already).
    assert srun_line(ran.stdout)[3:] == [*args[:5], "checkpoint.resume=auto", "train.threads_per_process=4"]
    assert "note: checkpoint.every_steps=0: the job saves at SIGTERM and at its end only" in ran.stderr
    out = ran.cwd / "job.sbatch"
    ran = cli("launch", "slurm", *args, "--out", str(out), "--json")
    assert ran.code == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert (report["nodes"], report["tasks_per_node"], report["world_size"], report["gpus_per_node"]) == (2, 2, 4, 0)
    assert (report["cpus_per_task"], report["max_requeues"], report["partition_checked"]) == (1, 10, False)
    assert out.read_text() == report["script"] and os.access(out, os.X_OK)


def _run_id_of(script: str) -> str:
    (value,) = [a.removeprefix("train.run_id=") for a in srun_line(script) if a.startswith("train.run_id=")]
    return value


def _run_script(tmp_path: Path, script: str, sig: int, restarts: int = 0) -> tuple:
    """The generated script run by bash with stand-ins for srun (its task exits 143 on SIGTERM, as
    partrain's tasks do after saving), scancel (delivers a step signal to that task, as SLURM does)
    and scontrol (records its arguments). `sig` goes to the batch shell as SLURM sends it: USR1 alone
    (the time-limit warning), SIGTERM to the shell and the tasks (scancel, preemption).
    Returns (exit code, output, the scancel arguments, the scontrol arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / f"log-{sig}-{restarts}"
    srun = '#!/bin/bash\ntrap \'kill $!; exit 143\' TERM\necho "$@" > "$LOG.args"\nsleep 30 >/dev/null &\n'
    srun += 'echo $$ > "$LOG.pid"\nwait\n'
    (bin_dir / "srun").write_text(srun)
    (bin_dir / "scancel").write_text('#!/bin/bash\necho "$@" > "$LOG.scancel"\nkill -TERM "$(cat "$LOG.pid")"\n')
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$@" > "$LOG.scontrol"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LOG=str(log), SLURM_JOB_ID="77")
    env["SLURM_RESTART_COUNT"] = str(restarts)
    batch = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    pid_file = Path(f"{log}.pid")
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline, "the stand-in srun did not start"
        time.sleep(0.05)
    batch.send_signal(sig)
    if sig == signal.SIGTERM:
        time.sleep(0.3)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)  # SLURM signals the step's tasks too
    out, _ = batch.communicate(timeout=20)
    read = lambda suffix: Path(f"{log}.{suffix}").read_text().split() if Path(f"{log}.{suffix}").exists() else None
    return batch.returncode, out, read("scancel"), read("scontrol"), read("args")


def test_the_script_requeues_after_the_time_limit_warning_only(tmp_path):
    """USR1 (the time-limit warning): the shell forwards SIGTERM to step 0 through scancel, waits for
    the tasks' 143, requeues, but not once SLURM_RESTART_COUNT reached --max-requeues. SIGTERM (a
    user's scancel or a preemption): the tasks save and end, the script requeues nothing."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.runtime.sbatch import SbatchOptions, sbatch_script

    overrides = ["recipe=gpt-dp", "checkpoint.every_steps=5"]
    options = SbatchOptions(max_requeues=2, run_id="20250101-000000")
    script = sbatch_script(validate(compose(overrides, [])), overrides, options)
    code, out, scancel, scontrol, args = _run_script(tmp_path, script, signal.SIGUSR1)
    assert code == 143 and "time limit in 120 s" in out and "requeue 1 of at most 2" in out, out
    assert scancel == ["--signal=TERM", "77.0"] and scontrol == ["requeue", "77"]
    assert args == ["partrain", "train", *overrides, "checkpoint.resume=auto", "train.run_id=20250101-000000"] + [
        "train.threads_per_process=1"
    ]
    code, out, scancel, scontrol, _ = _run_script(tmp_path, script, signal.SIGUSR1, restarts=2)
    assert code == 143 and scancel == ["--signal=TERM", "77.0"] and scontrol is None
    assert "not requeued: requeued 2 times already" in out, out
    code, out, scancel, scontrol, _ = _run_script(tmp_path, script, signal.SIGTERM)
    assert code == 143 and "not requeued by this script" in out, out
    assert scancel is None and scontrol is None


def test_job_resources_and_names_for_cpu_and_cuda_clusters(cli):
    """CPU clusters ask one core per process unless told (a 2-CPU node holds gpt-dp), GPU clusters
    8 cores and the GPUs per node; job and output names are clean (no doubled prefix)."""
    from types import SimpleNamespace

    from partrain.runtime.sbatch import job_name

    ran = cli("launch", "slurm", "recipe=gpt-dp")
    options = sbatch_lines(ran.stdout)
    assert (options["--ntasks-per-node"], options["--cpus-per-task"]) == ("2", "1") and "--gpus-per-node" not in options
    assert (options["--job-name"], options["--output"]) == ("partrain-gpt-dp", "%x-%j.out")
    ran = cli("launch", "slurm", "recipe=gpt-dp", "train.threads_per_process=3")
    assert sbatch_lines(ran.stdout)["--cpus-per-task"] == "3"
    ran = cli("launch", "slurm", "recipe=llama3-8b-h100")
    options = sbatch_lines(ran.stdout)
    assert options["--gpus-per-node"] == options["--ntasks-per-node"] and options["--cpus-per-task"] == "8"
    name = lambda recipe: job_name(SimpleNamespace(recipe=recipe, model=SimpleNamespace(name="m")))
    assert name("partrain-my recipe!!") == "partrain-my-recipe" and name("") == "partrain-m"
    assert len(name("x" * 300)) == 64


def test_the_run_folder_is_keyed_by_the_scripts_run_id_not_the_job_id():
    """Every submission (and requeue) of one script continues one run folder; a new script is a new run."""
    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.launch import default_run_dir
    from partrain.runtime.sbatch import SbatchOptions, sbatch_script

    script = lambda overrides: sbatch_script(validate(compose(overrides, [])), overrides, SbatchOptions(run_id="r1"))
    v = validate(compose(["recipe=gpt-dp", f"train.run_id={_run_id_of(script(['recipe=gpt-dp']))}"], []))
    assert default_run_dir(v, job_id="77") == default_run_dir(v, job_id="78") == Path("runs/gpt-dp/r1")
    assert default_run_dir(validate(compose(["recipe=gpt-dp"], [])), job_id="77") == Path("runs/gpt-dp/77")
    assert _run_id_of(script(["recipe=gpt-dp", "train.run_id=mine"])) == "mine"  # the user's own, not a second


THREE_NODES = ["recipe=gpt-dp", "cluster.nodes=3", "parallel.dp=6", "train.global_batch_size=24"]
SHARED = "checkpoint.dir=/shared/ckpt"
"""A multi-node run keeps its last step (checkpoint.save_final) in a folder every node mounts."""

SINFO = "debug*|2|2|(null)\ngpu|4|64|gpu:a100:4(S:0-1)\nbig|1|128+|gpu:h100:8,nvme:1\n"


@pytest.mark.parametrize(
    "args, key, rule",
    [
        (["recipe=gpt-dp", "--cpus-per-task", "4"], "--cpus-per-task", "at most 2"),
        ([*THREE_NODES, SHARED], "cluster.nodes", "has 2"),
        (["recipe=llama3-70b-h100", SHARED, "--partition", "gpu"], "cluster.devices_per_node", "at most 4"),
        (["recipe=gpt-dp", "--partition", "nope"], "--partition", "no such partition"),
    ],
)
def test_a_request_the_partition_cannot_hold_exits_2(cli, monkeypatch, args, key, rule):
    from partrain.runtime import partition

    monkeypatch.setattr(partition, "read_sinfo", lambda: partition.SinfoAnswer(partition.parse_sinfo(SINFO)))
    ran = cli("launch", "slurm", *args, "--out", "job.sbatch")
    assert ran.code == 2, ran.stdout + ran.stderr
    assert f"{key}=" in ran.stderr and rule in ran.stderr and "Traceback" not in ran.stderr
    assert ran.created() == []


def test_sinfo_is_read_only_when_it_is_there(tmp_path):
    from partrain.runtime import partition

    fake = tmp_path / "sinfo"
    fake.write_text(f"#!/bin/bash\nprintf '{SINFO}'\n")
    fake.chmod(0o755)
    answer = partition.read_sinfo(which=lambda _: str(fake))
    assert answer.groups == partition.parse_sinfo(SINFO)
    assert answer.groups[2] == partition.NodeGroup("big", False, 1, 128, 8)
    assert partition.read_sinfo(which=lambda _: None).unchecked == "sinfo is not on PATH"
    fake.write_text("#!/bin/bash\necho 'slurm_load_partitions: Unable to contact slurm controller' >&2; exit 1\n")
    assert "Unable to contact" in partition.read_sinfo(which=lambda _: str(fake)).unchecked


def test_the_partitions_cpus_set_the_cpus_per_task(cli, monkeypatch):
    from partrain.runtime import partition

    answer = partition.SinfoAnswer(partition.parse_sinfo(SINFO))
    monkeypatch.setattr(partition, "read_sinfo", lambda: answer)
    ran = cli("launch", "slurm", "recipe=gpt-dp", "cluster.devices_per_node=2", "--partition", "gpu", "--json")
    assert ran.code == 0, ran.stderr
    report = json.loads(ran.stdout)
    assert report["partition_checked"] and report["cpus_per_task"] == 32  # 64 CPUs / 2 tasks per node


@pytest.mark.parametrize(
    "args, key",
    [
        (["recipe=gpt-dp", "--time", "25h"], "--time"),
        (["recipe=gpt-dp", "--time", "-1"], "--time"),
        (["recipe=gpt-dp", "--time", "00:61:00"], "--time"),
        (["recipe=gpt-dp", "--cpus-per-task", "-2"], "--cpus-per-task"),
        (["recipe=gpt-dp", "--max-requeues", "-1"], "--max-requeues"),
        (["recipe=gpt-dp", "--partition", "gpu; rm -rf ~"], "--partition"),
        (["recipe=no-such-recipe"], "recipe"),
        (["recipe=gpt-dp", "cluster.nodes=-1"], "cluster.nodes"),
        (["recipe=gpt-dp", "parallel.dp=3"], "parallel"),
    ],
)
def test_bad_launch_input_exits_2_naming_the_option_or_key(cli, args, key):
    ran = cli("launch", "slurm", *args, "--out", "job.sbatch")
    assert ran.code == 2, ran.stdout + ran.stderr
    assert key in ran.stderr and "Traceback" not in ran.stderr
    assert ran.created() == [] and ran.spawned == []


def test_time_limits_in_slurms_forms():
    assert parse_time("04:00:00") == "04:00:00"
    assert parse_time("48:00:00") == "48:00:00"
    assert parse_time("2-00:00:00") == "2-00:00:00"
    assert parse_time("90") == "01:30:00"
    for bad in ("12:00", "0", "00:00:00", "1-24:00:00", "4h"):
        with pytest.raises(ConfigError, match="--time"):
            parse_time(bad)


def _job_id_with_a_free_port() -> str:
    """A SLURM_JOB_ID whose derived rendezvous port is free here (other tests run beside this one)."""
    for job in random.sample(range(PORT_SPAN), 50):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", master_port_for(str(job))))
                return str(job)
            except OSError:
                continue
    raise RuntimeError("no free port in the SLURM port range")


def _srun_tasks(tmp_path: Path, args: list, env: dict, job: str, name: str) -> list:
    """Start `partrain train ARGS` twice as srun starts a 1-node x 2 step; returns the processes."""
    tasks = []
    for procid in range(2):
        task_env = dict(env, **fake_task(procid, nodes=1, per_node=2, nodelist="localhost", job=job))
        cmd = [sys.executable, "-m", "partrain.cli", "train", *args]
        with open(tmp_path / f"{name}-{procid}.out", "w") as log:
            tasks.append(subprocess.Popen(cmd, cwd=tmp_path, env=task_env, stdout=log, stderr=subprocess.STDOUT))
    return tasks


def _steps_seen(metrics: Path, skip: int = 0) -> dict:
    """step -> (loss, grad_norm) from rank 0's metrics.jsonl, after its first `skip` lines (rank 0's
    stdout, the SLURM log, holds rounded plain lines)."""
    seen = {}
    for line in (metrics.read_text().splitlines() if metrics.exists() else [])[skip:]:
        try:
            record = json.loads(line)
        except ValueError:  # a line being written
            continue
        if "loss" in record:
            seen[record["step"]] = (record["loss"], record["grad_norm"])
    return seen


def test_two_srun_tasks_train_stop_on_sigterm_and_resume_like_torchrun(tmp_path):
    """Two `partrain train` processes started as srun starts them (SLURM variables only, no
    MASTER_ADDR) find each other at the derived address and train. SIGTERM to both (SLURM's
    preemption or time-limit signal) saves the current step and each exits 143; the requeued
    step (same job id, checkpoint.resume=auto) continues, and the losses and gradient norms of the
    whole run equal those of `partrain train`'s own uninterrupted 2-process torchrun run."""
    steps = 8
    overrides = ["recipe=gpt-dp", "train.eval_every=0", "train.eval_batches=0"]
    args = [*overrides, f"train.steps={steps}", f"train.run_dir={tmp_path / 'slurm-run'}"]
    args += ["checkpoint.every_steps=100", "checkpoint.resume=auto"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=str(REPO))
    job = _job_id_with_a_free_port()
    first = _srun_tasks(tmp_path, args, env, job, "first")
    deadline = time.monotonic() + 150
    metrics = tmp_path / "slurm-run" / "metrics.jsonl"
    while 2 not in _steps_seen(metrics):
        assert time.monotonic() < deadline and first[0].poll() is None, (tmp_path / "first-0.out").read_text()
        time.sleep(0.05)
    signalled = time.monotonic()
    for task in first:
        task.send_signal(signal.SIGTERM)
    codes = [task.wait(timeout=60) for task in first]
    stop_s = time.monotonic() - signalled
    assert codes == [143, 143], [(tmp_path / f"first-{r}.out").read_text()[-2000:] for r in range(2)]
    saved = sorted(p.name for p in (tmp_path / "slurm-run" / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0].startswith("step-"), saved
    stopped_at = int(saved[0].removeprefix("step-"))
    assert 2 <= stopped_at < steps
    first_lines = len(metrics.read_text().splitlines())
    second = _srun_tasks(tmp_path, args, env, job, "second")
    codes = [task.wait(timeout=150) for task in second]
    assert codes == [0, 0], [(tmp_path / f"second-{r}.out").read_text()[-2000:] for r in range(2)]
    seen = _steps_seen(metrics)
    resumed = _steps_seen(metrics, skip=first_lines)
    # The SLURM output file is a log a person reads: plain lines, no event JSON.
    log_first, log_second = (tmp_path / "first-0.out").read_text(), (tmp_path / "second-0.out").read_text()
    assert "step 2/8 | loss " in log_first and "@@partrain" not in log_first + log_second, log_first
    assert f"resumed from {tmp_path / 'slurm-run' / 'checkpoints'}" in log_second, log_second
    assert min(resumed) == stopped_at + 1
    seen = {**{k: v for k, v in seen.items() if k <= stopped_at}, **resumed}
    assert sorted(seen) == list(range(1, steps + 1))
    slurm = RunRecord([seen[k][0] for k in sorted(seen)], [seen[k][1] for k in sorted(seen)], tmp_path, {})
    torchrun = run_training(overrides[:1], tmp_path / "torchrun-run", steps=steps, extra_env=env, timeout_s=180)
    diffs = check_parity(torchrun, slurm, rtol=1e-6)
    print(f"srun-style (SIGTERM after step {stopped_at}, exit in {stop_s:.2f} s, resumed) vs torchrun: {diffs}")
