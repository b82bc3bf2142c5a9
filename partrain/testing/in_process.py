"""Train several configs one after another inside processes that are already running.

One `run_spawned` launch pays process start-up and imports once; `train_cases` then composes,
validates and trains each case through the real path (mesh -> build_engine -> Trainer.train_step)
and returns the per-step losses and gradient norms, plus what the gradient sync reports (bytes,
overlap) where the case uses `parallel.dp_sync`. The data comes from a run folder that
`partrain train` already prepared (its data.json), so every case reads the same packed tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Sequence


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
