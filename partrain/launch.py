"""Start a validated run: run folder, data, then torchrun workers with a live progress display.

Under an existing torchrun or srun (RANK / SLURM_PROCID set) this process is itself the worker.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Iterator, List, Mapping, Optional

from partrain.blueprint.config.compose import to_yaml
from partrain.blueprint.planner.auto import RECORD_FILE as AUTO_RECORD_FILE
from partrain.blueprint.validate import ValidatedRun
from partrain.data.open_batches import DATA_MANIFEST
from partrain.errors import ConfigError, Problem
from partrain.multinode import node_outcome, preparing_data, rendezvous_of, torchrun_log_text
from partrain.preflight import check_before_launch
from partrain.preflight.hub import hub_record
from partrain.runtime.context import DistEnv, cpu_count, from_environ
from partrain.runtime.cuda_defaults import worker_env
from partrain.runtime.procs import workers_of_run
from partrain.runtime.run_lock import FolderBusy, FolderUnusable, describe_holder, hold_folders, retire_old_errors
from partrain.runtime.shared_checkpoints import checkpoint_dir_problems
from partrain.runtime.signals import Forwarder, Interrupted, exit_code, signal_name
from partrain.runtime.slurm import check_allocation
from partrain.runtime.torchrun import Rendezvous, elastic_restarts, torchrun_command
from partrain.train.display import Display

HUB_RECORD = "hub.json"
"""RUN_DIR/hub.json: for each of model.pretrained, data.tokenizer, data.source given as a Hub id, the
repo, repo_type, the commit it resolved to and the snapshot folder read."""

STREAM_FACTS = "stream.json"
"""RUN_DIR/stream.json: what a data.streaming run's batches depend on (partrain.data.streaming.stream_facts)."""
TORCHRUN_LOG = "torchrun.log"
"""RUN_DIR/logs/torchrun.log: torchrun's own output and rank 0's stderr (tracebacks, warnings)."""


def default_run_dir(v: ValidatedRun, job_id: Optional[str] = None) -> Path:
    """runs/NAME/KEY when train.run_dir is unset. KEY: train.run_id (the same id is the same run: a
    resubmitted sbatch script, whose run id was written into it, continues there), else the launcher's
    job id (a requeued SLURM job keeps it), else the time now (a new run)."""
    name = v.run.recipe or v.run.model.name or "default"
    stamp = v.run.train.run_id or job_id or time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / name / stamp


def _unique(path: Path) -> Path:
    candidate, n = path, 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}-{n}")
        n += 1
    return candidate


def prepare_run_dir(v: ValidatedRun, run_dir: Path, auto_choice: Optional[dict] = None) -> Path:
    """Write the run folder: resolved config.yaml and data.json. The data is tokenized and checked
    by `partrain.preflight.check_before_launch` first; here it is found in the cache."""
    run_dir.mkdir(parents=True, exist_ok=True)
    v.run.train.run_dir = str(run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(v.run))
    (run_dir / DATA_MANIFEST).write_text(json.dumps({"meta_path": str(_data_facts_file(v, run_dir))}))
    if auto_choice is not None:  # the planner's choice, which rank 0 compares with what it measures
        (run_dir / AUTO_RECORD_FILE).write_text(json.dumps(auto_choice, indent=1, default=str))
    if resolved := hub_record(v.run):  # the Hub repos and commits the run's folders came from
        (run_dir / HUB_RECORD).write_text(json.dumps(resolved, indent=1) + "\n")
    return run_dir


def _data_facts_file(v: ValidatedRun, run_dir: Path) -> Path:
    """The packed cache entry's meta.json, or for data.streaming the run folder's stream.json (the
    facts the nodes of a run must agree on: no tokens are prepared ahead)."""
    if v.run.data.streaming:
        from partrain.data.stream_facts import stream_facts

        facts = run_dir / STREAM_FACTS
        facts.write_text(json.dumps(stream_facts(v.run.data), indent=1) + "\n")
        return facts
    from partrain.data.prepare import prepare_data

    cache_root = Path(v.run.data.cache_dir).expanduser() if v.run.data.cache_dir else None
    return prepare_data(v.run.data, cache_root).meta_path


def worker_command(v: ValidatedRun, run_dir: Path, rendezvous: Optional[Rendezvous] = None) -> list:
    """torchrun starting `partrain.worker RUN_DIR` in every process of this machine."""
    return torchrun_command(
        v.run.cluster.devices_per_node if rendezvous else v.world_size,
        ["-m", "partrain.worker", run_dir],
        max_restarts=elastic_restarts(v.run.train.max_restarts, rendezvous),
        log_dir=run_dir / "torchrun",
        quiet_other_ranks=True,
        rendezvous=rendezvous,
    )


def launch(
    v: ValidatedRun,
    console,
    environ: Mapping[str, str],
    display: Optional[Display] = None,
    auto_choice: Optional[dict] = None,
) -> int:
    """Returns the exit code for the CLI. display: how the run is shown (the CLI chooses it once:
    terminal, plain lines or --json); default the rich terminal display on `console`. auto_choice:
    the record of a `parallel=auto` choice, written into the run folder."""
    if v.run.cluster.rdzv_endpoint:
        # A node's launcher (`--rdzv-endpoint`; under srun: one task per node): SLURM's task variables
        # describe the launchers, not the workers, so they are not read as this process's rank.
        environ = {k: value for k, value in environ.items() if not k.startswith("SLURM_")}
    else:
        check_allocation(environ, v.run.cluster.nodes, v.run.cluster.devices_per_node)  # srun's tasks vs the layout
    env = from_environ(environ)
    if env is not None:
        # srun or the user's torchrun: no rendezvous_of below, so its checkpoint.dir rule is checked here.
        if problems := checkpoint_dir_problems(v.run):
            raise_config(*problems)
        return _run_as_worker(v, env, environ, auto_choice)
    rendezvous = rendezvous_of(v)  # multi-node: exit 2 here when --rdzv-endpoint or --node-rank is wrong
    with preparing_data(v) if rendezvous else contextlib.nullcontext():  # nodes sharing a cache take turns
        check_before_launch(v)
    if v.run.cluster.device == "cuda":
        import torch

        if torch.cuda.device_count() < (v.run.cluster.devices_per_node if rendezvous else v.world_size):
            raise_config(
                Problem(
                    "cluster.device",
                    "cuda",
                    f"the layout needs {v.world_size} GPUs, this machine has {torch.cuda.device_count()}",
                    "use cluster=local-cpu, or a smaller layout",
                )
            )
    display = display or Display("rich", console)
    if v.run.train.run_dir or v.run.train.run_id:  # a named run: its folder as it is (continued, locked)
        run_dir = Path(v.run.train.run_dir) if v.run.train.run_dir else default_run_dir(v)
    else:
        run_dir = _unique(default_run_dir(v))
    # One run per folder, held until the run ends; SIGINT/SIGTERM from here on stop the run cleanly.
    with _claimed(v, run_dir), Forwarder() as signals:
        try:
            try:
                run_dir = prepare_run_dir(v, run_dir, auto_choice)
            except ConfigError as err:
                raise_config(*err.problems)
            return _start(v, run_dir, display, environ, signals, rendezvous)
        except Interrupted as stop:
            text = f"stopped by {signal_name(stop.signum)} before training started"
            display.say(text)
            display.result(exit_code(stop.signum), message=text)
            return exit_code(stop.signum)


def _start(
    v: ValidatedRun, run_dir: Path, display: Display, environ: Mapping[str, str], signals: Forwarder, rendezvous=None
) -> int:
    """Start torchrun (own session, dies with this process, output to logs/torchrun.log), follow rank
    0's events until the workers end, then say how the run ended; returns the exit code."""
    local = v.run.cluster.devices_per_node if rendezvous else v.world_size
    threads = v.run.train.threads_per_process or max(1, cpu_count() // local)
    child_env = dict(
        worker_env(environ, v.run.cluster.backend),
        OMP_NUM_THREADS=str(threads),
        PYTHONUNBUFFERED="1",
        **(rendezvous.environ() if rendezvous else {}),
    )
    where = f" (node {rendezvous.node_rank} of {rendezvous.nodes}: {local} here)" if rendezvous else ""
    if display.plain:
        display.say(f"partrain: {v.world_size} processes{where}, run folder {run_dir}")
    else:
        display.console.print(
            f"[bold]partrain[/bold]: {v.world_size} processes{where}, run folder [cyan]{run_dir}[/cyan]"
        )
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    with open(run_dir / "logs" / TORCHRUN_LOG, "a") as torchrun_log:
        with signals.blocked():  # a signal arriving now is handled once torchrun's pid is known
            proc = subprocess.Popen(
                worker_command(v, run_dir, rendezvous),
                stdout=subprocess.PIPE,
                stderr=torchrun_log,
                text=True,
                env=child_env,
                bufsize=1,
                **signals.popen_options(),
            )
            signals.started(proc.pid, run_dir)
        seen = display.follow(proc.stdout, signals.received)
        code = proc.wait()
    if rendezvous:
        told = node_outcome(rendezvous, code, seen, torchrun_log_text(run_dir / "logs" / TORCHRUN_LOG))
        if told:
            display.say(told[1])
            display.result(told[0], message=told[1])
            return told[0]
    return _conclude(run_dir, code, seen, signals.received, display)


@contextlib.contextmanager
def _claimed(v: ValidatedRun, run_dir: Path, lock_checkpoint_dir: Optional[bool] = None) -> Iterator[None]:
    """Lock the run folder (and checkpoint.dir) for the block; exit 2 (ConfigError) if another run
    holds one or workers of an earlier run still run there. Moves an old errors/ aside."""
    folders = [("train.run_dir", run_dir)]
    # Multi-node: all nodes write one checkpoint.dir; node 0 alone holds its lock (see partrain.multinode).
    if lock_checkpoint_dir is None:
        lock_checkpoint_dir = v.run.cluster.nodes == 1 or v.run.cluster.node_rank == 0
    if v.run.checkpoint.dir and lock_checkpoint_dir:
        folders.append(("checkpoint.dir", Path(v.run.checkpoint.dir).expanduser()))
    try:
        with hold_folders([folder for _, folder in folders]):
            leftovers = workers_of_run(run_dir)
            if leftovers:
                pids = " ".join(map(str, leftovers))
                raise_config(
                    Problem(
                        "train.run_dir",
                        str(run_dir),
                        f"processes of an earlier run are still running in this folder (pids {pids}); "
                        "they stop by themselves within train.timeout_s",
                        f"wait a moment, or stop them (kill -TERM {pids}), or choose another train.run_dir",
                    )
                )
            retire_old_errors(run_dir)
            yield
    except FolderUnusable as bad:
        key = next((k for k, folder in folders if Path(folder).absolute() == bad.folder), "train.run_dir")
        raise_config(
            Problem(
                key,
                str(bad.folder),
                f"cannot be used as a folder ({bad.error.strerror or bad.error})",
                f"choose a {key} that is (or can be made) a writable folder",
            )
        )
    except FolderBusy as busy:
        key = next(k for k, folder in folders if Path(folder).absolute() == busy.folder)
        pid = busy.holder.get("pid")
        raise_config(
            Problem(
                key,
                str(busy.folder),
                f"in use by another partrain run ({describe_holder(busy.holder)}): two runs in one folder "
                "overwrite each other's checkpoints",
                f"wait for it to end{f' or stop it (kill -TERM {pid})' if pid else ''}, or choose another {key}",
            )
        )


def raise_config(*problems: Problem) -> None:
    raise ConfigError(list(problems))


def _run_as_worker(v: ValidatedRun, env: DistEnv, environ: Mapping[str, str], auto_choice=None) -> int:
    from partrain import worker
    from partrain.runtime.lifecycle import leave
    from partrain.runtime.signals import StopWatch

    # Before anything starts threads; SIGTERM from srun / the user's torchrun then stops cleanly.
    stop = StopWatch(f"rank {env.rank}", hard_exit_after_s=v.run.train.timeout_s).start()
    job = environ.get("TORCHELASTIC_RUN_ID") or environ.get("SLURM_JOB_ID") or "job"
    run_dir = Path(v.run.train.run_dir) if v.run.train.run_dir else default_run_dir(v, job_id=job)
    if v.run.cluster.nodes > 1 and not v.run.train.run_dir:
        run_dir = run_dir / f"node-{env.rank // max(1, env.local_world_size)}"  # one folder per node
    if env.local_rank == 0:
        with preparing_data(v) if v.run.cluster.nodes > 1 else contextlib.nullcontext():
            check_before_launch(v)
        # Local rank 0 of every node prepares its node's folder (another node's may not be shared);
        # checkpoint.dir, one for all nodes, is locked by global rank 0 alone.
        with _claimed(v, run_dir, lock_checkpoint_dir=env.is_main):
            prepare_run_dir(v, run_dir, auto_choice)
            leave(worker.main(run_dir, env, v, stop=stop))
    else:
        deadline = time.monotonic() + v.run.train.timeout_s
        while not (run_dir / DATA_MANIFEST).exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"local rank 0 did not prepare {run_dir} within train.timeout_s")
            time.sleep(0.2)
    leave(worker.main(run_dir, env, v, stop=stop))


def _conclude(run_dir: Path, code: int, seen: dict, signals: List[int], display: Display) -> int:
    """Say how the run ended; returns the exit code (docs/reliability.md#stopping-a-run lists them). With --json
    the same outcome is also the one JSON object on stdout."""
    summary = seen.get("summary")
    ended, message = _outcome(run_dir, code, seen, signals, display)
    display.result(ended, summary if code == 0 and not seen.get("stopped") else None, message)
    return ended


def _outcome(run_dir: Path, code: int, seen: dict, signals: List[int], display: Display) -> tuple:
    console = display.console
    if seen.get("stopped"):
        display.say(seen["stopped"]["message"])
        return exit_code(seen["stopped"]["signal"]), seen["stopped"]["message"]
    summary = seen.get("summary")
    if code == 0 and summary:
        display.summary(summary)
        if summary.get("moe"):
            from partrain.blueprint.report.expert_load import expert_load_table

            console.print(expert_load_table(summary["moe"]))
        _print_plan_check(summary.get("planned_vs_measured"), console)
        if summary.get("problem"):
            console.print("[bold red]training did not work[/bold red]: ", end="", highlight=False)
            console.print(summary["problem"], markup=False, highlight=False, soft_wrap=True)
            return 1, f"training did not work: {summary['problem']}"
        return 0, None
    if signals:
        name = signal_name(signals[-1])
        if "start" not in seen:
            how = "before training started"
        elif len(signals) > 1:
            how = "at once (second signal): the step in progress was not saved"
        else:
            how = "but the workers ended without a clean stop"
        text = f"stopped by {name} {how}; logs: {run_dir / 'logs'}"
        display.say(text)
        return exit_code(signals[-1]), text
    return 1, _report_failure(run_dir, code, console)


def _report_failure(run_dir: Path, code: int, console) -> str:
    errors = (
        sorted((run_dir / "errors").glob("rank-*.txt"), key=lambda p: p.stat().st_mtime)
        if (run_dir / "errors").exists()
        else []
    )
    if errors:
        first = errors[0].read_text().split("\n\n", 1)[0]
        console.print("[bold red]training failed[/bold red]: ", end="", highlight=False)
        console.print(first, markup=False, highlight=False, soft_wrap=True)
        console.print(f"traceback: {errors[0]}; logs: {run_dir / 'logs'}", markup=False, highlight=False)
        return f"training failed: {first}"
    how = f"torchrun was killed by {signal_name(-code)}" if code < 0 else f"torchrun exit code {code}"
    text = f"training failed ({how}); torchrun's report: {run_dir / 'logs' / TORCHRUN_LOG}"
    console.print(
        f"[bold red]training failed[/bold red] ({how}); torchrun's report: {run_dir / 'logs' / TORCHRUN_LOG}",
        highlight=False,
    )
    return text


def _print_plan_check(block: Optional[dict], console) -> None:
    """One line of planned vs measured memory and tokens/s; a `warning:` line for each figure more
    than the tolerance away from its plan, and a plain line for a CPU run's throughput off its plan,
    with the host's load (partrain.train.plan_check)."""
    if not block:
        return
    if block.get("error"):
        console.print(f"planned vs measured: no plan ({block['error']})", markup=False, highlight=False, soft_wrap=True)
        return
    m, t = block["memory"], block["tokens_per_s"]

    def ratio(c: dict) -> str:
        return f"{c['measured_over_planned']:.2f}x" if c["measured_over_planned"] is not None else "no plan"

    console.print(
        f"planned vs measured: memory {m['planned'] / 2**30:.3f} vs {m['measured'] / 2**30:.3f} GiB ({ratio(m)}, "
        f"rank {m['rank']}), tokens/s {t['planned']:,.0f} vs {t['measured']:,.0f} ({ratio(t)})",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    for text in block.get("info", []):  # a CPU run's step time against the plan, with the host's load
        console.print(text, markup=False, highlight=False, soft_wrap=True)
    for text in block.get("warnings", []):
        console.print(f"warning: {text}", markup=False, highlight=False, soft_wrap=True)
