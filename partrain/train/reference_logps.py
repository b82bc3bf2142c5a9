"""DPO's reference in full fine-tuning: every pair's reference log-probabilities, computed once before the
first step by the run's own model and layout, then cached, so training holds one model (the policy).

Before step 1 of a new run, every row of the usable training and eval pairs goes through the model as it
starts (its initial or pretrained weights, after checkpoint.init_from) without gradients: the data-parallel
ranks split the rows, each runs the same number of microbatches (so FSDP's gathers and the experts'
all-to-all meet), and the per-row sums of log-probabilities are gathered on every rank. Rank 0 writes them
into the examples cache entry beside the rows they score, as `reference-<key>.npy` and its `.json` (the
SHA-256 of the array and what it was computed from); the key hashes what the numbers depend on: the
model's identity (config, pretrained folder's weight files, init_from, seed), precision, seq_len and
long_examples. A resumed run, or one under another layout, reads the same file (its checksum checked);
a resume whose file is gone cannot recompute it from trained weights and fails saying so.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from partrain.blueprint.validate import ValidatedRun
from partrain.data.atomic import write_json
from partrain.data.open_batches import DATA_MANIFEST

log = logging.getLogger(__name__)


def _weights_identity(folder: Optional[str]) -> list:
    """(name, size, mtime) of a pretrained folder's files: a changed checkpoint is another model."""
    if not folder or not Path(folder).expanduser().is_dir():
        return [folder]
    root = Path(folder).expanduser()
    return [(p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in sorted(root.iterdir()) if p.is_file()]


def reference_key(v: ValidatedRun) -> str:
    """A hash of everything the reference log-probabilities depend on besides the rows themselves."""
    run = v.run
    inputs = {
        "arch": run.model.arch,
        "config": dict(run.model.config),
        "pretrained": _weights_identity(run.model.pretrained),
        "init_from": run.checkpoint.init_from,
        "seed": run.train.seed,
        "precision": run.train.precision,
        "seq_len": run.train.seq_len,
        "long_examples": run.data.long_examples,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _paths(v: ValidatedRun, run_dir: Path) -> tuple:
    return table_paths(v, Path(json.loads((Path(run_dir) / DATA_MANIFEST).read_text())["meta_path"]))


def table_paths(v: ValidatedRun, meta_path: Path) -> tuple:
    """(the table, its facts) in the examples cache entry whose meta file is meta_path."""
    stem = Path(meta_path).parent / f"reference-{reference_key(v)}"
    return stem.with_suffix(".npy"), stem.with_suffix(".json")


def table_is_readable(v: ValidatedRun, meta_path: Path) -> bool:
    """Whether the cache entry holds this run's table with a matching checksum (what a resume reads)."""
    return _read(*table_paths(v, meta_path)) is not None


def _read(array_path: Path, facts_path: Path) -> Optional[np.ndarray]:
    """The cached table when its checksum matches, else None."""
    try:
        facts = json.loads(facts_path.read_text())
        data = array_path.read_bytes()
    except (OSError, ValueError):
        return None
    if hashlib.sha256(data).hexdigest() != facts.get("sha256"):
        return None
    return np.load(array_path)


def attach_reference(v: ValidatedRun, engine, batches, evals, run_dir: Path, mesh, start_step: int, events) -> None:
    """Give a full fine-tuning DPO objective its table of reference log-probabilities (computed here at
    a new run's start when the cache has none); nothing for any other objective."""
    objective = getattr(engine, "preference", None)
    if objective is None or objective.kind != "dpo" or objective.reference is not None:
        return
    array_path, facts_path = _paths(v, run_dir)
    table = _read(array_path, facts_path)
    if table is None:
        if start_step > 0:
            raise RuntimeError(
                f"the reference log-probabilities this run started from ({array_path}) are gone or damaged, and "
                "they cannot be recomputed from trained weights: restore the file, or start a new run"
            )
        table = _compute(v, engine, batches, evals, mesh, events)
        if dist.get_rank() == 0:
            temp = array_path.with_name(f".{array_path.name}.{os.getpid()}.tmp")
            with open(temp, "wb") as f:
                np.save(f, table)
            digest = hashlib.sha256(temp.read_bytes()).hexdigest()
            os.replace(temp, array_path)
            write_json(facts_path, {"sha256": digest, "key": reference_key(v), "rows": int(np.isfinite(table).sum())})
        dist.barrier()
    else:
        events("reference", cached=str(array_path), rows=int(np.isfinite(table).sum()))
    objective.table = torch.from_numpy(np.asarray(table, dtype=np.float64))


def _rows_to_score(batches, evals) -> np.ndarray:
    firsts = [batches.firsts] + ([evals.firsts] if evals is not None else [])
    pairs = np.concatenate(firsts)
    return np.stack([pairs, pairs + 1], axis=1).reshape(-1)


@torch.no_grad()
def _compute(v: ValidatedRun, engine, batches, evals, mesh, events) -> np.ndarray:
    rows = _rows_to_score(batches, evals)
    micro = v.run.train.micro_batch_size
    dp_rank, dp_size = mesh.local("dp"), v.layout.dp
    per_rank = -(-len(rows) // dp_size)
    steps = -(-per_rank // micro)
    mine = rows[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    padded = np.resize(mine if len(mine) else rows[:1], steps * micro)  # every rank runs `steps` forwards
    values = []
    for i in range(steps):
        inputs, labels = batches._rows.rows(padded[i * micro : (i + 1) * micro])
        values.append(engine.score_rows(inputs, labels))
        if (i + 1) % max(1, steps // 10) == 0 or i + 1 == steps:
            events("reference", done=(i + 1) * micro * dp_size, total=len(rows))
    scored = torch.cat(values)[: len(mine)]
    out = torch.full((per_rank,), float("nan"), dtype=torch.float64)
    out[: len(scored)] = scored
    gathered = [torch.empty_like(out) for _ in range(dp_size)]
    group = mesh["dp_sp"].get_group() if dp_size > 1 else None
    if group is not None:
        dist.all_gather(gathered, out, group=group)
    else:
        gathered = [out]
    every = torch.cat(gathered)[: len(rows)].numpy()
    table = np.full(int(batches._rows.examples.n_examples), np.nan)
    table[rows] = every
    log.info("reference log-probabilities of %d rows computed", len(rows))
    return table
