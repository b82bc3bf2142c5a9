"""One verdict per report, under the accounting of partrain's own runtime (issue 15 items 1, 4, 6).

`partrain plan` counts what `partrain train` allocates by default (fp32 weights under autocast, the
data-parallel bucket buffers); `--accounting paper` keeps ZeRO's 2+2+12 bytes for published tables.
"Ready to launch" only for a layout that fits and that this version trains; `--check` exits 3
otherwise. `--search` starts from the model, cluster and global batch even when the starting
degrees are invalid, and ranks only trainable layouts unless `--include-unsupported`.
"""

from __future__ import annotations

import json

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.recipes import list_recipes
from partrain.blueprint.planner import estimate
from partrain.blueprint.planner.search import SearchSpace, search
from partrain.blueprint.report.estimate import conclude
from partrain.blueprint.report.layout import layout_report
from partrain.blueprint.report.notes import note_texts
from partrain.blueprint.trainable import unsupported_features
from partrain.blueprint.validate import validate

EIGHT_B_SELECTIVE = ["recipe=llama3-8b-h100", "parallel.recompute=selective"]


def _report(overrides, mixed="autocast"):
    v = validate(compose(overrides))
    report = layout_report(v)
    report["estimate"] = estimate(v, mixed=mixed)
    return conclude(report)


def test_llama3_8b_selective_fits_on_paper_but_not_under_the_runtime():
    """ZeRO-3 over 8 H100, bf16, 8k tokens, selective recompute: about 74 GiB under the paper's
    16-bit states (fits 75.6 usable), about 88 under partrain's runtime (fp32 weights and gradients,
    8 + 4 more bytes a parameter on 1/8 of 8B: the same activations)."""
    runtime, paper = _report(EIGHT_B_SELECTIVE), _report(EIGHT_B_SELECTIVE, mixed="zero")
    capacity = runtime["estimate"]["capacity_bytes"]
    assert paper["status"] == "ready" and "ready to launch" in paper["verdict"]
    assert paper["estimate"]["memory_bytes"]["total"] <= capacity
    assert runtime["status"] == "does_not_fit" and not runtime["ready"]
    assert runtime["estimate"]["memory_bytes"]["total"] > capacity
    states = {
        k: runtime["estimate"]["memory_bytes"][k] - paper["estimate"]["memory_bytes"][k] for k in ("params", "grads")
    }
    psi = paper["estimate"]["params_total"]
    assert states["params"] == pytest.approx(2 * psi / 8, rel=0.01)  # fp32 instead of 16-bit, sharded over 8
    assert states["grads"] == pytest.approx(2 * psi / 8, rel=0.01)
    assert "ready to launch" not in runtime["verdict"] and "does not fit" in runtime["verdict"]
    assert runtime["estimate"]["assumptions"]["accounting"] == "runtime"
    assert paper["estimate"]["assumptions"]["accounting"] == "paper"


def test_ddp_bucket_buffers_are_counted_under_the_runtime_accounting():
    """ZeRO-0 DDP keeps bucket buffers as large as the gradients (gradient_as_bucket_view off)."""
    one = estimate(validate(compose(["recipe=gpt-dp", "parallel.dp=1", "cluster.devices_per_node=1"])))
    two = estimate(validate(compose(["recipe=gpt-dp"])))
    grads = two["memory_bytes"]["grads"]
    assert two["memory_bytes"]["transient"] - one["memory_bytes"]["transient"] == pytest.approx(grads, rel=1e-6)


def test_every_shipped_recipe_fits_and_trains_under_the_runtime_accounting():
    """Issue 15 item 6: no shipped recipe says "ready" for a layout that does not fit or cannot train."""
    for name in list_recipes([]):
        report = _report([f"recipe={name}"])
        assert report["status"] == "ready", (name, report["verdict"])
        assert unsupported_features(validate(compose([f"recipe={name}"]))) == []


def test_plan_check_exit_codes(cli):
    assert cli("plan", "recipe=llama3-8b-h100", "--check").code == 0
    ran = cli("plan", *EIGHT_B_SELECTIVE, "--check")
    assert ran.code == 3, ran.stdout + ran.stderr
    assert "does not fit" in ran.stdout and "ready to launch" not in ran.stdout
    assert cli("plan", *EIGHT_B_SELECTIVE, "--check", "--accounting", "paper").code == 0
    # A layout this version cannot train (16-bit parameters with expert parallelism) is never "ready", fit or not.
    moe_16bit = ["recipe=mixtral-ep", "train.precision=bf16", "train.param_dtype=16bit", "parallel.zero_stage=1"]
    ran = cli("plan", *moe_16bit, "--check", "--json")
    assert ran.code == 3
    report = json.loads(ran.stdout)
    assert report["status"] == "unsupported" and report["ready"] is False
    assert "ready to launch" not in report["verdict"]
    # The same verdict from the dry run.
    assert cli("train", *EIGHT_B_SELECTIVE, "--dry-run", "--check").code == 3
    assert cli("train", "recipe=gpt-dp", "--dry-run", "--check").code == 0
    assert cli("train", "recipe=gpt-dp", "--dry-run").code == 0  # without --check: the report, exit 0
    # Usage errors: exit 2 with the option named.
    ran = cli("train", "recipe=gpt-dp", "--check")
    assert ran.code == 2 and "--check" in ran.stderr and not ran.spawned
    ran = cli("plan", "recipe=gpt-dp", "--accounting", "zero")
    assert ran.code == 2 and "--accounting" in ran.stderr


def test_a_cpu_node_shares_its_memory_between_its_processes(cli):
    """On a CPU cluster device_memory_gib is the node's memory: each of its processes may fill its share, and
    counts its own resident memory beyond tensors (the "process" term). 0.6 GiB holds one gpt-dp rank (about
    0.45 GiB) but not two: the 2-process layout does not fit and `--check` exits 3."""
    one = ["recipe=gpt-dp", "cluster.devices_per_node=1", "parallel.dp=1", "cluster.device_memory_gib=0.6"]
    two = ["recipe=gpt-dp", "cluster.device_memory_gib=0.6"]
    alone, shared = (estimate(validate(compose(o))) for o in (one, two))
    assert alone["fits"] and alone["capacity_bytes"] == pytest.approx(0.6 * 0.95 * 2**30)
    assert not shared["fits"] and shared["capacity_bytes"] == pytest.approx(0.3 * 0.95 * 2**30)
    assert shared["memory_bytes"]["process"] > 300 * 2**20  # the worker's runtime, code and heap
    assert "shared by its 2 processes" in note_texts(shared)[0]
    assert cli("plan", *one, "--check").code == 0
    ran = cli("plan", *two, "--check")
    assert ran.code == 3 and "does not fit" in ran.stdout, ran.stdout


def test_search_starts_from_an_invalid_layout(cli):
    """tp=3 divides neither the world nor the heads, and dp=-1 cannot absorb it: the search still
    runs from the model, cluster and global batch, and names the ignored problems."""
    ran = cli("plan", "recipe=llama3-8b-h100", "parallel.tp=3", "parallel.dp=-1", "--search", "--top", "2", "--json")
    assert ran.code == 0, ran.stdout + ran.stderr
    out = json.loads(ran.stdout)
    assert out["valid"] is False and {p["key"] for p in out["starting_layout_problems"]} <= {
        "parallel.dp",
        "parallel.tp",
    }
    assert len(out["candidates"]) == 2
    for c in out["candidates"]:
        assert c["unsupported"] == []
        overrides = ["recipe=llama3-8b-h100", *c["overrides"]]
        assert _report(overrides)["status"] == "ready"
    ran = cli("plan", "recipe=llama3-8b-h100", "parallel.tp=3", "parallel.dp=-1", "--search", "--top", "1")
    assert ran.code == 0 and "starting layout is not valid" in ran.stdout
    # A problem the search cannot choose around (the model itself) still exits 2.
    ran = cli("plan", "recipe=llama3-8b-h100", "parallel.tp=3", "train.seq_len=0", "--search")
    assert ran.code == 2 and "train.seq_len" in ran.stderr


def test_search_ranks_only_trainable_layouts_unless_asked():
    v = validate(compose(["recipe=gpt3-175b-h100"]))
    space = SearchSpace(tp=(8,), pp=(16,), zero_stages=(1, 2), recompute=("selective",), micro_batch_sizes=(1,))
    every = search(v, top_k=50, space=space)
    runnable = search(v, top_k=50, space=space, runnable_only=True)
    assert runnable and all(not c["unsupported"] for c in runnable)
    assert len(every) >= len(runnable)
    # ZeRO-1 with TP trains now (both ZeRO-1 optimizers shard DTensors' local tensors): ranked too.
    assert any("parallel.zero_stage=1" in c["overrides"] for c in runnable)


def test_plan_search_flag_passes_include_unsupported(cli):
    args = ["plan", "recipe=gpt3-175b-h100", "parallel.zero_stage=1", "--search", "--top", "30", "--json"]
    default = json.loads(cli(*args).stdout)["candidates"]
    assert all(not c["unsupported"] for c in default)
    wide = json.loads(cli(*args, "--include-unsupported").stdout)["candidates"]
    assert len(wide) == 30
