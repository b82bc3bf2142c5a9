"""The suite's two shortcuts over partrain.rehearse.runs.train_all.

`train_with_references` trains parity layouts with the one-process reference each is compared with.
`train_cases` (the older, narrower form) trains cases that read one prepared data set (a run folder that
`partrain train` already prepared: its data.json) through mesh -> build_engine -> Trainer.train_step, and
returns per-step losses and gradient norms, plus what the gradient sync reports (bytes, overlap) where the
case uses `parallel.dp_sync`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Sequence, Tuple

from partrain.rehearse.parity import RunRecord, parity_args, reference_overrides
from partrain.rehearse.runs import train_all


def train_cases(rank: int, world: int, data_run_dir: str, cases: Sequence[Sequence[str]], steps: int) -> List[dict]:
    """For run_spawned: every case's record on this rank (each case must use `world` processes)."""
    import torch

    from partrain.blueprint.config.compose import compose
    from partrain.blueprint.validate import validate
    from partrain.data import TokenBatches, open_packed
    from partrain.runtime.mesh import build_mesh
    from partrain.train.assemble import build_engine
    from partrain.train.loop import Trainer
    from partrain.train.metrics import MetricsWriter

    packed = open_packed(json.loads((Path(data_run_dir) / "data.json").read_text())["meta_path"])
    out = []
    for overrides in cases:
        v = validate(compose(list(overrides)))
        if v.world_size != world:
            raise ValueError(f"case {overrides} needs {v.world_size} processes, not {world}")
        torch.manual_seed(v.run.train.seed)
        mesh = build_mesh(v.layout, "cpu")
        engine = build_engine(v, mesh, torch.device("cpu"))
        batches = TokenBatches.from_packed(packed, v.run.train.seq_len, v.global_batch_size, v.run.train.seed)
        trainer = Trainer(v, mesh, engine, batches, None, MetricsWriter(Path(data_run_dir), enabled=False), False)
        results = [trainer.train_step() for _ in range(steps)]
        record = {"losses": [r.loss for r in results], "grad_norms": [r.grad_norm for r in results]}
        record["model_state_bytes"] = trainer.state.model_state_bytes
        sync = getattr(getattr(engine, "dp", None), "sync", None)
        if sync is not None:
            record["counter"] = sync.counter.to_json()
            if sync.bucketed is not None:
                record["overlap"] = sync.bucketed.stats.to_json()
                sync.bucketed.close()
        out.append(record)
    return out


def train_with_references(
    layouts: Mapping[str, Sequence[str]],
    reference_of: Callable[[str], Tuple[str, Sequence[str]]],
    steps: int,
    root: Path,
) -> Dict[str, RunRecord]:
    """Parity runs (`steps` steps, no eval) of every layout and of the one-process reference each is
    compared with: reference_of(name) gives (the reference's name, the overrides it keeps of the
    layout; testing.parity.reference_overrides turns them into one process). A reference shared by
    several layouts trains once; the runs share one launch per process count (train_all)."""
    cases: Dict[str, List[str]] = {}
    for name, overrides in layouts.items():
        reference_name, kept = reference_of(name)
        cases[reference_name] = parity_args(reference_overrides(kept), steps)
        cases[name] = parity_args(overrides, steps)
    return train_all(cases, root)
