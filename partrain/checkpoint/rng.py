"""Per-rank random-number-generator state: `rng/rank-R.pt` in each checkpoint.

Each rank saves its torch CPU generator state (and its current CUDA device's, when CUDA is in use)
as a dict of uint8 tensors with torch.save; a load reads it back with weights_only=True. The
states belong to ranks, so they are restored only when the world size is the one that saved them;
otherwise every rank keeps the state its seed gave it (data order does not depend on these
generators: it is seeded by (seed, epoch), see partrain.data.loader).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Dict

import torch

from partrain.checkpoint.safe_io import load_tensors, save_tensors

log = logging.getLogger("partrain")

RNG_DIR = "rng"


def rng_path(folder: Path, rank: int) -> Path:
    return Path(folder) / RNG_DIR / f"rank-{rank}.pt"


def current_state() -> Dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_rng(folder: Path, rank: int) -> None:
    path = rng_path(folder, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors(path, current_state())


def restore_rng(folder: Path, rank: int, world_size: int, saved_world_size: int) -> bool:
    """Set this rank's generators from the checkpoint; False (and a log line) when not restored."""
    if world_size != saved_world_size:
        log.info("RNG state not restored: saved by %d processes, now %d", saved_world_size, world_size)
        return False
    path = rng_path(folder, rank)
    if not path.is_file():
        log.warning("RNG state not restored: %s is missing", path)
        return False
    state = load_tensors(path)
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(state["cuda"])
    return True
