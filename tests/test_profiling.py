"""Profiler traces and memory history (issue 39 items 2 and 3): `train.profile_steps=[A,B]` writes a
Chrome trace per rank with partrain's named ranges, named in summary.json and the launcher's summary;
its validation; `train.memory_history=true` on CPU is exit 2 before anything exists; the file naming
and the step the memory history is dumped after."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.validate import validate
from partrain.errors import ConfigError
from partrain.rehearse.runs import train_all
from partrain.train.profiling import ProfilingContext, memory_snapshot_path, profiling_summary, trace_path
from partrain.train.progress_text import summary_lines

TINY = ["recipe=gpt-dp", "model.config.n_layer=2", "train.seq_len=64", "train.eval_every=0", "train.eval_batches=1"]
TINY += ["data.max_bytes=300000", "train.steps=3", "train.profile_steps=[2,3]", "parallel.dp=1"]
CASES = {
    "tp2": TINY + ["parallel.tp=2"],
    "pp2": TINY + ["parallel.pp=2", "train.micro_batch_size=2", "train.global_batch_size=4"],
}
"""Two 2-process layouts sharing one launch: tensor parallelism (partrain's own all-reduces) and a
pipeline (forward/backward ranges around torch's schedule, the tied-weight exchange)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return train_all(CASES, tmp_path_factory.mktemp("profiled"))


def _range_names(path: Path) -> set:
    trace = json.loads(path.read_text())
    return {e.get("name") for e in trace["traceEvents"] if str(e.get("name", "")).startswith("partrain/")}


@pytest.mark.slow
@pytest.mark.parametrize("name,communication", [("tp2", "partrain/tp/all_reduce"), ("pp2", "partrain/pp/tied_weights")])
def test_every_rank_writes_a_trace_with_the_named_ranges(runs, name, communication):
    run = runs[name]
    traces = [trace_path(run.run_dir, rank) for rank in range(2)]
    assert run.summary["profile"] == {"steps": [2, 3], "traces": [str(p) for p in traces]}
    assert [r["profile_trace"] for r in run.summary["ranks"]] == [str(p) for p in traces]
    for path in traces:
        names = _range_names(path)
        assert {"partrain/forward", "partrain/backward", "partrain/optimizer", communication} <= names, names
        # Each traced step is one ProfilerStep#N span, as torch's profiler schedule marks it (HTA, TensorBoard).
        events = json.loads(path.read_text())["traceEvents"]
        steps = sorted(e["name"] for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
        assert steps == ["ProfilerStep#2", "ProfilerStep#3"], steps
    # The launcher's summary names them too.
    assert any(line.startswith("summary: profiler traces (steps 2-3): 2 files") for line in summary_lines(run.summary))


@pytest.mark.parametrize(
    "window,steps",
    [("[3]", 3), ("[3,2]", 3), ("[0,1]", 3), ("[2,4]", 3), ("[1,2,3]", 3)],
)
def test_a_bad_profile_window_is_refused_naming_the_key(window, steps):
    with pytest.raises(ConfigError) as err:
        validate(compose(["recipe=gpt-dp", f"train.steps={steps}", f"train.profile_steps={window}"]))
    problems = [p for p in err.value.problems if p.key == "train.profile_steps"]
    assert len(problems) == 1 and "train.profile_steps=[2,3]" in problems[0].fix


def test_a_window_inside_the_run_is_accepted():
    for window in ("[]", "[1,1]", "[2,3]", "[3,3]"):
        validate(compose(["recipe=gpt-dp", "train.steps=3", f"train.profile_steps={window}"]))


def test_memory_history_on_cpu_is_exit_2_before_any_process(run_partrain):
    ran = run_partrain("train", "recipe=gpt-dp", "train.memory_history=true")
    assert ran.code == 2, ran.stdout + ran.stderr
    assert "train.memory_history" in ran.stdout + ran.stderr and "cluster.device=cuda" in ran.stdout + ran.stderr
    assert ran.spawned == [] and ran.created() == []


def test_file_names_and_the_step_the_memory_history_is_dumped_after(tmp_path):
    import torch

    assert trace_path(tmp_path, 3) == tmp_path / "profile" / "rank-3.pt.trace.json"
    assert memory_snapshot_path(tmp_path, 3) == tmp_path / "memory" / "rank-3.pickle"

    def ctx(steps, first_step, device="cuda", memory_history=True, profile_steps=()):
        train = SimpleNamespace(steps=steps, profile_steps=list(profile_steps), memory_history=memory_history)
        return ProfilingContext.of(SimpleNamespace(train=train), tmp_path, 0, torch.device(device), first_step)

    assert ctx(10, 0).memory_dump_step == 2  # a fresh start: after step 2
    assert ctx(10, 6).memory_dump_step == 8  # resumed after step 6: the run's own second step
    assert ctx(1, 0).memory_dump_step == 1  # fewer steps: the last one
    assert not ctx(10, 0, device="cpu").memory_history  # never recorded off CUDA
    assert ctx(10, 0, profile_steps=[2, 3]).profile_steps == (2, 3)


def test_summary_blocks_only_when_switched_on():
    ranks = [{"rank": 0, "profile_trace": "/r/profile/rank-0.pt.trace.json"}, {"rank": 1}]
    on = SimpleNamespace(train=SimpleNamespace(profile_steps=[2, 3], memory_history=True))
    off = SimpleNamespace(train=SimpleNamespace(profile_steps=[], memory_history=False))
    assert profiling_summary(on, ranks) == {
        "profile": {"steps": [2, 3], "traces": ["/r/profile/rank-0.pt.trace.json"]},
        "memory_snapshots": [],
    }
    assert profiling_summary(off, ranks) == {}
