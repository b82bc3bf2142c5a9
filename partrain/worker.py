"""One training process: `python -m partrain.worker RUN_DIR` (what torchrun starts).

Reads the resolved RUN_DIR/config.yaml (never Hydra), joins the process group, builds the mesh,
the model (meta -> parallelize -> materialize) and the data, trains, and always tears the process
group down. The flow is one way: config -> layout -> mesh -> model -> parallelize -> train.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import Optional

from partrain.blueprint.config.compose import load_resolved
from partrain.blueprint.epochs import with_epochs_as_steps
from partrain.blueprint.validate import ValidatedRun, validate
from partrain.blueprint.validate_elastic import is_elastic
from partrain.data.open_batches import DATA_MANIFEST, open_batches
from partrain.runtime.agreement import Disagreement
from partrain.runtime.context import DistEnv, cpu_count, from_environ
from partrain.runtime.node_watch import watching_nodes
from partrain.train.metrics import Events, LauncherEvents, PlainEvents, emit

log = logging.getLogger("partrain")


def setup_logging(run_dir: Path, env: DistEnv) -> None:
    logs = run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(logs / f"rank-{env.rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{env.rank} %(levelname)s %(message)s"))
    for old in log.handlers:  # a process that trains several runs (partrain.testing) logs each in its folder
        old.close()
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    log.propagate = False


def threads_for(v: ValidatedRun, env: DistEnv) -> int:
    """Threads per process: train.threads_per_process, or this machine's cores shared by its processes."""
    wanted = v.run.train.threads_per_process
    return wanted if wanted > 0 else max(1, cpu_count() // max(1, env.local_world_size))


def _device(v: ValidatedRun, env: DistEnv):
    import torch

    from partrain.runtime.cuda_defaults import apply_device_defaults

    if v.run.cluster.device == "cuda":
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
        apply_device_defaults(device)
        return device
    return torch.device("cpu")


def train_process(
    v: ValidatedRun, env: DistEnv, run_dir: Path, stop=None, via_launcher: bool = False, dropped=None, mesh_of=None
) -> int:
    """Everything between init_process_group and destroy_process_group; returns the exit code.

    stop: the StopWatch (partrain.runtime.signals) the loop polls. via_launcher: started by
    `partrain train`, which reads the outcome from rank 0's events: exit 0 after a clean stop or a
    run that did not train well (torchrun must neither restart nor report a crash); otherwise (a
    user's torchrun or srun) 128 + signal after a stop and 1 on rank 0 for a run that did not train.
    mesh_of: build_mesh, or what stands for it where one process trains run after run (rehearse.runs.MeshCache)."""
    import torch

    from partrain.runtime.mesh import build_mesh
    from partrain.train import relayout
    from partrain.train.assemble import build_engine
    from partrain.train.loop import Trainer
    from partrain.train.plan_check import memory_baseline
    from partrain.train.profiling import ProfilingContext, RunProfiling
    from partrain.train.trackers import TrackerMemory

    run = v.run
    # Decided once here: rank 0 under partrain's launcher speaks to it in JSON events; started by
    # srun or the user's torchrun its stdout is the log a person reads, so it writes plain lines.
    events = (LauncherEvents() if via_launcher else PlainEvents()) if env.is_main else Events()
    restarted = relayout.restarted(v, env.world_size, env.restart_count)
    torch.manual_seed(run.train.seed)
    device = _device(v, env)
    if run.cluster.nodes > 1:
        _check_nodes_agree(v, run_dir, env, via_launcher)
    mesh = (mesh_of or build_mesh)(v.layout, device.type)
    log.info("mesh %s on %s; %d threads", mesh.world, device, torch.get_num_threads())
    from partrain import checkpoint  # noqa: F401 - imported before the memory baseline (plan_check)

    trackers = TrackerMemory()  # what rank 0's trackers add to its process: measured apart from the training
    baseline = memory_baseline(v, device, env.is_main, trackers)
    engine = build_engine(v, mesh, device)

    batches, evals, v = _open_sharded_data(v, run_dir, mesh)  # v: train.epochs counted in steps
    run = v.run
    checkpoints, loss_scale, schedule = _checkpointed(v, run_dir, engine, batches, restarted, events)
    start_step, history = relayout.resume(checkpoints, v, dropped, run_dir if env.is_main else None)
    _starting_point(v, engine, batches, evals, run_dir, mesh, start_step, events)
    pp_rank = mesh.local("pp")
    metrics, plan = _metrics(v, env, run_dir, device, baseline, pp_rank, trackers)
    profiling = RunProfiling(ProfilingContext.of(run, run_dir, env.rank, device, start_step))
    trainer = Trainer(
        v,
        mesh,
        engine,
        batches,
        evals,
        metrics,
        env.is_main,
        on_step_end=checkpoints.maybe_save,
        loss_scale=loss_scale,
        stop=stop,
        events=events,
        restart=env.restart_count,
        schedule=schedule,
        profiling=profiling,
    )
    trainer.state.step = start_step
    try:
        state = _run_trainer(trainer, v, device, run_dir, env.rank, pp_rank, stop)
    finally:
        profiling.close()
    saved, hf_dir = checkpoints.at_end(state.step, state.stopped)
    metrics.close()

    gathered = _gather_rank_records(env, state, pp_rank, device, baseline, engine, trackers, profiling)
    moe = getattr(engine, "moe", None)
    if relayout.peers_left(v, state, stop):  # after the shared checkpoint: torchrun restarts this node
        return relayout.PEER_LEFT_EXIT
    if state.stopped:
        return _report_stop(v, env, run_dir, state, saved, via_launcher)
    return _report_summary(
        v, env, run_dir, state, gathered, moe, via_launcher, plan, device.type, events, hf_dir, history.changes, saved
    )


def _starting_point(v: ValidatedRun, engine, batches, evals, run_dir: Path, mesh, start_step: int, events) -> None:
    """What a run starts from besides a checkpoint: a new run's base weights from another run's checkpoint
    (checkpoint.init_from; into dpo's frozen reference copy too), then dpo's table of reference
    log-probabilities of those weights."""
    from partrain.blueprint.validate_objective import reference_kind

    run = v.run
    reference = reference_kind(run.train, run.peft.method)
    if run.checkpoint.init_from:
        from partrain.checkpoint.init_from import load_init_weights

        if start_step == 0:
            load_init_weights(Path(run.checkpoint.init_from), engine.model_parts, engine.optimizer)
        if reference == "copy":  # the reference is the starting model, on a resume too
            load_init_weights(Path(run.checkpoint.init_from), [engine.preference.frozen], None)
    if reference == "table":
        from partrain.train.reference_logps import attach_reference

        attach_reference(v, engine, batches, evals, run_dir, mesh, start_step, events)


def _checkpointed(v: ValidatedRun, run_dir: Path, engine, batches, restarted: bool, events):
    """(checkpoint manager, loss scale, LR schedule): the parts every checkpoint saves beside the
    engine's model and optimizer (partrain.checkpoint.manager), made here so the trainer steps the
    same objects."""
    from partrain.checkpoint.manager import DATA, CheckpointManager, ScheduleState
    from partrain.train.loss_scale import DynamicLossScale
    from partrain.train.lr_schedule import LRSchedule

    loss_scale = DynamicLossScale.for_run(v.run.train)
    schedule = LRSchedule(v.run.optim, v.run.train.steps)
    parts = {DATA: batches, "loss_scale": loss_scale, "lr_schedule": ScheduleState(schedule)}
    return CheckpointManager.for_run(v, run_dir, engine, parts, restarted, events), loss_scale, schedule


def _metrics(v: ValidatedRun, env: DistEnv, run_dir: Path, device, baseline: int, pp_rank: int, trackers):
    """(metrics writer, plan): rank 0's writer also puts each step's measures beside the plan's."""
    from partrain.train.metrics import MetricsWriter
    from partrain.train.plan_check import Plan, PlanCheckMetrics

    metrics = MetricsWriter(run_dir, enabled=env.is_main, run=v.run, tracker_memory=trackers)
    if not env.is_main:
        return metrics, None
    plan = Plan.of(v, run_dir)  # once, before the loop: measured beside planned
    return PlanCheckMetrics(metrics, plan, v.run.train.steps, v, device, baseline, pp_rank, trackers), plan


def _open_sharded_data(v: ValidatedRun, run_dir: Path, mesh):
    """The run's batches and eval batches, each rank's sequence shard under context parallelism, and the
    run with train.epochs counted in steps from the batches (every rank counts the same)."""
    from partrain.parallel.context_parallel import sequence_shard, shard_batches

    batches, evals = open_batches(v, run_dir)
    v = with_epochs_as_steps(v, getattr(batches, "steps_per_epoch", None))  # None: a stream (no epochs)
    return (*shard_batches(batches, evals, sequence_shard(mesh, v.run.parallel.sp_mode)), v)


def _gather_rank_records(
    env: DistEnv, state, pp_rank: int, device, baseline: int, engine, trackers=None, profiling=None
):
    """Every rank's memory and traffic record, gathered on rank 0 (None elsewhere); trackers: what
    rank 0's trackers added to its process (plan_check.measured_memory subtracts it); profiling: the
    files the rank's RunProfiling wrote (its profiler trace, its memory snapshots)."""
    import torch.distributed as dist

    from partrain.runtime.resident import peak_rss_bytes
    from partrain.train.plan_check import measured_memory

    mine = {"rank": env.rank, "model_state_bytes": state.model_state_bytes, "peak_rss_bytes": peak_rss_bytes()}
    mine.update(pp_rank=pp_rank, **measured_memory(device, baseline, trackers), **_engine_record(engine))
    if profiling is not None:
        mine.update(profiling.record())
    gathered = [None] * env.world_size if env.is_main else None
    dist.gather_object(mine, gathered, dst=0)
    return gathered


def _run_trainer(trainer, v: ValidatedRun, device, run_dir: Path, rank: int, pp_rank: int, stop=None):
    """The training loop; a CUDA out-of-memory error becomes one with the planner's figures and hints."""
    import torch

    if stop is not None:
        stop.exit_at_once = False  # from here a stop is agreed between the ranks and saved

    try:
        return trainer.run()
    except torch.OutOfMemoryError as exc:
        if device.type != "cuda":
            raise
        from partrain.train.gpu_memory import explain_oom

        snapshot = trainer.profiling.on_oom()  # train.memory_history: the allocator's history, named in the message
        raise explain_oom(v, device, run_dir, rank, pp_rank, written=snapshot) from exc


def _engine_record(engine) -> dict:
    """This rank's expert parameter bytes and data-parallel sync traffic, when the engine has them."""
    out: dict = {}
    moe = getattr(engine, "moe", None)
    if moe is not None:
        out["expert_param_bytes"] = moe.local_expert_bytes()
    sync = getattr(getattr(engine, "dp", None), "sync", None)
    if sync is not None:  # parallel.dp_sync: bytes this rank sent, and how much of the sync backward hid
        out["dp_sync"] = {"sent_bytes": sync.counter.sent_bytes, "recv_bytes": sync.counter.recv_bytes}
        if sync.bucketed is not None:
            out["dp_sync"]["overlap"] = sync.bucketed.stats.to_json()
    return out


def _data_row_facts(v: ValidatedRun, run_dir: Path) -> dict:
    """Fine-tuning rows: the summary's "data_rows" (skipped malformed rows, truncated or skipped long examples)."""
    from partrain.data.long_examples import run_row_facts

    if v.run.data.streaming:
        return {}
    meta_path = json.loads((run_dir / DATA_MANIFEST).read_text())["meta_path"]
    return run_row_facts(meta_path, v.run.data, v.run.train.seq_len)


def _packing_facts(v: ValidatedRun, run_dir: Path) -> dict:
    """Fine-tuning rows: the summary's "packing" (windows or padded rows, padding share, truncated examples)."""
    from partrain.data.example_packing import run_packing_facts

    if v.run.data.streaming:
        return {}
    meta_path = json.loads((run_dir / DATA_MANIFEST).read_text())["meta_path"]
    t = v.run.train
    return run_packing_facts(meta_path, v.run.data, t.seq_len, v.global_batch_size, t.seed)


def _report_summary(
    v: ValidatedRun,
    env: DistEnv,
    run_dir: Path,
    state,
    gathered,
    moe,
    via_launcher: bool,
    plan=None,
    device_type="cpu",
    events: Optional[Events] = None,
    hf_dir: Optional[Path] = None,
    layout_changes=(),
    saved: Optional[Path] = None,
) -> int:
    """Rank 0: summary.json and the summary event; the exit code (1 on rank 0 for a run that did not
    train, unless `partrain train` reads it from the event)."""
    from partrain.train.plan_check import planned_vs_measured
    from partrain.train.profiling import profiling_summary

    if env.is_main and state.history:
        timed = state.history[1:] or state.history
        tokens_per_s = v.tokens_per_step * len(timed) / sum(r.step_time_s for r in timed)
        summary = {
            "steps": state.step,
            "final_loss": state.history[-1].loss,
            "eval_loss": state.eval_loss,
            "tokens_per_s": tokens_per_s,
            "ranks": gathered,
            "run_dir": str(run_dir),
            "skipped_steps": sum(r.skipped for r in state.history),
            "problem": state.problem(),
            "layout_changes": list(layout_changes),
        }
        if moe is not None:
            summary["moe"] = moe.summary()
        if hf_dir is not None:
            summary["hf_export"] = str(hf_dir)
        summary.update(_kept(v, run_dir, saved))
        summary.update(profiling_summary(v.run, gathered))
        summary.update(_data_row_facts(v, run_dir))
        summary.update(_packing_facts(v, run_dir))
        if plan is not None:
            steps = [r.step_time_s for r in state.history]
            summary["planned_vs_measured"] = planned_vs_measured(plan, gathered, steps, v, device_type)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        (events or Events())("summary", **summary)
        if summary["problem"]:
            log.error("%s", summary["problem"])
            if not via_launcher:
                print(f"training did not work: {summary['problem']}", file=sys.stderr, flush=True)
                return 1
    return 0


def _kept(v: ValidatedRun, run_dir: Path, saved: Optional[Path]) -> dict:
    """The summary's record of what the run kept: its last checkpoint and the commands exporting it."""
    from partrain.blueprint.config.saving import export_commands, nothing_note

    if saved is None:
        note = nothing_note(v.run)
        return {"checkpoint": None, **({"saved_nothing": note} if note else {})}
    lora = v.run.peft.method == "lora"
    return {"checkpoint": str(saved), "export_commands": export_commands(str(saved), str(run_dir), lora)}


def _report_stop(v: ValidatedRun, env: DistEnv, run_dir: Path, state, saved: Optional[Path], via_launcher: bool) -> int:
    """One line saying where the stopped run ended and how to continue it (rank 0); the exit code."""
    from partrain.blueprint.config.saving import nothing_note
    from partrain.runtime.signals import PARENT_DEATH_SIGNAL, exit_code, signal_name

    # Every node's launcher reports the stop: local rank 0 of each node says it too (multi-node).
    if env.is_main or (via_launcher and env.local_rank == 0):
        who = (
            "because its launcher died," if state.stopped == PARENT_DEATH_SIGNAL else f"by {signal_name(state.stopped)}"
        )
        text = f"stopped {who} after step {state.step}"
        cfg = v.run.checkpoint
        if saved is not None:
            again = f"checkpoint.resume=auto train.run_dir={run_dir}"
            again += f" checkpoint.dir={cfg.dir}" if cfg.dir else ""
            text += f"; checkpoint saved at {saved}; resume with {again}"
        elif (note := nothing_note(v.run)) is not None:
            text += f"; {note}"
        else:
            text += "; no step trained since the start, nothing new to save"
        log.warning("%s", text)
        if via_launcher:
            emit("stopped", signal=state.stopped, step=state.step, checkpoint=saved and str(saved), message=text)
        else:
            print(text, flush=True)
    return 0 if via_launcher else exit_code(state.stopped)


def _check_nodes_agree(v: ValidatedRun, run_dir: Path, env: DistEnv, via_launcher: bool) -> None:
    """Multi-node: every rank checks that all nodes composed the same run (partrain.runtime.agreement)."""
    from partrain.runtime.agreement import check_nodes_agree

    meta_path = json.loads((run_dir / DATA_MANIFEST).read_text())["meta_path"]
    meta = json.loads(Path(meta_path).read_text())
    # Nodes are named as the user named them (--node-rank); under the user's own torchrun, by rank.
    node = v.run.cluster.node_rank if via_launcher else env.rank // max(1, env.local_world_size)
    check_nodes_agree(v.run, meta, node, env.world_size)


def _refuse(err, env: DistEnv, via_launcher: bool) -> int:
    """The nodes disagree: local rank 0 of every node tells its launcher (event) or the terminal; exit 2."""
    log.error("%s", err)
    if env.local_rank == 0:
        if via_launcher:
            emit("refused", lines=err.lines, fix=err.fix)
        else:
            text = "\n".join([*(f"error: nodes disagree on {line}" for line in err.lines), f"fix: {err.fix}"])
            print(text, file=sys.stderr, flush=True)
    return 0 if via_launcher else 2


def _restart_store(env: DistEnv, timeout):
    """After an elastic restart, a store namespace of this attempt's own.

    torchrun --standalone keeps its agent's TCPStore across restarts, so a restarted rank could
    read the dead attempt's gloo addresses and fail connecting ("Connection refused"); seen about
    one restart in four here. None (the default env:// store) on a first attempt.
    """
    import torch.distributed as dist

    if env.restart_count == 0 or not env.agent_store:
        return None
    base = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"partrain/attempt-{env.restart_count}", base)


def _peer_silent(run_dir: Path, env: DistEnv, line: str) -> None:
    """Another node stopped answering (partrain.runtime.node_watch): record the line and end this
    rank now (its main thread waits in a collective); torchrun or srun ends the node's other ranks."""
    from partrain.runtime.lifecycle import leave

    text = f"rank {env.rank}: {line}"
    log.error("%s", text)
    _write_error(run_dir, env, text + "\n")
    print(text, file=sys.stderr, flush=True)
    leave(1)


def _write_error(run_dir: Path, env: DistEnv, text: str) -> None:
    errors = run_dir / "errors"
    errors.mkdir(parents=True, exist_ok=True)
    tmp = errors / f".rank-{env.rank}.txt.tmp"
    tmp.write_text(text)
    os.replace(tmp, errors / f"rank-{env.rank}.txt")


def main(
    run_dir: Path, env: DistEnv, validated: Optional[ValidatedRun] = None, stop=None, via_launcher: bool = False
) -> int:
    """Run one worker to completion; returns the process exit code (the caller leaves with `leave`).

    stop: a started StopWatch (partrain.runtime.signals) or None; via_launcher: see train_process.
    """
    import torch

    from partrain.runtime.lifecycle import joined_group

    setup_logging(run_dir, env)
    try:
        v = validated or validate(load_resolved(run_dir / "config.yaml"))
        if stop is not None:
            stop.hard_exit_after_s = float(v.run.train.timeout_s)
            stop.exit_at_once = is_elastic(v.run.cluster)  # until the first step (train_process)
        torch.set_num_threads(threads_for(v, env))
        store = _restart_store(env, datetime.timedelta(seconds=v.run.train.timeout_s))
        with joined_group(
            v.run.cluster.backend, env.rank, env.world_size, v.run.train.timeout_s, store, env.init_method
        ):
            from partrain.train.relayout import layout_for_world

            v, dropped = layout_for_world(v, run_dir, env.world_size)  # an elastic run re-plans here
            # Multi-node: a node that hangs is named and stops this one within train.timeout_s.
            with watching_nodes(v.run, env, lambda line: _peer_silent(run_dir, env, line)):
                code = train_process(v, env, run_dir, stop, via_launcher, dropped)
        return code
    except Disagreement as err:
        return _refuse(err, env, via_launcher)
    except BaseException as exc:  # noqa: BLE001 - any failure must end this rank with its message recorded
        text = f"rank {env.rank}: {type(exc).__name__}: {exc}"
        log.error("%s\n%s", text, traceback.format_exc())
        _write_error(run_dir, env, text + "\n\n" + traceback.format_exc())
        print(text, file=sys.stderr, flush=True)
        # Exit at once: waiting for a barrier would block until peers time out; torchrun stops them.
        return 1
    finally:
        logging.shutdown()


def entry() -> None:
    from partrain.runtime.lifecycle import leave
    from partrain.runtime.signals import StopWatch

    env = from_environ(os.environ)
    if env is None:
        print("partrain.worker must be started by torchrun (or srun); use `partrain train`", file=sys.stderr)
        leave(2)
    # First, before torch starts threads: they must inherit the blocked stop signals.
    stop = StopWatch(f"rank {env.rank}").start()
    leave(main(Path(sys.argv[1]), env, stop=stop, via_launcher=True))


if __name__ == "__main__":
    entry()
