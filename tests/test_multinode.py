"""Two nodes on one host: two `partrain train --node-rank K --rdzv-endpoint 127.0.0.1:PORT` launchers,
each starting torchrun with 2 (or 4) processes, meeting over torchrun's static rendezvous on loopback.

Checked: losses equal the single-node run of the same world size (gpt-dp dp4 on 2 x 2 processes,
gpt-3d dp2 x tp2 x pp2 on 2 x 4, tp inside a node); a config difference between the nodes makes
both refuse with exit 2 naming the key; SIGTERM to node 0's launcher stops every rank of both nodes
with a checkpoint, and resume=auto then continues exactly as the uninterrupted run; a node alone
times out with one line; a node that dies, or hangs (SIGSTOP), stops the other within train.timeout_s; placement; node 1
starting first still leaves global rank 0 (metrics, summary) on node 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from partrain.checkpoint.verify import verify_path
from partrain.rehearse.runs import train_all
from partrain.runtime.procs import children_of, workers_of_run
from partrain.testing.parity import parity_args

pytestmark = pytest.mark.slow

STEPS = 40  # ~0.05 s each here: room for SIGTERM to land mid-run in the test sharing these runs
BASE = ["train.seq_len=32", "data.max_bytes=200000", "train.timeout_s=60", "train.eval_every=0", "train.eval_batches=0"]
BASE += ["checkpoint.save_final=false"]  # tests that save name a shared checkpoint.dir (and every_steps)
DP4 = ["recipe=gpt-dp", "parallel.dp=4", "train.global_batch_size=8", "train.micro_batch_size=2"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(node: int, overrides, run_dir: Path, endpoint: str, procs: int = 2) -> subprocess.Popen:
    args = [*overrides, "cluster.nodes=2", f"cluster.devices_per_node={procs}", f"train.run_dir={run_dir}"]
    return subprocess.Popen(
        [sys.executable, "-m", "partrain.cli", "train", *args, "--node-rank", str(node), "--rdzv-endpoint", endpoint],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_two_nodes(
    overrides, tmp: Path, overrides_node1=None, timeout_s: int = 240, procs: int = 2, node1_first: bool = False
):
    """Both nodes to the end; [(exit code, stdout, stderr), ...] and the run folders. node1_first: node 1's
    launcher starts 3 s before node 0's (it waits at the endpoint before node 0 exists)."""
    endpoint = f"127.0.0.1:{free_port()}"
    dirs = [tmp / "node0", tmp / "node1"]
    per_node = [overrides, overrides_node1 or overrides]
    order = (1, 0) if node1_first else (0, 1)
    started = {}
    for k in order:
        started[k] = start_node(k, per_node[k], dirs[k], endpoint, procs)
        if node1_first and k == 1:
            time.sleep(3)
    launchers = [started[0], started[1]]
    outs = []
    for p in launchers:
        out, err = p.communicate(timeout=timeout_s)
        outs.append((p.returncode, out, err))
    return outs, dirs


def losses_of(dirs):
    """Per-step losses from the node that ran global rank 0 (the rendezvous picks which)."""
    found = [d / "metrics.jsonl" for d in dirs if (d / "metrics.jsonl").exists()]
    assert len(found) == 1, found
    return [json.loads(line)["loss"] for line in found[0].read_text().splitlines() if '"loss"' in line]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("data-cache")


def one_and_two_nodes(layout, tmp: Path, cache: Path, steps: int, procs: int = 2, two_nodes_extra=(), **launch):
    """The same run on one node of 2 x procs processes and on two nodes of procs (`two_nodes_extra`
    overrides: what does not change the losses); (losses, losses, the nodes' outputs, run folders)."""
    common = [*layout, *BASE, f"data.cache_dir={cache}"]
    # The one-node run in real processes through the worker's code (a forked launch, testing.in_process).
    one = train_all({"one": parity_args([*common, f"cluster.devices_per_node={2 * procs}"], steps)}, tmp)["one"]
    two = [*common, f"train.steps={steps}", *two_nodes_extra]
    outs, dirs = run_two_nodes(two, tmp / "two", procs=procs, **launch)
    for code, out, err in outs:
        assert code == 0, (out[-3000:], err[-3000:])
    assert f"(node 0 of 2: {procs} here)" in outs[0][1] and f"(node 1 of 2: {procs} here)" in outs[1][1]
    return one.losses, losses_of(dirs), outs, dirs


@pytest.fixture(scope="module")
def dp4_runs(tmp_path_factory, cache):
    """gpt-dp over dp4, shared by the parity test, the SIGTERM test (its uninterrupted run) and the
    static rendezvous test: node 1's launcher starts first, and every 20 steps both nodes save into a
    shared checkpoint.dir (saving does not change the losses)."""
    tmp = tmp_path_factory.mktemp("dp4")
    saves = [f"checkpoint.dir={tmp / 'ckpt'}", "checkpoint.every_steps=20"]
    return (*one_and_two_nodes(DP4, tmp, cache, STEPS, two_nodes_extra=saves, node1_first=True), tmp / "ckpt")


def test_gpt_dp_two_nodes_match_one_node(dp4_runs):
    one, two = dp4_runs[:2]
    diff = max(abs(a - b) for a, b in zip(one, two))
    print(f"gpt-dp dp4: max |loss difference| two nodes vs one node {diff:.2e}")
    assert len(two) == STEPS and diff <= 1e-6, (one, two)


@pytest.mark.parametrize(
    "sync", [["parallel.dp_sync=hierarchical"], ["parallel.dp_sync=parameter-server", "parallel.ps_servers=2"]]
)
def test_dp_sync_strategies_on_two_launchers_match_one_node(sync, dp4_runs, tmp_path, cache):
    """Issue 19 over real nodes: hierarchical (reduce-scatter inside a node, all-reduce across, all-gather
    inside) and the parameter server (2 co-located servers) on 2 launchers x 2 processes give the
    one-node DDP run's losses over 5 steps (fp32, 1e-5: the sums are ordered differently), the steps the
    issue's parity names (the dp4 run's other 35 are there for the SIGTERM test)."""
    one, steps = dp4_runs[0], 5
    common = [*DP4, *BASE, f"data.cache_dir={cache}", f"train.steps={steps}", *sync]
    outs, dirs = run_two_nodes(common, tmp_path)
    for code, out, err in outs:
        assert code == 0, (out[-3000:], err[-3000:])
    two = losses_of(dirs)
    first = max(abs(a - b) / abs(a) for a, b in zip(one[:steps], two))
    print(f"{sync[0]} on 2 nodes x 2 vs one node (DDP): max relative loss difference {first:.2e} over {steps} steps")
    assert len(two) == steps and first <= 1e-5, (one, two)  # the parity: 5 steps, 1e-5


def test_gpt_3d_two_nodes_match_one_node(tmp_path, cache):
    """gpt-3d's model as tp2 x pp2 (4 processes): 2 nodes x 2, tp inside a node, pp across (the dp
    axis over nodes is the gpt-dp test's; the shipped dp2 x tp2 x pp2 on 2 x 4 was checked by hand
    with the same result, at twice the processes)."""
    tp_pp = ["recipe=gpt-3d", "parallel.dp=1", "train.global_batch_size=4"]
    one, two = one_and_two_nodes(tp_pp, tmp_path, cache, 2, procs=2)[:2]
    diff = max(abs(a - b) for a, b in zip(one, two))
    print(f"gpt-3d tp2 x pp2: max |loss difference| two nodes vs one node {diff:.2e}")
    assert len(two) == 2 and diff <= 1e-6, (one, two)


def test_config_mismatch_refused_on_both_nodes(tmp_path):
    """Also: both nodes start on an empty shared token cache at once; they take turns preparing it."""
    common = [*DP4, *BASE, f"data.cache_dir={tmp_path / 'cold-cache'}", "train.steps=2"]
    outs, dirs = run_two_nodes([*common, "optim.lr=0.001"], tmp_path, overrides_node1=[*common, "optim.lr=0.002"])
    manifests = {json.loads((d / "data.json").read_text())["meta_path"] for d in dirs}
    assert len(manifests) == 1 and Path(manifests.pop()).exists()
    for code, out, err in outs:
        assert code == 2, (out[-3000:], err[-3000:])
        text = out + err
        assert "optim.lr: 0.001 on node 0, 0.002 on node 1" in text, text[-3000:]
        assert "Traceback" not in text
        assert [line for line in text.splitlines() if line.startswith("error:")] == [
            "error: the nodes do not agree on optim.lr: 0.001 on node 0, 0.002 on node 1"
        ]


def test_missing_endpoint_is_a_config_error(tmp_path):
    ran = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *DP4, "cluster.nodes=2", f"train.run_dir={tmp_path / 'r'}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 2 and "cluster.rdzv_endpoint" in ran.stderr and "--rdzv-endpoint" in ran.stderr
    assert not (tmp_path / "r").exists()
    alone = [*DP4, "cluster.devices_per_node=4", f"train.run_dir={tmp_path / 'r'}", "--node-rank", "1"]
    ran = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *alone], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 2 and "cluster.node_rank=1" in ran.stderr and not (tmp_path / "r").exists()
    # The flags win over the keys (cluster.node_rank=7 is replaced by --node-rank 2).
    bad = [*DP4, "cluster.nodes=2", "cluster.node_rank=7", "--node-rank", "2", "--rdzv-endpoint", "127.0.0.1:99999"]
    ran = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *bad], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 2 and "cluster.node_rank=2" in ran.stderr and "cluster.rdzv_endpoint" in ran.stderr
    assert "node_rank=7" not in ran.stderr


def test_sigterm_to_node0_checkpoints_both_nodes_and_resume_matches(tmp_path, cache, dp4_runs):
    steps = STEPS
    ckpt = tmp_path / "ckpt"
    common = [*DP4, *BASE, f"data.cache_dir={cache}", f"checkpoint.dir={ckpt}", "checkpoint.every_steps=100"]
    endpoint = f"127.0.0.1:{free_port()}"
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    slow = [*common, f"train.steps={steps}"]
    procs = [start_node(k, slow, dirs[k], endpoint) for k in (0, 1)]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not any(
        (d / "metrics.jsonl").exists() and (d / "metrics.jsonl").read_text().count('"loss"') >= 1 for d in dirs
    ):
        time.sleep(0.2)
    sent = time.monotonic()
    os.kill(procs[0].pid, signal.SIGTERM)
    outs = [p.communicate(timeout=60) for p in procs]
    stop_s = time.monotonic() - sent
    codes = [p.returncode for p in procs]
    print(f"SIGTERM to node 0: both nodes ended {stop_s:.1f} s later, codes {codes}")
    assert stop_s < 30 and codes == [128 + signal.SIGTERM] * 2, outs
    for out, _ in outs:
        assert "stopped by SIGTERM after step" in out and "checkpoint saved at" in out, out[-2000:]
    assert all(workers_of_run(d) == [] for d in dirs)
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step"))
    assert saved, list(ckpt.iterdir())
    # Resume on two nodes (fresh run folders), then compare the whole run with the uninterrupted one.
    outs2, dirs2 = run_two_nodes([*slow, "checkpoint.resume=auto"], tmp_path / "again")
    assert [c for c, _, _ in outs2] == [0, 0], outs2
    first, rest = losses_of(dirs), losses_of(dirs2)
    # Stopped mid-run, checkpoint at the step it stopped after, and the resumed run did the rest.
    assert 0 < len(first) < steps and saved[-1] == f"step-{len(first):08d}" and len(first) + len(rest) == steps
    whole = dp4_runs[1]  # the uninterrupted two-node run
    got = first[: steps - len(rest)] + rest
    diff = max(abs(a - b) for a, b in zip(whole, got))
    print(f"resumed after {saved[-1]}: max |loss difference| vs the uninterrupted two-node run {diff:.2e}")
    assert len(got) == steps and diff <= 1e-6, (whole, first, rest)


def test_placement_on_two_nodes():
    """Dry run: ranks per node, tp groups inside a node, the spanning pp groups on the inter-node link;
    a tp group that would span nodes is refused (exit 2)."""
    dims = ["cluster.nodes=2", "cluster.devices_per_node=2", "parallel.dp=1", "train.global_batch_size=4"]
    dims += ["checkpoint.save_final=false", "--node-rank", "0", "--rdzv-endpoint", "node0:29400"]  # the launch's checks
    cmd = [sys.executable, "-m", "partrain.cli", "train", "recipe=gpt-3d", *dims, "--dry-run"]
    ok = subprocess.run([*cmd, "parallel.tp=2", "parallel.pp=2", "--json"], capture_output=True, text=True, timeout=120)
    report = json.loads(ok.stdout)
    assert [(r["rank"], r["node"], r["local_rank"]) for r in report["ranks"]] == [
        (0, 0, 0),
        (1, 0, 1),
        (2, 1, 0),
        (3, 1, 1),
    ]
    assert report["groups"]["tp"] == [[0, 1], [2, 3]] and report["groups"]["pp"] == [[0, 2], [1, 3]]
    assert report["estimate"]["links"]["tp"].startswith("intra-node")
    assert report["estimate"]["links"]["pp"].startswith("inter-node")
    bad = subprocess.run([*cmd, "parallel.tp=4", "parallel.pp=1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "parallel.tp=4" in bad.stderr and "one node" in bad.stderr


def test_node_alone_times_out_with_a_clear_line(tmp_path, cache):
    """Node 1 never starts: node 0 gives up after train.timeout_s with one line, no process left."""
    run_dir = tmp_path / "node0"
    args = [
        *DP4,
        *BASE,
        f"data.cache_dir={cache}",
        "train.timeout_s=5",
        "cluster.nodes=2",
        "cluster.devices_per_node=2",
    ]
    started = time.monotonic()
    ran = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "train", *args, f"train.run_dir={run_dir}", "--node-rank", "0"]
        + ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - started
    print(f"node alone: ended {took:.1f} s after its start (train.timeout_s=5)")
    assert ran.returncode == 1 and "Traceback" not in ran.stdout + ran.stderr
    assert "node 0 waited 5 s" in ran.stdout and "for 2 nodes to join; only this node joined" in ran.stdout
    assert workers_of_run(run_dir) == []


def test_node_that_dies_stops_the_other_within_timeout(tmp_path, cache):
    """SIGKILL to node 1's launcher mid-run: node 0 ends within train.timeout_s, no process left anywhere."""
    common = [*DP4, *BASE, f"data.cache_dir={cache}", "train.timeout_s=20", "train.steps=300"]
    endpoint = f"127.0.0.1:{free_port()}"
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    procs = [start_node(k, common, dirs[k], endpoint) for k in (0, 1)]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and not any((d / "metrics.jsonl").exists() for d in dirs):
        time.sleep(0.2)
    killed = time.monotonic()
    procs[1].kill()
    out, err = procs[0].communicate(timeout=60)
    took = time.monotonic() - killed
    procs[1].wait(timeout=10)
    print(f"node 1 killed: node 0 ended {took:.1f} s later (train.timeout_s=20), code {procs[0].returncode}")
    assert took < 20 and procs[0].returncode != 0 and "Traceback" not in out + err, (out[-2000:], err[-2000:])
    time.sleep(1)  # the killed node's workers see their parent die at once; give them a moment to leave
    assert [workers_of_run(d) for d in dirs] == [[], []]


def _tree(pid: int) -> list:
    """pid and its descendants, parents first."""
    found = [pid]
    for child in children_of(pid):
        found += _tree(child)
    return found


def test_node_that_hangs_stops_the_other_within_timeout(tmp_path, cache):
    """Issue 38 item 5: SIGSTOP to node 1's launcher, torchrun and workers mid-run (a node that stops
    answering): node 0 ends within train.timeout_s with one line naming node 1, no traceback, and
    the checkpoints saved before the hang verify."""
    common = [*DP4, *BASE, f"data.cache_dir={cache}", "train.timeout_s=12", "train.steps=300"]
    common += ["checkpoint.every_steps=5", f"checkpoint.dir={tmp_path / 'ckpt'}"]
    endpoint = f"127.0.0.1:{free_port()}"
    dirs = [tmp_path / "node0", tmp_path / "node1"]
    procs = [start_node(k, common, dirs[k], endpoint) for k in (0, 1)]
    try:
        deadline = time.monotonic() + 180
        metrics = dirs[0] / "metrics.jsonl"  # node 0 hosts global rank 0
        while time.monotonic() < deadline and (not metrics.exists() or metrics.read_text().count('"loss"') < 7):
            time.sleep(0.2)  # past the checkpoint of step 5
        hung = _tree(procs[1].pid)  # the launcher, torchrun and the workers (torchrun gives them sessions of their own)
        stopped = time.monotonic()
        for pid in hung:
            os.kill(pid, signal.SIGSTOP)
        out, err = procs[0].communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        for pid in _tree(procs[1].pid):
            os.kill(pid, signal.SIGKILL)
        procs[1].wait(timeout=10)
    print(f"node 1 stopped: node 0 ended {took:.1f} s later (train.timeout_s=12), code {procs[0].returncode}")
    assert took < 12 and procs[0].returncode != 0, (out[-2000:], err[-2000:])
    assert "node 1 stopped answering" in out + err and "Traceback" not in out + err, (out[-2000:], err[-2000:])
    time.sleep(1)
    assert workers_of_run(dirs[0]) == []
    verdicts = verify_path(tmp_path / "ckpt")  # the complete checkpoints (a .partial is never resumed)
    assert verdicts and all(v.ok for v in verdicts), verdicts


def test_node_rank_0_runs_global_rank_0_whichever_node_starts_first(dp4_runs):
    """Issue 38 item 4: the static rendezvous. In the shared dp4 run node 1's launcher starts first;
    global rank 0 (metrics, summary) is still on node 0, and every checkpoint in the shared
    checkpoint.dir is complete."""
    _, _, outs, dirs, ckpt = dp4_runs
    assert (dirs[0] / "metrics.jsonl").exists() and not (dirs[1] / "metrics.jsonl").exists()
    assert "loss" in outs[0][1] and "node 1: its workers ended cleanly" in outs[1][1]
    assert "folder of node 0" in outs[1][1], outs[1][1]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step")) == ["step-00000020", "step-00000040"]
    assert all((ckpt / name / "partrain.json").is_file() for name in ("step-00000020", "step-00000040"))
