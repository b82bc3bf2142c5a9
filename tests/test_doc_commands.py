"""Every `partrain` command in README.md and docs/ runs as written (issue 45 item 4), page by page, in the
order the page gives them, in one folder holding what the pages assume a user has (doc_commands.py:
`my-model/`, `chats.jsonl`; here also `rows.jsonl`, `train.jsonl`, `eval.jsonl`, a `my_dataset/`
DatasetDict, and the run folders whose checkpoints the pages export). docs/quickstarts.md has its own
test (test_quickstarts.py).

How each kind runs:
- `train` as its `--dry-run` (the pages' runs need GPUs, nodes, or minutes of CPU); `train`, `plan`, `show`,
  `launch` and the rest must start no process.
- `checkpoint`, `data`, `bench` and `rehearse` for real (an export with `--nproc 2` starts its two processes, a
  rehearsal its layout's).
- The checkpoints the pages read (`runs/demo/checkpoints/step-00000080`, `RUN/checkpoints/...`) come from
  real training runs made first (CHECKPOINTED_RUNS): one process each, tiny shapes (TINY), the page's own
  model and step numbers, so each command finds a checkpoint of the kind the page's run leaves.
A command that exits non-zero fails its page, naming the command and its output."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict, List, Sequence

import pytest
from conftest import refuse_process_starts
from doc_commands import as_run_here, make_user_folder, shell_commands

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "quickstarts.md")]
"""Every page with commands (quickstarts.md: test_quickstarts.py)."""

ONE_PROCESS = ["cluster.devices_per_node=1", "parallel.dp=1", "parallel.tp=1", "parallel.pp=1"]
TINY = ["train.seq_len=32", "train.micro_batch_size=2", "train.global_batch_size=2", "train.eval_every=0"]
"""Shapes that make a run of 100 steps take seconds; the checkpoint's kind (model, full or LoRA) is the page's."""

CHECKPOINTED_RUNS: Dict[str, List[str]] = {
    # README: 40 steps saving every 20, then resumed to 80; the export reads step 80.
    "runs/demo": ["recipe=gpt-dp", "train.steps=80", "checkpoint.every_steps=20"],
    # checkpoints.md: info, verify and export read step 60 of a gpt-dp run saving every 20.
    "runs/mine": ["recipe=gpt-dp", "train.steps=60", "checkpoint.every_steps=20"],
    # fine-tuning.md: the base model, 40 steps of llama-tiny, exported to base/.
    "runs/base": ["model=llama-tiny", "train.steps=40"],
    # fine-tuning.md: RUN0, a full run whose step 60 is a LoRA run's base (checkpoint.init_from).
    "RUN0": ["model=llama-tiny", "train.steps=60"],
    # fine-tuning.md: RUN, a LoRA run whose adapters are exported at steps 60 and 100.
    "RUN": ["model=llama-tiny", "peft=lora", "train.steps=100", "checkpoint.every_steps=60"],
    # preference-tuning.md: runs/sft, recipe=sft-lora's 100 LoRA steps, exported to sft/ for DPO.
    "runs/sft": ["model=llama-tiny", "peft=lora", "train.steps=100"],
}
"""Run folder named by a page -> the overrides of the real run that makes it (ONE_PROCESS and TINY added)."""

MAY_START_PROCESSES = ("checkpoint", "data", "bench", "rehearse")
"""Commands that run for real and may start processes (an export's --nproc workers, a benchmark's ranks, a
rehearsal's layout and reference)."""


def _chats(rows: Sequence[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def _user_data(folder: Path) -> None:
    """The files the pages' data commands name, made from the chats a user would have."""
    chats = [json.loads(line) for line in (folder / "chats.jsonl").read_text().splitlines()]
    (folder / "train.jsonl").write_text(_chats(chats[:4000]))
    (folder / "eval.jsonl").write_text(_chats(chats[4000:4400]))
    # data-formats.md's own layout: dialog / speaker / text with the roles human and bot.
    roles = {"user": "human", "assistant": "bot"}
    turns = [[m for m in c["messages"] if m["role"] in roles] for c in chats[:2000]]
    rows = [{"dialog": [{"speaker": roles[m["role"]], "text": m["content"]} for m in t]} for t in turns]
    (folder / "rows.jsonl").write_text(_chats(rows))
    import datasets

    split = {"train": chats[:4000], "validation": chats[4000:4400]}
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in split.items()}).save_to_disk(
        str(folder / "my_dataset")
    )


def _train_checkpointed_runs(folder: Path) -> None:
    """CHECKPOINTED_RUNS trained for real through the worker's code, one after another in one process."""
    from partrain.rehearse.runs import prepare_run, train_run_dirs
    from partrain.runtime.spawn import run_spawned

    run_dirs = []
    for name, overrides in CHECKPOINTED_RUNS.items():
        run_dir = folder / name
        assert prepare_run([*overrides, *ONE_PROCESS, *TINY, f"data.cache_dir={folder / 'cache'}"], run_dir) == 1
        run_dirs.append(str(run_dir))
    (folder / "processes").mkdir()
    (codes,) = run_spawned(train_run_dirs, 1, folder / "processes", run_dirs, timeout_s=600)
    assert codes == [0] * len(run_dirs), dict(zip(run_dirs, codes))


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    folder = make_user_folder(tmp_path_factory.mktemp("user"), corpus=False)
    _user_data(folder)
    here = Path.cwd()
    os.chdir(folder)  # the pages' relative paths (data.source=chats.jsonl) are the user's folder's
    try:
        _train_checkpointed_runs(folder)
    finally:
        os.chdir(here)
    return folder


def _run(command: List[str], monkeypatch) -> str:
    """One page command as the suite runs it; '' when it exits 0, else what went wrong."""
    from typer.testing import CliRunner

    from partrain.cli import app

    args, redirect = as_run_here(command), None
    if ">" in args:  # `partrain --show-completion bash > FILE`: the shell's redirect, done here
        args, redirect = args[: args.index(">")], Path(os.path.expanduser(args[args.index(">") + 1]))
    with monkeypatch.context() as patch:
        spawned: List[str] = []
        if args[0] not in MAY_START_PROCESSES:
            spawned, _ = refuse_process_starts(patch)
        result = CliRunner().invoke(app, args, catch_exceptions=False)
    if redirect is not None and result.exit_code == 0:
        redirect.parent.mkdir(parents=True, exist_ok=True)
        redirect.write_text(result.stdout)
    if result.exit_code != 0 or spawned:
        return f"$ {' '.join(command)}\nexit {result.exit_code}, started {spawned}\n{result.output[-3000:]}"
    return ""


def test_the_pages_have_commands():
    counts = {p.name: len(shell_commands(p)) for p in PAGES}
    assert sum(counts.values()) >= 50, counts
    for name in ("README.md", "fine-tuning.md", "multi-node.md", "checkpoints.md", "pipeline.md"):
        assert counts[name] > 0, f"{name}: no ```bash block with a partrain command"


@pytest.mark.slow  # a minute or two of real runs, exports and benchmarks: not for the fast tier
@pytest.mark.parametrize("page", [p for p in PAGES if shell_commands(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_of_a_page_works_as_written(page, user_folder, monkeypatch):
    monkeypatch.chdir(user_folder)
    monkeypatch.setenv("HOME", str(user_folder / "home"))
    monkeypatch.setenv("COLUMNS", "250")
    failed = [f for f in (_run(c, monkeypatch) for c in shell_commands(page)) if f]
    assert not failed, f"{page.relative_to(ROOT)}: {len(failed)} command(s) failed\n\n" + "\n\n".join(failed)
