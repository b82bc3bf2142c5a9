"""Checks of an exported HF folder against the checkpoint it came from (tests and benchmarks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import torch


def export_with_cli(
    checkpoint: Path, out: Path, nproc: int, dtype: str = "fp32", timeout_s: int = 600
) -> Dict[str, Any]:
    """`partrain checkpoint export CHECKPOINT --hf OUT --nproc N --dtype D --json`; its JSON report."""
    args = [str(checkpoint), "--hf", str(out), "--nproc", str(nproc), "--dtype", dtype, "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "partrain.cli", "checkpoint", "export", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"export failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def logits_difference(folder: Path, checkpoint: Path, vocab: int = 256, seed: int = 0) -> float:
    """Largest |logit| difference between `AutoModelForCausalLM.from_pretrained(folder)` and the
    model loaded from the checkpoint in one process (fp32, eval mode, the same random ids)."""
    from transformers import AutoModelForCausalLM

    from partrain.checkpoint import load_model_weights

    exported = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32).eval()
    reference, _ = load_model_weights(checkpoint)
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (exported(input_ids=ids).logits - reference.eval()(input_ids=ids).logits).abs().max().item()
