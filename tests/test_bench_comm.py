"""`partrain bench comm` for real (2 gloo processes, small sizes) and the planner reading its
profile: measured bus bandwidths per op and link class replace the nominal link speeds."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import pytest

from partrain.blueprint.comm_profile import (
    OPS,
    ProfileError,
    bus_factor,
    load_profile,
    make_profile,
    parse_sizes,
    result,
    write_profile,
)
from partrain.blueprint.planner.spec import GB, cluster_spec

CPU_CLUSTER = {"name": "local-cpu", "nodes": 1, "devices_per_node": 2, "backend": "gloo", "device": "cpu"}


def synthetic(
    path: Path,
    gbps: dict,
    links=("intra",),
    cluster=CPU_CLUSTER,
    unsupported=(),
    latency_s: float = 0.0,
    cpu_s: Optional[float] = None,
) -> Path:
    """A profile whose busbw at the largest size is gbps[op] (GB/s) on each link class, written
    through profile.py as `bench comm` writes it; `cpu_s`: every call's CPU seconds (none: not measured)."""
    entries = {}
    for link in links:
        ops = {}
        for op in OPS:
            factor = bus_factor(op, 2)
            if op in unsupported:
                ops[op] = {"supported": False, "torch_op": op, "bus_factor": factor, "results": [], "error": "no"}
                continue
            big = 1 << 24
            # Both sizes at the same bus bandwidth: no fixed cost per call (latency tests add one).
            rows = [result(n, n * factor / (gbps[op] * GB) + latency_s, factor, cpu_s) for n in (4096, big)]
            ops[op] = {"supported": True, "torch_op": op, "bus_factor": factor, "results": rows}
        entries[link] = {"group_size": 2, "groups": [[0, 1]], "ops": ops}
    profile = make_profile(cluster, entries, {"dtype": "float32", "sizes": [4096, 1 << 24], "iters": 1, "warmup": 0})
    return write_profile(path, profile)


def _estimate(cli, *args):
    ran = cli("plan", *args, "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    return json.loads(ran.stdout)["estimate"]


def test_bench_comm_measures_every_op_and_plan_uses_the_profile(run_partrain):
    # PARTRAIN_TEST_SPAWN_LOG="" lifts the fixture's process guard: this test starts torchrun for real.
    ran = run_partrain(
        "bench",
        "comm",
        "--sizes",
        "4K,1M",
        "--iters",
        "3",
        "--warmup",
        "1",
        "--json",
        env={"PARTRAIN_TEST_SPAWN_LOG": ""},
        timeout=120,
    )
    assert ran.code == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    report = json.loads(ran.stdout)
    path = ran.cwd / report["path"]
    assert path.parent == ran.cwd / "runs" / "bench-comm" and path.is_file()
    profile = load_profile(path)
    assert {k: v for k, v in report.items() if k != "path"} == profile
    assert profile["cluster"] == CPU_CLUSTER and profile["torch"] and profile["date"]
    assert list(profile["links"]) == ["intra"]  # one node: no inter-node link to measure
    intra = profile["links"]["intra"]
    assert intra["group_size"] == 2 and intra["groups"] == [[0, 1]]
    assert set(intra["ops"]) == set(OPS)
    for op, rec in intra["ops"].items():
        assert rec["supported"] is True, (op, rec)  # gloo in torch 2.13 has every one of them
        assert rec["bus_factor"] == pytest.approx(bus_factor(op, 2))
        assert [r["bytes"] for r in rec["results"]] == [4096, 1 << 20]
        for r in rec["results"]:
            assert math.isfinite(r["time_s"]) and r["time_s"] > 0 and r["algbw"] > 0
            assert r["algbw"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9)
            assert r["busbw"] == pytest.approx(r["algbw"] * {"all_reduce": 1.0, "send_recv": 1.0}.get(op, 0.5))
            assert math.isfinite(r["cpu_s"]) and r["cpu_s"] > 0  # the ranks' CPU per call, gloo's threads too
        assert profile["summary"]["intra"][op] == rec["results"][-1]["busbw"]  # largest size
    assert "busy" not in profile  # the busy-node measurement is gone: the planner's CPU host model is frozen

    plan = run_partrain("plan", "recipe=gpt-3d", f"cluster.comm_profile={path}", "--json")
    assert plan.code == 0, plan.stderr
    est = json.loads(plan.stdout)["estimate"]
    assert est["bandwidth_source"] == f"profile:{path}"
    assert est["assumptions"]["link_bandwidths_gbps"]["intra"] == pytest.approx(profile["summary"]["intra"])
    assert (
        est["assumptions"]["link_bandwidths_gbps"]["inter"]["all_reduce"] == 5.0
    )  # local-cpu's nominal inter_node_gbps
    assert est["links"]["tp"] == f"intra-node {profile['summary']['intra']['all_reduce']:g} GB/s"


def test_step_time_follows_the_profile(cli, tmp_path):
    base = {op: 1.0 for op in OPS}
    slow, fast = synthetic(tmp_path / "slow.json", base), synthetic(tmp_path / "fast.json", {op: 10.0 for op in OPS})
    e_slow = _estimate(cli, "recipe=gpt-3d", f"cluster.comm_profile={slow}")
    e_fast = _estimate(cli, "recipe=gpt-3d", f"cluster.comm_profile={fast}")
    assert e_fast["bandwidth_source"] == f"profile:{fast}"
    t_slow, t_fast = e_slow["time_breakdown_s"], e_fast["time_breakdown_s"]
    for family in ("tp", "pp"):  # gpt-3d: tp2 x pp2 inside one node
        assert t_slow[family] > 0 and t_slow[family] / t_fast[family] == pytest.approx(10.0)
    assert t_slow["compute"] == t_fast["compute"] and e_slow["comm_bytes_per_step"] == e_fast["comm_bytes_per_step"]
    # A profile measuring X GB/s for every op predicts what nominal links of X GB/s do.
    nominal = _estimate(cli, "recipe=gpt-3d", "cluster.intra_node_gbps=1.0", "cluster.inter_node_gbps=1.0")
    assert nominal["bandwidth_source"] == "nominal"
    assert e_slow["step_time_s"] == pytest.approx(nominal["step_time_s"], rel=1e-12)


def test_each_collective_uses_its_own_measured_bandwidth(cli, tmp_path):
    same = synthetic(tmp_path / "same.json", {op: 1.0 for op in OPS})
    a2a = synthetic(tmp_path / "a2a.json", {**{op: 1.0 for op in OPS}, "all_to_all": 10.0})
    e_same = _estimate(cli, "recipe=mixtral-ep", f"cluster.comm_profile={same}")["time_breakdown_s"]
    e_a2a = _estimate(cli, "recipe=mixtral-ep", f"cluster.comm_profile={a2a}")["time_breakdown_s"]
    assert e_same["ep"] / e_a2a["ep"] == pytest.approx(10.0)  # expert dispatch/combine are all-to-alls
    p2p = synthetic(tmp_path / "p2p.json", {**{op: 1.0 for op in OPS}, "send_recv": 10.0})
    e_p2p = _estimate(cli, "recipe=gpt-3d", f"cluster.comm_profile={p2p}")["time_breakdown_s"]
    e_ref = _estimate(cli, "recipe=gpt-3d", f"cluster.comm_profile={same}")["time_breakdown_s"]
    assert e_ref["pp"] / e_p2p["pp"] == pytest.approx(10.0) and e_ref["tp"] == e_p2p["tp"]


def test_inter_node_links_use_the_profile_or_stay_nominal(cli, tmp_path):
    two_nodes = ("recipe=gpt-3d", "cluster.nodes=2", "cluster.devices_per_node=4")  # pp2 is outermost: it spans nodes
    one = synthetic(tmp_path / "one-node.json", {op: 1.0 for op in OPS})
    est = _estimate(cli, *two_nodes, f"cluster.comm_profile={one}")
    assert est["links"]["pp"] == "inter-node 5 GB/s" and est["links"]["tp"] == "intra-node 1 GB/s"
    assert any("no inter-node measurement" in note for note in est["notes"])
    both = synthetic(
        tmp_path / "two-nodes.json",
        {op: 0.5 for op in OPS},
        links=("intra", "inter"),
        cluster={**CPU_CLUSTER, "nodes": 2},
    )
    est = _estimate(cli, *two_nodes, f"cluster.comm_profile={both}")
    assert est["links"]["pp"] == "inter-node 0.5 GB/s"
    assert not any("no inter-node measurement" in note for note in est["notes"])


def test_unsupported_op_falls_back_to_the_links_all_reduce(tmp_path):
    path = synthetic(
        tmp_path / "p.json", {op: 2.0 for op in OPS} | {"all_reduce": 3.0}, unsupported=("reduce_scatter",)
    )
    profile = load_profile(path)
    assert "reduce_scatter" not in profile["summary"]["intra"]
    cl = SimpleNamespace(
        nodes=2,
        devices_per_node=2,
        device="cpu",
        device_memory_gib=1.0,
        peak_tflops=1.0,
        intra_node_gbps=7.0,
        inter_node_gbps=5.0,
        comm_profile=str(path),
    )
    spec = cluster_spec(cl)
    assert spec.bandwidth_source == f"profile:{path}" and spec.intra_bw == pytest.approx(3e9)
    assert spec.bw("intra", "reduce_scatter") == pytest.approx(3e9)  # unmeasured op: the link's measured all-reduce
    assert spec.bw("intra", "all_gather") == pytest.approx(2e9)
    assert spec.bw("inter", "all_gather") == spec.inter_bw == 5e9  # unmeasured link class: nominal


def _bad_profiles(tmp_path):
    good = json.loads(synthetic(tmp_path / "good.json", {op: 1.0 for op in OPS}).read_text())
    (tmp_path / "notjson.json").write_text("{oops")
    (tmp_path / "other.json").write_text(json.dumps({"hello": 1}))
    (tmp_path / "v9.json").write_text(json.dumps({**good, "version": 9}))
    (tmp_path / "zero.json").write_text(json.dumps({**good, "summary": {"intra": {"all_reduce": 0}}}))
    return [
        ("missing.json", "no such file", ()),
        ("notjson.json", "is not JSON", ()),
        ("other.json", "not a partrain communication profile", ()),
        ("v9.json", "version 9", ()),
        ("zero.json", "not a positive finite bandwidth", ()),
        ("good.json", "backend gloo on cpu", ("cluster=h100x8", "recipe=llama3-8b-h100")),
    ]


def test_bad_profile_is_refused_before_anything(cli, tmp_path):
    for name, rule, extra in _bad_profiles(tmp_path):
        value = str(tmp_path / name)
        for mode in (("--json",), ()):
            ran = cli("plan", *extra, f"cluster.comm_profile={value}", *mode)
            assert ran.code == 2 and ran.spawned == [] and ran.created() == [], (name, ran.stdout, ran.stderr)
            assert "Traceback" not in ran.stdout + ran.stderr
            if mode:
                errors = json.loads(ran.stdout)["errors"]
                assert len(errors) == 1 and errors[0]["key"] == "cluster.comm_profile" and errors[0]["value"] == value
                assert rule in errors[0]["rule"] and "partrain bench comm" in errors[0]["fix"], errors
            else:
                assert "cluster.comm_profile" in ran.stderr and rule in ran.stderr.replace("\n", " ")
    with pytest.raises(ProfileError):
        load_profile(tmp_path / "other.json")


@pytest.mark.parametrize(
    "args, key",
    [
        (["--sizes", "0"], "--sizes"),
        (["--sizes", "abc"], "--sizes"),
        (["--sizes", "1K,,4K"], "--sizes"),
        (["--iters", "0"], "--iters"),
        (["--warmup", "-1"], "--warmup"),
        (["cluster.devices_per_node=1"], "cluster.devices_per_node"),
        (["cluster.nodes=2"], "cluster.nodes"),
    ],
)
def test_bad_bench_input_exits_2_and_starts_nothing(cli, args, key):
    for mode in (["--json"], []):
        ran = cli("bench", "comm", *args, *mode)
        assert ran.code == 2 and ran.spawned == [] and ran.created() == [], (ran.stdout, ran.stderr)
        assert "Traceback" not in ran.stdout + ran.stderr
        if mode:
            assert [e["key"] for e in json.loads(ran.stdout)["errors"]] == [key]
        else:
            assert ran.stderr.count("error:") == 1 and key in ran.stderr


def test_size_parsing_and_bus_factors():
    assert parse_sizes("64K,1K,1M,1k,2G") == [1024, 65536, 1 << 20, 2 << 30]
    for bad in ("0", "abc", "-4", "1.5K", "", "4K,"):
        with pytest.raises(ValueError):
            parse_sizes(bad)
    assert [bus_factor(op, 4) for op in OPS] == [1.5, 0.75, 0.75, 0.75, 1.0]


def test_report_renders_tables_and_summary(tmp_path):
    from rich.console import Console

    from partrain.bench.comm_parent import render_profile

    path = synthetic(tmp_path / "p.json", {op: 1.0 for op in OPS}, unsupported=("all_to_all",))
    console = Console(record=True, width=200)
    render_profile(load_profile(path), path, console)
    text = console.export_text()
    assert "all_reduce over intra groups of 2" in text and "busbw (GB/s)" in text and "16M" in text
    assert "all_to_all over intra groups of 2 (gloo, cpu; bus factor 0.5): not supported" in text
    assert f"cluster.comm_profile={path}" in text


def test_plan_with_a_profile_does_not_import_torch(tmp_path):
    path = synthetic(tmp_path / "p.json", {op: 1.0 for op in OPS})
    code = textwrap.dedent(f"""\
        import sys
        from partrain.cli import main
        try:
            main(["plan", "recipe=gpt-3d", "cluster.comm_profile={path}", "--json"])
        except SystemExit as exit:
            assert exit.code in (0, None), exit.code
        assert "torch" not in sys.modules
        """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_measured_fixed_cost_per_call_is_charged_per_collective(cli, tmp_path):
    """alpha-beta: the smallest message's time beyond its bytes at the largest message's bus bandwidth
    is a fixed cost per call, charged to each TP all-reduce and pipeline send of a microbatch (the
    many small per-layer collectives; on 8 gloo processes sharing 2 cores a 1 KiB all-reduce takes
    about 15 ms, far above its bytes)."""
    from partrain.blueprint.comm_profile import planner_latencies

    ops = {op: 1.0 for op in OPS}
    paths = {ms: synthetic(tmp_path / f"lat{ms}.json", ops, latency_s=ms * 1e-3) for ms in (0, 1, 2)}
    assert all(a == pytest.approx(0.0, abs=1e-12) for _, a in planner_latencies(paths[0]))
    assert dict(planner_latencies(paths[2]))["intra/all_reduce"] == pytest.approx(2e-3, rel=1e-3)
    t = {
        ms: _estimate(cli, "recipe=gpt-3d", f"cluster.comm_profile={p}")["time_breakdown_s"] for ms, p in paths.items()
    }
    for family in ("tp", "pp"):
        one, two = t[1][family] - t[0][family], t[2][family] - t[0][family]
        assert one > 0 and two == pytest.approx(2 * one, rel=1e-3)
    # gpt-3d, the busiest pipeline rank: 2 microbatches x (2 layers x 4 all-reduces + the embedding's or head's 1)
    # (the bandwidth is a little lower too: the fixed cost is also in the largest message's time)
    assert t[1]["tp"] - t[0]["tp"] == pytest.approx(2 * 9 * 1e-3, rel=0.02)
