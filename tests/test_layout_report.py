"""The layout report a person reads (issue 36, item 5): ranks grouped by what they hold (one row per
kind, with counts, rank ranges and nodes) unless --all-ranks; compact process groups; the whole
`plan` / `train --dry-run` report within 100 columns; the console's width when no terminal says it."""

from __future__ import annotations

import json
import re

import pytest

from partrain.blueprint.config.compose import compose
from partrain.blueprint.config.schema import PP_SCHEDULES
from partrain.blueprint.report.layout import compact_ranges, rank_kinds
from partrain.blueprint.report.schedule import render_plain
from partrain.blueprint.schedule_sim import schedule_grid
from partrain.blueprint.validate import validate
from partrain.cli.common import REPORT_WIDTH, report_width


def _expand(text: str) -> list:
    """The integers of a compact_ranges text (no budget cut); "a-b, c-d, ..., y-z" repeats the stride."""
    runs = [tuple(int(x) for x in part.split("-")) for part in text.split(", ") if part != "..."]
    runs = [(r[0], r[-1]) for r in runs]
    if "..." in text.split(", "):
        stride = runs[1][0] - runs[0][0]
        runs = [(a, a + runs[0][1] - runs[0][0]) for a in range(runs[0][0], runs[-1][0] + 1, stride)]
    return [i for a, b in runs for i in range(a, b + 1)]


def test_compact_ranges():
    assert compact_ranges([0, 1, 2, 3]) == "0-3"
    assert compact_ranges([5]) == "5"
    assert compact_ranges([0, 16, 32, 48]) == "0, 16, 32, 48"  # four: all of them read as easily
    assert compact_ranges(list(range(0, 8)) + list(range(16, 24))) == "0-7, 16-23"
    regular = [r for start in range(0, 128, 16) for r in range(start, start + 8)]
    assert compact_ranges(regular) == "0-7, 16-23, ..., 112-119"
    assert _expand(compact_ranges(regular)) == regular
    irregular = [0, 3, 4, 9, 20, 21, 22, 40, 41, 70, 99]
    assert _expand(compact_ranges(irregular)) == irregular
    cut = compact_ranges(irregular, budget=20)
    assert len(cut) <= 20 and cut.endswith(")") and cut.startswith("0, 3-4")
    shown = _expand(cut.rsplit(", ...", 1)[0])
    assert cut.endswith(f"(+{len(irregular) - len(shown)})")


@pytest.mark.parametrize(
    "overrides",
    [
        ["recipe=llama3-70b-h100"],  # pp4 interleaved x tp8 x dp2
        ["recipe=gpt-3d"],
        [
            "recipe=mixtral-ep",
            "cluster.devices_per_node=16",
            "parallel.dp=16",
            "parallel.ep=4",
            "train.global_batch_size=64",
        ],
        ["recipe=gpt-3d", "parallel.pp_schedule=zbv", "parallel.pp_virtual_stages=2", "model.config.n_layer=4"],
    ],
)
def test_rank_kinds_partition_the_world_by_what_ranks_hold(overrides):
    v = validate(compose(overrides))
    kinds = rank_kinds(v)
    layout = v.layout
    seen = []
    for k in kinds:
        ranks = _expand(k["ranks"])
        assert len(ranks) == k["count"]
        seen += ranks
        for r in ranks:  # a kind is one (pp rank, ep rank): its layers and its experts
            c = layout.coords(r)
            assert c["pp"] == k["pp_rank"] and (layout.ep == 1 or c["ep"] == k["ep_rank"])
        assert _expand(k["nodes"]) == sorted({layout.node_of(r) for r in ranks})
    assert sorted(seen) == list(range(layout.world_size))
    assert len(kinds) == layout.pp * layout.ep
    # Every decoder layer is held by exactly one pipeline rank; embedding and head by one each.
    stages = {k["pp_rank"]: k for k in kinds}
    layers = sorted(i for k in stages.values() for a, b in k["layers"] for i in range(a, b))
    assert layers == list(range(v.facts.n_layers))
    assert sum(k["embedding"] for k in stages.values()) == sum(k["head"] for k in stages.values()) == 1
    assert stages[0]["embedding"]
    v_shaped = v.run.parallel.pp_schedule == "zbv"
    assert stages[0 if v_shaped else layout.pp - 1]["head"]  # the V schedule's last chunk is on pp rank 0
    if layout.ep > 1:
        slices = sorted(tuple(k["experts"]) for k in kinds)
        assert slices == [(e, e + 1) for e in range(4)]  # 4 experts over ep 4: one each


def _table_rows(stdout: str, title: str) -> list:
    """The body rows of the rich table whose title line starts with `title`."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("└"))
    body = next(i for i in range(start, end) if lines[i].startswith(("┡", "├"))) + 1
    return [line for line in lines[body:end] if not line.startswith("├")]


@pytest.mark.parametrize(
    "args, ranks",
    [
        (["plan", "recipe=llama3-70b-h100"], 64),
        (["plan", "recipe=mixtral-ep"], 2),
        (
            [
                "plan",
                "recipe=mixtral-ep",
                "cluster.devices_per_node=16",
                "parallel.dp=16",
                "train.global_batch_size=64",
            ],
            16,
        ),
        (["train", "recipe=gpt-3d", "--dry-run"], 8),
        (
            ["plan", "recipe=llama3-70b-h100", "cluster.nodes=512", "parallel.dp=-1", "train.global_batch_size=2048"],
            4096,
        ),
    ],
)
def test_the_report_fits_in_100_columns_with_ranks_grouped(cli, args, ranks):
    ran = cli(*args, env={"COLUMNS": "100"})
    assert ran.code == 0, ran.stdout + ran.stderr
    too_long = [line for line in ran.stdout.splitlines() if len(line) > 100]
    assert too_long == [], too_long[:3]
    report = json.loads(cli(*args, "--json").stdout)
    assert len(report["ranks"]) == ranks  # the JSON keeps every rank
    kinds = report["rank_kinds"]
    rows = _table_rows(ran.stdout, f"ranks: {ranks} in {len(kinds)} kind(s)")
    assert len(rows) == len(kinds) and sum(k["count"] for k in kinds) == ranks
    if ranks >= 16:
        assert len(rows) <= ranks // 4
    assert "process groups" in ran.stdout and "each rank alone" in ran.stdout


@pytest.mark.parametrize("schedule", PP_SCHEDULES)
def test_the_dry_run_prints_every_pipeline_schedule_s_bubble(cli, schedule):
    """The zero-bubble schedules have no closed-form bubble: the dry run said so with a traceback (a None
    formatted as a number) until the line learned to print only the simulation's figure."""
    virtual = 1 if schedule in ("gpipe", "1f1b") else 2
    args = ["recipe=sft-lora", "parallel.pp=2", "parallel.dp=1", f"parallel.pp_schedule={schedule}"]
    args += [f"parallel.pp_virtual_stages={virtual}", "train.global_batch_size=32", "train.eval_batches=0"]
    ran = cli("train", "--dry-run", *args)
    assert ran.code == 0 and "Traceback" not in ran.stderr, ran.stdout + ran.stderr
    assert f"pipeline schedule {schedule}: " in ran.stdout and "simulated" in ran.stdout, ran.stdout


def test_all_ranks_prints_every_rank_and_group(cli):
    ran = cli("plan", "recipe=llama3-70b-h100", "--all-ranks", env={"COLUMNS": "100"})
    assert ran.code == 0
    rows = _table_rows(ran.stdout, "ranks")
    assert [int(re.split(r"[│ ]+", row)[1]) for row in rows] == list(range(64))
    assert "[56,57,58,59,60,61,62,63]" in ran.stdout.replace("│", "").replace("\n", "").replace(" ", "")
    assert "more)" not in ran.stdout.split("process groups")[1].split("pipeline schedule")[0]
    assert all(len(line) <= 100 for line in ran.stdout.splitlines())


def test_the_schedule_picture_keeps_each_rank_on_one_line():
    grid = schedule_grid("interleaved-1f1b", 4, 2, 64)
    lines = render_plain(grid, max_slots=120, line_width=100).splitlines()[: grid.pp]
    assert all(len(line) <= 100 and line.endswith(")") for line in lines), lines
    assert len(render_plain(grid, max_slots=120).splitlines()[0]) > 100  # without a width: 120 slots
    small = schedule_grid("1f1b", 2, 1, 2)
    assert render_plain(small, line_width=100) == render_plain(small)


def test_console_width_when_no_terminal_says_it():
    def no_terminal(fd):
        raise OSError("not a terminal")

    assert report_width({}, no_terminal) == REPORT_WIDTH == 100
    assert report_width({"COLUMNS": "132"}, no_terminal) is None  # rich honours COLUMNS itself
    assert report_width({}, lambda fd: (90, 40)) is None  # a terminal on stdin/stdout/stderr: rich measures it
    assert report_width({}, lambda fd: (0, 0)) == REPORT_WIDTH  # a pseudo-terminal that reports no size


def test_the_report_says_what_the_suite_verified_of_the_family_under_this_layout():
    """The family row: the family x layout matrix's cells this layout touches (docs/families.md)."""
    from partrain.blueprint.report.family_support import family_support

    def support(*overrides):
        return family_support(validate(compose(list(overrides))))

    qwen3 = support("recipe=llama-fsdp-tp", "model=qwen3-tiny")  # dp2 FSDP x tp2 with Megatron-SP
    assert qwen3 == {
        "arch": "qwen3",
        "matrix": True,
        "cells": {"fsdp2": "verified", "tp2-megatron-sp": "verified"},
        "note": "",
    }
    mistral = support(
        "recipe=llama-long-sp", "model=mistral-tiny", "model.config.sliding_window=32", "train.seq_len=64"
    )
    assert mistral["cells"].get("sp2-ulysses") == "refused", mistral
    moe = support("recipe=mixtral-ep")
    assert moe["matrix"] is False and "expert parallelism" in moe["note"]
    assert support("recipe=gpt-3d")["cells"] == {"ddp2": "verified", "tp2": "verified", "pp2-1f1b": "verified"}
