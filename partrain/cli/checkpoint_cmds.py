"""`partrain checkpoint info | export | verify`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from partrain.cli.common import JSON, fail, stdout_console
from partrain.errors import ConfigError, Problem

checkpoint_app = typer.Typer(help="Inspect and export distributed checkpoints.", no_args_is_help=True)


@checkpoint_app.command("info")
def checkpoint_info_cmd(
    path: Path = typer.Argument(..., help="A checkpoint folder (RUN_DIR/checkpoints/step-NNNNNNNN)."),
    as_json: bool = JSON,
) -> None:
    """Show a checkpoint's step, layout it was saved under, model, size and tensor count."""
    from partrain.checkpoint import checkpoint_info

    try:
        info = checkpoint_info(path)
    except ConfigError as err:
        fail(err, as_json)
    if as_json:
        print(json.dumps(info, default=str))
        return
    from rich.table import Table

    table = Table(title=f"checkpoint {path}", show_header=False, title_justify="left")
    for key in ("step", "time", "world_size", "layout", "model", "size_bytes", "n_tensors", "n_parameters", "version"):
        if key in info:
            value = info[key]
            if key == "model" and isinstance(value, dict):
                value = f"{value.get('arch')} {value.get('name', '')}".strip()
            table.add_row(key, str(value))
    table.add_row("checksums", "SHA-256 of every file" if info.get("checksums") else "none (sizes only)")
    stdout_console().print(table)


@checkpoint_app.command("export")
def checkpoint_export_cmd(
    path: Path = typer.Argument(..., help="A checkpoint folder."),
    hf: Optional[Path] = typer.Option(
        None, "--hf", help="Output folder for an HF save_pretrained model (a LoRA checkpoint's: adapters merged)."
    ),
    peft: Optional[Path] = typer.Option(
        None, "--peft", help="Output folder for a LoRA checkpoint's adapters in PEFT's format (PeftModel loads it)."
    ),
    tokenizer: Optional[Path] = typer.Option(
        None, "--tokenizer", help="Local HF tokenizer folder to copy (default: the run's, if any)."
    ),
    nproc: int = typer.Option(
        1, "--nproc", help="Processes writing shards in parallel: N gives model-0000k-of-0000N.safetensors."
    ),
    dtype: str = typer.Option("fp32", "--dtype", help="Dtype of the exported weights: fp32, bf16 or fp16."),
    as_json: bool = JSON,
) -> None:
    """Write an HF `save_pretrained` folder (safetensors shards + index + config [+ tokenizer]) from a
    checkpoint; each of --nproc processes reads only the tensors of its own shard. With --peft: the
    adapters of a peft=lora checkpoint (adapter_config.json + adapter_model.safetensors)."""
    if (hf is None) == (peft is None):
        fail(ConfigError(Problem("--hf", hf, "pass exactly one of --hf OUT and --peft OUT", "e.g. --hf out/")), as_json)
    if peft is not None:
        _export_peft(path, peft, as_json)
        return
    from partrain.blueprint.problems import storage_error_words
    from partrain.checkpoint import export_hf_report
    from partrain.preflight import folder_problems

    try:
        if problems := folder_problems("--hf", hf):
            raise ConfigError(problems)
        report = export_hf_report(path, hf, str(tokenizer) if tokenizer else None, nproc=nproc, dtype=dtype)
    except ConfigError as err:
        fail(err, as_json)
    except Exception as exc:  # the disk filling up while writing (safetensors wraps it): one line, no traceback
        if storage_error_words(exc) is None:
            raise
        Console(stderr=True, highlight=False).print(f"export to {hf} failed: {storage_error_words(exc)}", markup=False)
        raise typer.Exit(1)
    if as_json:
        print(json.dumps(report))
    else:
        loads = "AutoModelForCausalLM.from_pretrained loads it offline"
        shards = len(report["shards"])
        what = f"{shards} shard{'s' if shards > 1 else ''}, {dtype}"
        stdout_console().print(f"exported to [cyan]{report['exported']}[/cyan] ({what}; {loads})")


def _export_peft(path: Path, out: Path, as_json: bool) -> None:
    from partrain.checkpoint.export_peft import export_peft
    from partrain.preflight import folder_problems

    try:
        if problems := folder_problems("--peft", out):
            raise ConfigError(problems)
        report = export_peft(path, out)
    except ConfigError as err:
        fail(err, as_json)
    if as_json:
        print(json.dumps(report))
        return
    what = f"{report['tensors']} adapter tensors, r={report['r']}"
    stdout_console().print(f"exported to [cyan]{report['exported']}[/cyan] ({what}; peft.PeftModel loads it)")


@checkpoint_app.command("verify")
def checkpoint_verify_cmd(
    path: Path = typer.Argument(..., help="A checkpoint folder, or a folder of them (RUN_DIR/checkpoints)."),
    as_json: bool = JSON,
) -> None:
    """Check each file's size and SHA-256 and DCP's index: one line per problem; exit 0 intact, 1 damaged."""
    from partrain.checkpoint.verify import report_json, report_lines, verify_path

    try:
        verdicts = verify_path(path)
    except ConfigError as err:
        fail(err, as_json)
    print(json.dumps(report_json(path, verdicts)) if as_json else "\n".join(report_lines(verdicts)))
    raise typer.Exit(0 if all(v.ok for v in verdicts) else 1)
