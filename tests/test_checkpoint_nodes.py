"""Issue 38 item 1, the checks in one process: a multi-node run's checkpoint folder must be one folder
every node sees. The rule (exit 2 on every launcher), a save some rank cannot see (fails on every
rank, nothing reported saved), a resume whose ranks found different checkpoints (refused at once,
naming the nodes, instead of hanging in the first collective). The gathers are stood in for: what
the other ranks would have reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partrain.blueprint.config.schema import RunConfig
from partrain.checkpoint import resume_agreement, save
from partrain.checkpoint.failures import SaveFailed
from partrain.checkpoint.resume_agreement import check_same_checkpoints, differing_findings
from partrain.multinode import node_outcome
from partrain.runtime.agreement import Disagreement
from partrain.runtime.shared_checkpoints import SHARED_DIR_FIX, checkpoint_dir_problems
from partrain.runtime.torchrun import Rendezvous


def _run(nodes: int, every: int, folder: str = "", final: bool = True) -> RunConfig:
    run = RunConfig()
    run.cluster.nodes, run.checkpoint.every_steps, run.checkpoint.dir = nodes, every, folder
    run.checkpoint.save_final = final
    return run


def test_only_a_multi_node_run_saving_into_its_run_folders_is_refused():
    (problem,) = checkpoint_dir_problems(_run(2, 5))
    assert problem.key == "checkpoint.dir" and "cluster.nodes=2" in problem.rule
    assert problem.fix == SHARED_DIR_FIX and "every node mounts" in problem.fix
    assert checkpoint_dir_problems(_run(2, 5, "/shared/ckpt")) == []
    assert checkpoint_dir_problems(_run(2, 0, final=False)) == []  # saves nothing
    (problem,) = checkpoint_dir_problems(_run(2, 0))  # the final checkpoint (checkpoint.save_final) is saved too
    assert "checkpoint.save_final=true" in problem.rule and "save_final=false" in problem.fix
    assert checkpoint_dir_problems(_run(1, 5)) == []  # one node: its run folder is the one folder


def _committed(root: Path, step: int = 4) -> Path:
    final = root / f"step-{step:08d}"
    final.mkdir(parents=True)
    (final / "partrain.json").write_text("{}")
    return final


def test_a_save_every_rank_sees_passes(tmp_path, monkeypatch):
    final = _committed(tmp_path)
    monkeypatch.setattr(save, "all_gather", lambda found: [found, None])
    save._settle_visible(final, tmp_path / f"{final.name}.partial")
    assert final.is_dir()


def test_a_save_another_node_cannot_see_fails_everywhere_and_is_removed(tmp_path, monkeypatch):
    """Rank 0 committed step-4; rank 2 (node 1) does not see it: its shards are in its own `.partial`."""
    final = _committed(tmp_path)
    monkeypatch.setattr(save, "all_gather", lambda found: [found, None, (2, "nodeB"), (3, "nodeB")])
    with pytest.raises(SaveFailed) as failed:
        save._settle_visible(final, tmp_path / f"{final.name}.partial")
    text = str(failed.value)
    assert "rank 2 on nodeB, rank 3 on nodeB cannot see" in text and str(final) in text
    assert "every node mounts" in text and "\n" not in text
    assert not final.exists()  # it names shards it does not hold: never left to look complete


def test_a_rank_that_does_not_see_the_commit_removes_its_partial_copy(tmp_path, monkeypatch):
    partial = tmp_path / "step-00000004.partial"
    partial.mkdir()
    monkeypatch.setattr(save, "VISIBLE_WAIT_S", 0.3)
    monkeypatch.setattr(save, "_rank_world", lambda: (2, 4))
    monkeypatch.setattr(save, "barrier", lambda: None)
    monkeypatch.setattr(save, "all_gather", lambda found: [None, None, found, found])
    with pytest.raises(SaveFailed, match="rank 2 on"):
        save._settle_visible(tmp_path / "step-00000004", partial)
    assert not partial.exists()


def test_findings_that_agree_pass_and_differing_ones_name_each_node():
    both = (("step-00000002", "step-00000004"), ())
    assert differing_findings(Path("/c"), [both] * 4, ["a"] * 4, 2) == []
    (line,) = differing_findings(Path("/c"), [both, both, ((), ()), ((), ())], ["a", "a", "b", "b"], 2)
    assert line == (
        "the checkpoints in /c (checkpoint.dir): newest step-00000004 of 2 complete on node 0 (ranks 0-1, host a); "
        "no complete checkpoint on node 1 (ranks 2-3, host b)"
    )
    (line,) = differing_findings(Path("/c"), [both, ((), ("step-00000004",))], ["a", "b"], 1)
    assert "no complete checkpoint, 1 incomplete on node 1 (rank 1, host b)" in line


def test_a_resume_whose_ranks_found_different_checkpoints_is_refused_before_loading(tmp_path, monkeypatch):
    mine = (("step-00000004",), ())
    monkeypatch.setattr(resume_agreement, "all_gather", lambda obj: [obj, (((), ()), "nodeB")])
    with pytest.raises(Disagreement) as refused:
        check_same_checkpoints(tmp_path, mine, 1)
    assert "node 1 (rank 1, host nodeB)" in refused.value.lines[0] and "every node mounts" in refused.value.fix
    monkeypatch.setattr(resume_agreement, "all_gather", lambda obj: [obj, obj])
    check_same_checkpoints(tmp_path, mine, 1)  # the same everywhere: nothing raised


def test_the_launcher_says_the_refusals_own_fix():
    rdzv = Rendezvous(2, 1, "127.0.0.1:29400", "r", timeout_s=60)
    seen = {"refused": {"lines": ["the checkpoints in /c (checkpoint.dir): ..."], "fix": "set checkpoint.dir"}}
    code, text = node_outcome(rdzv, 0, seen, "")
    assert code == 2 and text.splitlines() == [
        "error: the nodes do not agree on the checkpoints in /c (checkpoint.dir): ...",
        "fix: set checkpoint.dir",
    ]
    code, text = node_outcome(rdzv, 0, {"refused": {"lines": ["optim.lr: 1 on node 0, 2 on node 1"]}}, "")
    assert "fix: start every node with the same overrides" in text  # a worker of before: the config fix
    json.dumps(seen)  # the event is JSON
