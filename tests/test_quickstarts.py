"""Every command of docs/quickstarts.md runs as written (issue 45), in a folder holding what the page
assumes the user has: `my-model/` (a tiny Llama saved by transformers, with a BPE tokenizer and its
chat template), `chats.jsonl` (chats from `partrain data make-chat`), `corpus/` (text files).
`partrain train` runs in its `--dry-run` form (the GPU recipes need GPUs, and the CPU main job is the
README's to run); every other command runs for real. A command that exits non-zero fails here."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import refuse_process_starts
from doc_commands import as_run_here, make_user_folder, shell_commands

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGE = DOCS / "quickstarts.md"


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory) -> Path:
    return make_user_folder(tmp_path_factory.mktemp("user"))


def test_the_page_has_the_commands_it_promises():
    names = [" ".join(c[:2]) for c in shell_commands(PAGE)]
    assert names.count("partrain train") >= 6 and "partrain launch" in names, names


@pytest.mark.parametrize("command", shell_commands(PAGE), ids=lambda c: " ".join(c[1:3]))
def test_a_quickstart_command_works_as_written(command, user_folder, monkeypatch):
    from typer.testing import CliRunner

    from partrain.cli import app

    spawned, _ = refuse_process_starts(monkeypatch)
    monkeypatch.chdir(user_folder)
    monkeypatch.setenv("HOME", str(user_folder / "home"))
    monkeypatch.setenv("COLUMNS", "250")
    result = CliRunner().invoke(app, as_run_here(command), catch_exceptions=False)
    assert result.exit_code == 0, f"{' '.join(command)}\n{result.stdout}\n{result.stderr}"
    assert spawned == []
