"""The `partrain` command line (Typer). Overrides are Hydra-style positional arguments.

Exit codes: 0 success; 2 bad config or usage (one message per problem, nothing created);
1 a failure while running (or a run that ended without training); 128 + N when stopped by signal N
(130 Ctrl-C, 143 SIGTERM, 129 when torchrun or the workers were lost).
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from partrain.cli.bench_cmds import bench_app
from partrain.cli.checkpoint_cmds import checkpoint_app
from partrain.cli.config_cmds import list_recipes_cmd, show
from partrain.cli.data_cmds import data_app
from partrain.cli.launch_cmds import launch_app
from partrain.cli.plan_cmd import plan
from partrain.cli.rehearse_cmd import rehearse
from partrain.cli.train_cmd import train

# Typer's own --install-completion / --show-completion: tab completion of commands and options.
app = typer.Typer(
    add_completion=True,
    no_args_is_help=True,
    rich_markup_mode="rich",
    help="Declarative parallel training of Hugging Face language models (DP/ZeRO, TP, PP, EP, SP).",
)


def _print_version(value: bool) -> None:
    if not value:
        return
    from importlib.metadata import PackageNotFoundError, version

    from partrain import __version__

    def of(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    # Read from the installed metadata: importing torch would take seconds.
    print(f"partrain {__version__} (torch {of('torch')}, transformers {of('transformers')})")
    raise typer.Exit(0)


@app.callback()
def _root(
    show_version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
) -> None:
    """Declarative parallel training of Hugging Face language models (DP/ZeRO, TP, PP, EP, SP)."""


app.command()(train)
app.command()(plan)
app.command()(rehearse)
app.command()(show)
app.command("recipes")(list_recipes_cmd)


app.add_typer(checkpoint_app, name="checkpoint")
app.add_typer(bench_app, name="bench")
app.add_typer(launch_app, name="launch")
app.add_typer(data_app, name="data")


def command():
    """The click command of `app`, boolean flags shown without a type (typer writes `<bool>` beside
    flags that take no value, which reads as if they did)."""
    from typer import _click
    from typer.main import get_command

    root = get_command(app)

    def plain_flags(cmd) -> None:
        for param in cmd.get_params(_click.Context(cmd, info_name=cmd.name)):
            if getattr(param, "is_bool_flag", False):
                param.metavar = ""
        for sub in getattr(cmd, "commands", {}).values():
            plain_flags(sub)

    plain_flags(root)
    return root


def main(argv: Optional[List[str]] = None) -> None:
    """Console-script entry point."""
    try:
        command().main(args=argv, prog_name="partrain", standalone_mode=True)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
